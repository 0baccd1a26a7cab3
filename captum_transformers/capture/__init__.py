"""How a model is observed: trace records, the recorder, target resolution, and
:mod:`~captum_transformers.model_state.patching`, the only module that mutates a model (reversibly)."""
