"""Movie snippets: Rotten Tomatoes sentences as a sentiment task, and the fine-tuned MiniLM.
"""
