"""The generation page: a causal LM generates greedily from a prompt and each generated token
is explained by the chosen methods.

``workspace`` holds the model, its tokenizer and the cached generations and results;
``sources`` builds workspaces from command-line arguments; ``app`` the page's routes;
``export`` the self-contained HTML view.
"""
