"""Import a script under benchmarks/ as a module for the benchmark smoke tests (the folder is no package)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@contextlib.contextmanager
def benchmark_script(file_name: str, module_name: str):
    """Yield ``benchmarks/<file_name>`` loaded as module ``module_name``; registered in ``sys.modules`` while in
    use (dataclasses resolve annotations through it) and removed after."""
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(BENCHMARKS, file_name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def load_benchmark_script(file_name: str, module_name: str):
    """``benchmarks/<file_name>`` loaded as module ``module_name``, registered in ``sys.modules`` only while it runs."""
    with benchmark_script(file_name, module_name) as module:
        return module
