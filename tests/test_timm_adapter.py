"""timm adapter x every attention method: shapes, batching, exact attention, layout, restore."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")
from timm.models.deit import VisionTransformerDistilled  # noqa: E402
from timm.models.eva import Eva  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

import captum_transformers  # noqa: E402
from captum_transformers import (ATTENTION_METHODS, CaptureError, CaptureSpec, GenericAttention,  # noqa: E402
                                 RawAttention, get_adapter)
from captum_transformers.engine.runner import run_trace
from restore import raising_after  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _perturbed(model):
    # timm's init gives near-uniform attention; perturbing the weights makes the maps peaked,
    # so a wrong probability tensor could not pass the comparisons below by accident.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


# name -> (builder, input height, input width)
CASES = {
    "vit": (lambda: VisionTransformer(**TINY), 32, 32),
    "vit_create_model": (lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY), 32, 32),
    "deit_distilled": (lambda: VisionTransformerDistilled(**TINY), 32, 32),
    "registers_avg": (lambda: VisionTransformer(**TINY, class_token=False, reg_tokens=2, global_pool="avg"), 32, 32),
    "cls_registers_avgmax": (lambda: VisionTransformer(**TINY, reg_tokens=1, global_pool="avgmax"), 32, 32),
    "eva_rope_avg": (lambda: Eva(**TINY, use_rot_pos_emb=True), 32, 32),
    "eva_attnrope_token": (lambda: Eva(**TINY, use_rot_pos_emb=True, attn_type="rope", global_pool="token"), 32, 32),
    "nonsquare_dynamic": (lambda: VisionTransformer(**TINY | {"dynamic_img_size": True}), 32, 48),
    "nonsquare_fixed": (lambda: VisionTransformer(**TINY | {"img_size": (24, 40)}), 24, 40),
}
CASE_NAMES = sorted(CASES)
METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS]


def _make(case, batch=2):
    builder, height, width = CASES[case]
    model = _perturbed(builder())
    return model, torch.randn(batch, 3, height, width)


def _full_probs(model, x):
    """Every captured (B, H, N, N) map, through the adapter's own capture loop."""
    spec = CaptureSpec(forward_reduce=lambda probs: probs.clone())
    trace = run_trace(get_adapter(model), model, (x,), (), None, spec)
    return [record.forward_value for record in trace.records], trace


def _attention_inputs_and_outputs(model, x):
    """Inputs and outputs of every attention module in a plain (fused, unhooked) forward."""
    seen = []
    handles = [block.attn.register_forward_hook(lambda m, args, kwargs, out: seen.append((args[0], kwargs, out)),
                                                with_kwargs=True) for block in model.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _qkv(attn, x):
    batch, tokens, _ = x.shape
    bias = attn.qkv.bias
    if getattr(attn, "q_bias", None) is not None:  # EvaAttention keeps its biases apart (k has none)
        bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
    qkv = F.linear(x, attn.qkv.weight, bias).reshape(batch, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    return qkv.unbind(0)


# -- every method ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("method", METHODS)
def test_method_shapes_and_batching(case, method):
    model, x = _make(case, batch=3)
    targets = [0, 3, 4]
    explainer = method(model)
    attributions = explainer.attribute(x, target=targets)
    assert attributions.shape == x.shape
    assert attributions.is_contiguous()
    assert torch.isfinite(attributions).all()
    if method.__name__ != "AttentionGradCAM":  # Grad-CAM's ReLU can legitimately zero a random model's map
        assert attributions.abs().sum() > 0
    # A batch of N explains each example as N batches of one would.
    batched = explainer.attribute(x, target=targets, return_tokens=True)
    singles = torch.cat([explainer.attribute(x[i:i + 1], target=targets[i], return_tokens=True) for i in range(3)])
    torch.testing.assert_close(batched, singles, atol=1e-5, rtol=1e-4)


# -- the captured attention is the model's attention -------------------------------------
@pytest.mark.parametrize("case", ["vit", "deit_distilled", "registers_avg", "nonsquare_dynamic"])
def test_captured_probs_equal_manual_softmax(case):
    model, x = _make(case)
    inputs = [args for args, _, _ in _attention_inputs_and_outputs(model, x)]
    captured, _ = _full_probs(model, x)
    assert len(captured) == len(model.blocks)
    for block, block_input, probs in zip(model.blocks, inputs, captured):
        q, k, _ = _qkv(block.attn, block_input)
        expected = torch.softmax(q @ k.transpose(-2, -1) * block.attn.scale, dim=-1)
        torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    # The method pipeline reads the same numbers: RawAttention = last layer's mean-head row(s).
    rows = _full_probs(model, x)[1].layout.query_rows[0]
    tokens = RawAttention(model).attribute(x, return_tokens=True)
    torch.testing.assert_close(tokens, expected.mean(dim=1)[:, rows].mean(dim=1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_captured_probs_reproduce_fused_attention_output(case):
    # Independent of how q and k are formed (RoPE, q/k norms): the captured maps times the
    # values must give what the unpatched SDPA path computed.
    model, x = _make(case)
    plain = _attention_inputs_and_outputs(model, x)
    captured, _ = _full_probs(model, x)
    for block, (block_input, _, output), probs in zip(model.blocks, plain, captured):
        attn = block.attn
        _, _, v = _qkv(attn, block_input)
        mixed = (probs @ v).transpose(1, 2).reshape(block_input.shape[0], block_input.shape[1], -1)
        torch.testing.assert_close(attn.proj(attn.norm(mixed)), output, atol=1e-5, rtol=1e-4)


# -- layout ------------------------------------------------------------------------------
def test_deit_distilled_layout_uses_cls_and_dist_rows():
    model, x = _make("deit_distilled")
    layout = GenericAttention(model).trace(x, target=1).layout
    assert layout.num_prefix_tokens == 2
    assert layout.grid == (4, 4) and layout.num_tokens == 18
    assert layout.query_rows.tolist() == [[0, 1], [0, 1]]
    # Training with distillation returns (cls_logits, dist_logits); the first is explained.
    model.set_distilled_training(True)
    model.train()
    layout = GenericAttention(model).trace(x, target=1).layout
    assert layout.query_rows.tolist() == [[0], [0]]


@pytest.mark.parametrize("case, prefix, first_row", [
    ("vit", 1, None), ("registers_avg", 2, 2), ("cls_registers_avgmax", 2, 2), ("eva_rope_avg", 1, 1),
    ("eva_attnrope_token", 1, None),
])
def test_pooling_decides_query_rows(case, prefix, first_row):
    model, x = _make(case)
    layout = GenericAttention(model).trace(x, target=1).layout
    assert layout.num_prefix_tokens == prefix
    if first_row is None:
        assert layout.query_rows.tolist() == [[0], [0]]
    else:
        assert layout.query_rows.tolist() == [list(range(first_row, layout.num_tokens))] * 2


def test_pool_include_prefix_explains_every_token():
    model = _perturbed(VisionTransformer(**TINY, global_pool="avg", pool_include_prefix=True))
    layout = GenericAttention(model).trace(torch.randn(1, 3, 32, 32), target=1).layout
    assert layout.query_rows.tolist() == [list(range(17))]


@pytest.mark.parametrize("case, grid", [("nonsquare_dynamic", (4, 6)), ("nonsquare_fixed", (3, 5))])
def test_non_square_grid(case, grid):
    model, x = _make(case)
    layout = GenericAttention(model).trace(x, target=1).layout
    assert layout.grid == grid and layout.num_tokens == 1 + grid[0] * grid[1]


def test_attention_pooling_is_refused():
    model = _perturbed(VisionTransformer(**TINY, class_token=False, global_pool="map"))
    with pytest.raises(CaptureError, match="attention-pooling"):
        GenericAttention(model).attribute(torch.randn(1, 3, 32, 32), target=1)


def test_no_attention_module_is_an_error():
    model = _perturbed(VisionTransformer(**TINY))
    model.blocks = torch.nn.Sequential()
    with pytest.raises(CaptureError, match="no timm attention module"):
        RawAttention(model).attribute(torch.randn(1, 3, 32, 32))


def test_parallel_scaling_block_is_supported():
    # Its attention lives in the block itself (fused_attn / attn_drop on the block).
    from timm.models.vision_transformer import ParallelScalingBlock

    model = _perturbed(VisionTransformer(**TINY, block_fn=ParallelScalingBlock))
    x = torch.randn(2, 3, 32, 32)
    trace = GenericAttention(model).trace(x, target=1)
    assert [r.block.name for r in trace.records] == ["blocks.0", "blocks.1"]
    assert GenericAttention(model).attribute(x, target=1).shape == x.shape


@pytest.mark.parametrize("block_fn, message", [("ParallelThingsBlock", "parallel attention branches"),
                                                ("DiffParallelScalingBlock", "differential attention")])
def test_unsupported_blocks_are_refused(block_fn, message):
    from timm.models import vision_transformer

    model = VisionTransformer(**TINY, block_fn=getattr(vision_transformer, block_fn)).eval()
    before = {n: vars(m).get("fused_attn") for n, m in model.named_modules()}
    with pytest.raises(CaptureError, match=message):
        GenericAttention(model).attribute(torch.randn(1, 3, 32, 32), target=1)
    assert {n: vars(m).get("fused_attn") for n, m in model.named_modules()} == before


# -- lookup ------------------------------------------------------------------------------
def test_registered_for_timm_classes_and_wrappers():
    for case in ("vit", "deit_distilled", "eva_rope_avg"):
        assert get_adapter(_make(case)[0]).name == "timm"
    wrapper = torch.nn.Sequential(torch.nn.Identity(), _make("vit")[0])
    assert get_adapter(wrapper).name == "timm"
    x = torch.randn(2, 3, 32, 32)
    assert GenericAttention(wrapper).attribute(x, target=1).shape == x.shape


def test_package_never_imports_timm_at_module_level():
    # A fresh interpreter would cost seconds (torch import); a module-level import of timm
    # anywhere in the package is what would make `import captum_transformers` import it.
    root = pathlib.Path(captum_transformers.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not [n for n in names if n.split(".")[0] == "timm"], f"{path} imports timm at module level"


# -- gradients ---------------------------------------------------------------------------
def test_frozen_model_still_gets_attention_gradients():
    model, x = _make("vit")
    expected = GenericAttention(model).attribute(x, target=[1, 2], return_tokens=True)
    model.requires_grad_(False)
    frozen = GenericAttention(model).attribute(x, target=[1, 2], return_tokens=True)
    torch.testing.assert_close(frozen, expected)
    assert all(p.grad is None for p in model.parameters())


def test_gradient_checkpointing_model():
    model, x = _make("vit")
    expected = GenericAttention(model).attribute(x, target=1, return_tokens=True)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(GenericAttention(model).attribute(x, target=1, return_tokens=True), expected)
    assert model.grad_checkpointing is True


# -- exact restore -----------------------------------------------------------------------
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks")


def _snapshot(model):
    return dict(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        hooks={name: [len(getattr(m, d, {})) for d in _HOOK_DICTS] for name, m in model.named_modules()},
        forward_in_dict=[name for name, m in model.named_modules() if "forward" in vars(m)],
        fused={name: (vars(m).get("fused_attn", "class")) for name, m in model.named_modules()
               if hasattr(m, "fused_attn")},
        grad_checkpointing=model.grad_checkpointing,
        requires_grad={k: p.requires_grad for k, p in model.named_parameters()},
        grads={k: p.grad for k, p in model.named_parameters()},
        training={name: m.training for name, m in model.named_modules()},
    )


def _assert_restored(before, after):
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key
    assert after["hooks"] == before["hooks"]
    assert all(counts == [0] * len(_HOOK_DICTS) for counts in after["hooks"].values())
    assert after["forward_in_dict"] == [] == before["forward_in_dict"]
    for key in ("fused", "grad_checkpointing", "requires_grad", "training"):
        assert after[key] == before[key], key
    assert all(g is None for g in after["grads"].values())


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("case", ["vit", "eva_rope_avg", "eva_attnrope_token"])  # one per attention class
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fail", [False, True], ids=["normal", "exception"])
def test_exact_restore(case, method, fail):
    model, x = _make(case)
    # Mixed per-instance flags: each must come back as it was, not as a global default.
    model.blocks[0].attn.fused_attn = True
    model.blocks[1].attn.fused_attn = False
    with torch.no_grad():
        reference = model(x)
    before = _snapshot(model)
    if fail:
        # Raised after block 0's attention ran and before block 1's: mid-capture.
        with raising_after(model.blocks[0], _Boom("mid-forward")):
            with pytest.raises(_Boom):
                method(model).attribute(x, target=1)
    else:
        method(model).attribute(x, target=1)
    _assert_restored(before, _snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x), reference)
