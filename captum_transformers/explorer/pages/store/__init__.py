"""The store page: a corpus job's Parquet store (:mod:`captum_transformers.corpus`) opened in
the explorer, its rows paged, searched and sorted, one row's map drawn on demand.

``index`` reads the store's light columns once and answers queries; ``app`` the page's routes.
"""
