"""The API reference (docs/api/*.md, rendered by mkdocstrings) covers every public name.

Public: each name in the ``__all__`` of ``captum_transformers`` and of the subpackages users
import, and every ``load_*`` function of ``captum_transformers.tasks``. A name is covered by a
``::: path`` entry that imports to the very same object (any path: a name that several packages
export is documented once; the defining module for names a package exports lazily). Every
public class and function also needs a docstring: mkdocstrings would render an empty entry,
and ``mkdocs build --strict`` does not see that.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
PACKAGES = ("captum_transformers", "captum_transformers.adapters", "captum_transformers.methods",
            "captum_transformers.visualization", "captum_transformers.evaluation", "captum_transformers.integrations.insights",
            "captum_transformers.integrations.pyg", "captum_transformers.explorer", "captum_transformers.models",
            "captum_transformers.corpus")
OPTIONAL = {"captum_transformers.integrations.pyg": "torch_geometric", "captum_transformers.explorer": "starlette",
            "captum_transformers.models": "transformers", "captum_transformers.visualization": "matplotlib",
            "captum_transformers.corpus": "pyarrow"}


def entries() -> list[str]:
    return [m.group(1) for page in sorted(API.glob("*.md"))
            for m in re.finditer(r"^:::\s+(\S+)\s*$", page.read_text(encoding="utf-8"), re.M)]


def resolve(path: str) -> list:
    """What ``path`` can name: the longest importable module then attributes, and attributes
    from the top package (a function and its module may share a name)."""
    parts, found = path.split("."), []
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
            found.append(obj)
        except AttributeError:
            pass
    assert found, f"::: {path} names nothing importable"
    return found


def public_names():
    names = []
    for package in PACKAGES:
        if package in OPTIONAL:
            pytest.importorskip(OPTIONAL[package])
        module = importlib.import_module(package)
        names += [(package, name) for name in module.__all__]
    pytest.importorskip("sklearn")
    tasks = importlib.import_module("captum_transformers.tasks")
    for info in pkgutil.iter_modules(tasks.__path__):
        try:
            module = importlib.import_module(f"captum_transformers.tasks.{info.name}")
        except ModuleNotFoundError as error:  # an optional dependency of that task (not the package)
            if (error.name or "").startswith("captum_transformers"):
                raise
            continue
        names += [(module.__name__, name) for name, obj in vars(module).items()
                  if name.startswith("load_") and inspect.isfunction(obj) and obj.__module__ == module.__name__]
    return names


def test_api_pages_exist_and_are_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(API.glob("*.md"))
    assert pages
    for page in pages:
        assert f"api/{page.name}" in nav, f"docs/api/{page.name} is not in mkdocs.yml's nav"


def test_every_public_name_has_an_api_entry():
    pytest.importorskip("transformers")
    paths = entries()
    missing = []
    for package, name in public_names():
        # An entry of any path that names the same object (a name re-exported by several packages
        # is documented once).
        expected = getattr(importlib.import_module(package), name)
        candidates = [p for p in paths if p.rsplit(".", 1)[-1] == name]
        if not any(expected is obj for p in candidates for obj in resolve(p)):
            missing.append(f"{package}.{name}")
    assert not missing, ("public names missing from docs/api/*.md (add a '::: path' line to the page of their "
                         f"package): {missing}")


def test_every_api_entry_imports():
    pytest.importorskip("transformers")
    pytest.importorskip("torch_geometric")
    for path in entries():
        resolve(path)


def test_every_public_class_and_function_has_a_docstring():
    pytest.importorskip("transformers")
    undocumented = []
    for package, name in public_names():
        obj = getattr(importlib.import_module(package), name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            undocumented.append(f"{package}.{name}")
    assert not undocumented, f"public names without a docstring: {undocumented}"
