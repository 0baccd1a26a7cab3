"""Row layouts and the chains written once over them (captum_transformers/capture/row_chains.py).

1. On a dense layout each chain is the explained row of the explicit matrix product:
   ``(I + Abar_L) ... (I + Abar_1)``, ``rownorm(I + A_L) ... rownorm(I + A_1)`` (with and
   without discarded entries), the last map's row with padding zeroed; ``None`` skips a call.
2. The windowed layout's operations equal the dense operations on the equivalent
   block-diagonal N x N map (shifted, padded windows), and a patch merging is the dense
   coarse-to-fine matrix; the chains over both agree to 1e-12 in float64.
3. Importing ``methods.base`` reaches no method module (no import circle through a method).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch
from torch import nn

from captum_transformers import AttentionFlow, AttentionRollout, InputError, RawAttention
from captum_transformers.capture.trace import AttentionRecord, AttentionTrace, Block, TokenLayout
from captum_transformers.capture.windows import WindowedLayout, WindowGeometry
from captum_transformers import functional
from captum_transformers.capture.row_chains import (DenseRows, WindowedRows, last_map_row, relevance_chain,
                                                    rollout_chain, row_layout)
from swin_models import dense_merge, dense_window_map

F64 = torch.float64
BLOCK = Block("attention", nn.Identity())


def _maps(count, batch, tokens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(batch, tokens, tokens, generator=generator, dtype=F64).softmax(-1) for _ in range(count)]


def _dense_trace(maps, query_rows, mask=None, weights=None):
    records = tuple(AttentionRecord(BLOCK, i, value, value) for i, value in enumerate(maps))
    layout = TokenLayout(maps[0].shape[-1], query_rows, mask, query_weights=weights)
    return AttentionTrace(records, layout, torch.zeros(maps[0].shape[0], 2), None)


def _start(trace):
    layout = trace.layout
    return functional.query_vectors(layout.query_rows, layout.num_tokens, F64, layout.query_weights)


def _product_row(start, matrices):
    """``start @ M_L @ ... @ M_1`` with full matrices (the layers' product, later on the left)."""
    row = start.unsqueeze(1)
    for matrix in reversed(matrices):
        row = row @ matrix
    return row.squeeze(1)


# == 1. dense chains are the matrix products ======================================================
def test_dense_relevance_chain_is_the_product_of_identity_plus_maps():
    maps = _maps(3, batch=2, tokens=5)
    trace = _dense_trace(maps, torch.tensor([[0, 2], [4, 4]]), weights=torch.tensor([[.25, .75], [.5, .5]], dtype=F64))
    eye = torch.eye(5, dtype=F64)
    expected = _product_row(_start(trace), [eye + m for m in maps])
    torch.testing.assert_close(relevance_chain(row_layout(trace), maps), expected, rtol=0, atol=1e-12)
    # A call left out (start_layer) is a factor left out.
    skipped = relevance_chain(row_layout(trace), [None, *maps[1:]])
    torch.testing.assert_close(skipped, _product_row(_start(trace), [eye + m for m in maps[1:]]), rtol=0, atol=1e-12)
    assert not torch.allclose(skipped, expected)


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_dense_rollout_chain_is_the_product_of_normalised_maps(ratio):
    maps = [m * 0.5 for m in _maps(3, batch=2, tokens=6, seed=1)]  # rows below one: the norm matters
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    trace = _dense_trace(maps, torch.tensor([[0], [1]]), mask)
    valid = mask[:, :, None] & mask[:, None, :]
    eye = torch.eye(6, dtype=F64)
    corrected = [functional.add_identity_and_normalize(functional.discard_lowest(m, ratio, valid)) for m in maps]
    expected = _product_row(_start(trace), corrected)
    rows = rollout_chain(row_layout(trace), maps, discard_ratio=ratio)
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, dtype=F64), rtol=0, atol=1e-12)
    if ratio == 0:
        by_hand = _product_row(_start(trace), [(eye + m) / (eye + m).sum(-1, keepdim=True) for m in maps])
        torch.testing.assert_close(rows, by_hand, rtol=0, atol=1e-12)


def test_dense_last_map_row_reads_the_last_map_with_padding_zeroed():
    maps = _maps(2, batch=2, tokens=4, seed=2)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    trace = _dense_trace(maps, torch.tensor([[0], [1]]), mask)
    expected = _product_row(_start(trace), [maps[-1] * mask[:, None, :].to(F64)])
    row = last_map_row(row_layout(trace), maps)
    torch.testing.assert_close(row, expected, rtol=0, atol=1e-12)
    assert bool((row[1, 2:] == 0).all()) and bool((row[1, :2] > 0).all())


def test_the_chains_refuse_when_no_call_is_left():
    trace = _dense_trace(_maps(1, 1, 3), torch.tensor([[0]]))
    with pytest.raises(InputError, match="No attention call"):
        relevance_chain(row_layout(trace), [None])


# == 2. windowed operations are the dense ones on the block-diagonal map ==========================
# Call 0: a 5x7 grid, windows 2x2 shifted by 1 (HF: pad first), padded to 6x8; a 2x2 merging
# to 3x4; call 1: windows 2x2 over it (timm order: shift, then pad), shifted by 1.
GEOMETRIES = (WindowGeometry((5, 7), (2, 2), (1, 1), pad_first=True),
              WindowGeometry((3, 4), (2, 2), (1, 1), pad_first=False))


def _windowed_trace(batch=2, seed=3):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.rand(batch, g.num_windows * g.window_area, g.window_area, generator=generator, dtype=F64)
              .softmax(-1) for g in GEOMETRIES]
    records = tuple(AttentionRecord(BLOCK, i, value, value) for i, value in enumerate(values))
    first = GEOMETRIES[0]
    layout = WindowedLayout(first.num_tokens, torch.arange(first.num_tokens).expand(batch, -1), grid=first.grid,
                            windows=GEOMETRIES)
    return AttentionTrace(records, layout, torch.zeros(batch, 2), None), values


def test_windowed_operations_equal_the_dense_block_diagonal_map():
    trace, values = _windowed_trace()
    rows = row_layout(trace)
    assert isinstance(rows, WindowedRows) and isinstance(row_layout(_dense_trace(_maps(1, 1, 2), torch.tensor([[0]]))),
                                                         DenseRows)
    generator = torch.Generator().manual_seed(4)
    for index, (geometry, value) in enumerate(zip(GEOMETRIES, values)):
        dense = dense_window_map(value, geometry)  # (B, N, N), padded keys dropped
        row = torch.rand(2, geometry.num_tokens, generator=generator, dtype=F64)
        torch.testing.assert_close(rows.carry(row, index, value), _product_row(row, [dense]), rtol=0, atol=1e-12)
        torch.testing.assert_close(rows.key_sums(index, value, F64), dense.sum(-1), rtol=0, atol=1e-12)
        assert torch.equal(rows.real_map(index, value), value)  # the geometry leaves padding out already
    coarse = torch.rand(2, GEOMETRIES[1].num_tokens, generator=generator, dtype=F64)
    torch.testing.assert_close(rows.to_previous(coarse, 1), coarse @ dense_merge(GEOMETRIES[0].grid), rtol=0, atol=1e-12)
    assert torch.equal(rows.to_previous(coarse, 0), coarse)  # nothing before the first call
    torch.testing.assert_close(rows.start(values[0]), torch.full((2, 12), 1 / 12, dtype=F64), rtol=0, atol=0)


def test_windowed_chains_equal_the_dense_chains():
    trace, values = _windowed_trace()
    rows = row_layout(trace)
    dense = [dense_window_map(v, g) for v, g in zip(values, GEOMETRIES)]
    merge = dense_merge(GEOMETRIES[0].grid)
    start = torch.full((2, 12), 1 / 12, dtype=F64)
    eye0, eye1 = torch.eye(35, dtype=F64), torch.eye(12, dtype=F64)

    def normalised(matrix, eye):
        return (eye + matrix) / (eye + matrix).sum(-1, keepdim=True)

    relevance = start.unsqueeze(1) @ (eye1 + dense[1]) @ merge @ (eye0 + dense[0])
    rollout = start.unsqueeze(1) @ normalised(dense[1], eye1) @ merge @ normalised(dense[0], eye0)
    last = start.unsqueeze(1) @ dense[1] @ merge
    torch.testing.assert_close(relevance_chain(rows, values), relevance.squeeze(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(rollout_chain(rows, values), rollout.squeeze(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(last_map_row(rows, values), last.squeeze(1), rtol=0, atol=1e-12)


def test_windowed_refusals_name_the_windows():
    trace, values = _windowed_trace()
    with pytest.raises(InputError, match="discard_ratio=0.5 .* not defined on windowed attention"):
        rollout_chain(row_layout(trace), values, discard_ratio=0.5)
    model = nn.MultiheadAttention(4, 1)  # any supported model: stream_scores reads only the trace
    with pytest.raises(InputError, match="discard_ratio"):
        AttentionRollout(model, discard_ratio=0.5).stream_scores(trace)
    with pytest.raises(InputError, match="AttentionFlow has no definition on windowed attention"):
        AttentionFlow(model).stream_scores(trace)
    assert RawAttention(model).stream_scores(trace)["tokens"].shape == (2, 35)


# == 3. no import circle ==========================================================================
def _imported_modules(path: Path, name: str) -> set:
    """The package modules a module's source imports (at module level or inside functions)."""
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("captum_transformers"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            if not base.startswith("captum_transformers"):
                continue
            for alias in node.names:  # `from . import functional` imports a submodule
                found.add(f"{base}.{alias.name}" if importlib.util.find_spec(base).submodule_search_locations
                          and importlib.util.find_spec(f"{base}.{alias.name}") else base)
    return found


def test_importing_the_method_base_imports_no_method():
    import captum_transformers.methods as methods
    from captum_transformers.methods.base import TraceAttribution
    from captum_transformers.methods.lrp import RuleGradientXInput

    method_modules = set()
    for info in pkgutil.iter_modules(methods.__path__):
        module = importlib.import_module(f"{methods.__name__}.{info.name}")
        if any(issubclass(cls, (TraceAttribution, RuleGradientXInput)) and cls.__module__ == module.__name__
               for _, cls in inspect.getmembers(module, inspect.isclass)):
            method_modules.add(module.__name__)
    method_modules.discard("captum_transformers.methods.base")
    assert {"captum_transformers.methods.raw_attention", "captum_transformers.methods.rollout"} <= method_modules

    # Every module base's own imports reach (a package's __init__ only where it is imported itself).
    seen, todo = set(), ["captum_transformers.methods.base"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        spec = importlib.util.find_spec(name)
        todo.extend(_imported_modules(Path(spec.origin), name) - seen)
    assert "captum_transformers.capture.row_chains" in seen
    assert not seen & method_modules, sorted(seen & method_modules)


def test_row_normalised_transformer_relevance_on_swin_is_the_normalised_product():
    # The same chain as rollout's, over the relevance maps: before the row chains, windowed
    # models silently ignored row_normalize=True.
    pytest.importorskip("transformers")
    from captum_transformers import TransformerRelevance
    from swin_models import dense_rows, hf_swin

    model = hf_swin(depths=(2, 2), heads=(2, 2), window=4, dtype=F64)
    x = torch.randn(2, 3, 36, 44, generator=torch.Generator().manual_seed(5), dtype=F64)
    explainer = TransformerRelevance(model, row_normalize=True)
    trace = explainer.trace(x, target=[0, 2])

    def normalised(dense):
        eye = torch.eye(dense.shape[-1], dtype=F64)
        return (eye + dense) / (eye + dense).sum(-1, keepdim=True)

    expected = dense_rows(trace, [r.backward_value for r in trace.records], normalised)
    rows = explainer.stream_scores(trace)["tokens"]
    torch.testing.assert_close(rows, expected, rtol=1e-12, atol=1e-14)
    # Rows of rownorm(I + Abar) products sum to one; Eq. 14's (I + Abar) products grow.
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, dtype=F64), rtol=0, atol=1e-12)
    plain = TransformerRelevance(model).stream_scores(trace)["tokens"]
    assert bool(((plain.sum(-1) - 1).abs() > 1e-9).all())
