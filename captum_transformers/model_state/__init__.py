"""The only code that mutates a model, always reversibly and per instance: patching and its
helpers (contextual changes, exclusive holding, user-hook isolation, module walks, accelerate offload).
"""
