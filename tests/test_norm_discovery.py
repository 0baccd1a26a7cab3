"""Norms are found by what they compute (LayerNorm, RMSNorm, hand-written and affine-free ones),
not by name; ``norm_mean="constant"``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from captum_transformers import ConservativeLRP  # noqa: E402
from captum_transformers.propagation.rules.rule_set import find_norms  # noqa: E402
from lrp_models import *  # noqa: F401,F403,E402  (tiny models, cases and helpers)
from lrp_models import _case_gemma_like, _case_torch_mha, _random_norm_weights, _relative_errors, _text_inputs  # noqa: E402


# == 7. norm discovery, norm_mean ================================================================
def test_find_norms_by_behaviour():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "layer_norm": nn.LayerNorm(8),
        "llama_rms": LlamaRMSNorm(8),
        "gemma_rms": GemmaStyleRMSNorm(8),
        "torch_rms": nn.RMSNorm(8, eps=1e-6),
        "layer_norm_no_affine": nn.LayerNorm(8, elementwise_affine=False),
        "scale": ElementwiseScale(8),
        "center_only": CenterOnly(8),
        "linear": nn.Linear(8, 8),
        "embedding": nn.Embedding(5, 8),
        "batch_norm": nn.BatchNorm1d(8),
    }).train()
    with torch.no_grad():
        for name in ("layer_norm", "llama_rms", "gemma_rms", "torch_rms"):
            model[name].weight.normal_(0.5, 0.3)
    running_mean = model["batch_norm"].running_mean.clone()
    sites = {site.name: site for site in find_norms(model)}
    assert set(sites) == {"layer_norm", "llama_rms", "gemma_rms", "torch_rms", "layer_norm_no_affine"}
    assert sites["layer_norm"].centered and sites["layer_norm_no_affine"].centered
    assert not any(sites[name].centered for name in ("llama_rms", "gemma_rms", "torch_rms"))
    torch.testing.assert_close(sites["layer_norm"].scale, model["layer_norm"].weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sites["llama_rms"].scale, model["llama_rms"].weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sites["torch_rms"].scale, model["torch_rms"].weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sites["gemma_rms"].scale, 1 + model["gemma_rms"].weight.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sites["layer_norm_no_affine"].scale, torch.ones(8), rtol=1e-5, atol=1e-5)
    # The probe ran in eval mode: no running statistics were updated, the mode is restored.
    assert torch.equal(model["batch_norm"].running_mean, running_mean)
    assert int(model["batch_norm"].num_batches_tracked) == 0 and model["batch_norm"].training


def test_affine_free_layer_norm_gets_the_ln_rule():
    torch.manual_seed(0)
    model = EncoderClassifier(final_norm=nn.LayerNorm(DIM, elementwise_affine=False)).to(F64).eval()
    model = _random_norm_weights(model)
    ids, _ = _text_inputs(vocab=VOCAB, low=0)
    logits = model(ids)[:, TARGET].detach()
    relevance = ConservativeLRP(model).attribute(ids, target=TARGET, return_tokens=True)
    assert _relative_errors(relevance.sum(-1), logits).max() <= 1e-6


def test_norm_mean_constant():
    # Freezing the mean too makes LayerNorm y = w (x - [mean]) / [sigma]: the frozen mean acts
    # like a bias, so relevance is no longer conserved (measured relative errors 0.15 .. 1.5). For
    # RMSNorm there is no mean to freeze: identical to the default, and conservative.
    model, x, kwargs, logits = _case_torch_mha()
    default = ConservativeLRP(model).attribute(x, target=TARGET, return_tokens=True, forward_kwargs=kwargs)
    frozen = ConservativeLRP(model, norm_mean="constant").attribute(
        x, target=TARGET, return_tokens=True, forward_kwargs=kwargs)
    assert (frozen - default).abs().max() > 1e-3 * default.abs().max()
    assert _relative_errors(frozen.sum(-1), logits.detach()).median() > 1e-2

    model, x, kwargs, logits = _case_gemma_like()
    default = ConservativeLRP(model).attribute(x, target=TARGET, return_tokens=True, forward_kwargs=kwargs)
    frozen = ConservativeLRP(model, norm_mean="constant").attribute(
        x, target=TARGET, return_tokens=True, forward_kwargs=kwargs)
    assert torch.equal(frozen, default)
    assert _relative_errors(frozen.sum(-1), logits.detach()).max() <= 1e-6

