"""The explorer's two pages, one subpackage each: ``classifier`` (image and text classifiers:
the methods x examples grid, curves, export) and ``generation`` (a causal LM: each generated
token explained). Each holds its routes (``app``), what it explains (``workspace``), the
workspaces the command line opens (``sources``) and its self-contained HTML view (``export``).
What they serve alike lives in ``explorer.http``; which page serves which workspace is the
table ``explorer.app.PAGES``.
"""
