"""Rule fixes measured by the coverage harness's batch == single check.

* The normalised add rule (Chefer et al. 2021) on hidden states flattened to (B * N, D) rows (OPT
  around its feed-forward block, every mixture-of-experts block): each example is normalised over
  its own rows, as if it were explained alone (it was refused).
* The identity rule under a model's in-place ``tensor *= mask`` after a norm (XLM, FlauBERT): the
  rule keeps the norm's output before the update, so the in-place model is explained exactly as
  its out-of-place twin (it was refused).
* MarkupLM blocks padding with an additive -10000 (not the dtype's minimum): its padding keys are
  read as padding, so Grad-CAM's head weights average over real keys only.
"""
from __future__ import annotations

import inspect
import textwrap
import types

import pytest
import torch
import transformers
from torch import nn

from captum_transformers.methods.catalog import build_method
from captum_transformers.propagation.rules.operations import operation_rules
from captum_transformers.propagation.rules.rule_set import RuleSet

IDS = torch.tensor([[5, 7, 9, 11, 13, 6, 8, 10], [4, 12, 14, 15, 9, 1, 1, 1]])
MASK = (IDS != 1).long()
REAL = int(MASK[1].sum())


def _batch_and_single(method, target, **extra):
    batch = method.attribute(IDS, target=target, forward_kwargs={"attention_mask": MASK, **extra})
    single = method.attribute(IDS[1:, :REAL], target=target, forward_kwargs={"attention_mask": MASK[1:, :REAL]})
    return batch, single


def _assert_batch_row_is_single(batch, single, tolerance=1e-9):
    """Padded row 1 of the batch against the example alone, relative to the map's largest entry."""
    assert batch.abs().sum() > 0 and torch.isfinite(batch).all()
    scale = float(single.abs().max())
    torch.testing.assert_close(batch[1, :REAL], single[0], rtol=0, atol=tolerance * scale)
    assert bool((batch[1, REAL:] == 0).all())


# -- the normalised add on flattened rows -------------------------------------------------------------------------


class FlatResidual(nn.Module):
    """A residual block whose add runs on (B, N, D) hidden states, or on them flattened to
    (B * N, D) rows (OPT's feed-forward block), plus an expert that adds on the rows it selects."""

    def __init__(self, flat: bool, expert: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.flat, self.expert = flat, expert
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1]) if self.flat else x
        out = h + self.fc2(torch.relu(self.fc1(h)))
        if self.expert:  # index_add_ of the rows an expert selects, which adds on its own rows too
            routed = torch.zeros_like(out)
            rows = torch.nonzero(out[..., 0] > 0).flatten() if self.flat else None
            if self.flat:
                picked = out[rows]
                routed.index_add_(0, rows, picked + self.fc3(picked))
            else:
                keep = (out[..., :1] > 0).to(out.dtype)
                routed = (out + self.fc3(out)) * keep
            out = routed + out
        return out.view(shape)


def _relevance(model, x):
    """Gradient x input of the sum of every output under Chefer2021's operation rules."""
    x = x.clone().requires_grad_()
    with operation_rules(model, RuleSet.CHEFER):
        y = model(x)
    grad, = torch.autograd.grad(y.sum(), x)
    return x * grad


@pytest.mark.parametrize("expert", [False, True])
def test_normalised_add_on_flattened_rows_is_the_unflattened_formula_per_example(expert):
    torch.manual_seed(1)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    flat, unflat = FlatResidual(True, expert).double(), FlatResidual(False, expert).double()
    got = _relevance(flat, x)
    torch.testing.assert_close(got, _relevance(unflat, x), rtol=1e-12, atol=1e-14)
    for row in range(3):  # each example as if explained alone
        torch.testing.assert_close(got[row:row + 1], _relevance(flat, x[row:row + 1]), rtol=1e-12, atol=1e-14)


def test_rows_not_attributable_to_examples_are_still_refused():
    from captum_transformers.errors import CaptureError

    class Shuffled(nn.Module):  # rows reordered token-major (a transpose): no example per row known
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            h = x.transpose(0, 1).reshape(-1, x.shape[-1])
            return (h + self.fc(h)).view(x.shape[1], x.shape[0], -1).transpose(0, 1)

    model = nn.Sequential(nn.Embedding(20, 6), Shuffled()).double()
    from captum_transformers.engine.runner import refuse_batch_mixing_adds
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    with operation_rules(model[1], RuleSet.CHEFER):
        y = model[1](x)
    with pytest.raises(CaptureError, match="could not attribute to examples"):
        refuse_batch_mixing_adds(y.sum(dim=(1, 2)), RuleSet.CHEFER)


def _opt():
    config = transformers.OPTConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                    pad_token_id=1, attn_implementation="eager")
    return transformers.OPTForCausalLM(config)


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=32, pad_token_id=1, attn_implementation="eager")
    return transformers.Qwen2MoeForCausalLM._from_config(config, experts_implementation="eager")  # grouped_mm: no float64


@pytest.mark.parametrize("build", [_opt, _qwen2_moe], ids=["opt", "qwen2_moe"])
def test_transformer_relevance_on_flattened_rows_batch_equals_single(build):
    torch.manual_seed(0)
    model = build().double().eval()
    method = build_method("transformer-relevance", model)
    batch, single = _batch_and_single(method, target=3)
    _assert_batch_row_is_single(batch, single)


# -- the identity rule under an in-place mask multiply after a norm ----------------------------------------------


def _out_of_place(model_cls):
    """``model_cls.forward`` with every ``tensor *= mask...`` written ``tensor = tensor * mask...``."""
    module = inspect.getmodule(model_cls)
    source = textwrap.dedent(inspect.getsource(model_cls.forward))
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    statement = "tensor *= mask.unsqueeze(-1).to(tensor.dtype)"
    assert source.count(statement) == 2
    source = source.replace(statement, "tensor = tensor * mask.unsqueeze(-1).to(tensor.dtype)")
    namespace = {}
    exec(compile(source, module.__file__, "exec"), dict(vars(module)), namespace)
    return namespace["forward"]


XLM_LIKE = {
    "xlm": (transformers.XLMConfig, transformers.XLMForSequenceClassification, transformers.XLMModel),
    "flaubert": (transformers.FlaubertConfig, transformers.FlaubertForSequenceClassification,
                 transformers.FlaubertModel),
}


@pytest.mark.parametrize("kind", sorted(XLM_LIKE))
def test_in_place_mask_after_the_identity_norm_rule_is_its_out_of_place_twin(kind):
    config_cls, head_cls, base_cls = XLM_LIKE[kind]
    config = config_cls(vocab_size=20, emb_dim=16, n_layers=2, n_heads=2, max_position_embeddings=16, n_langs=1,
                        use_lang_emb=False, num_labels=3, pad_index=1)
    torch.manual_seed(0)
    model = head_cls(config).double().eval()
    torch.manual_seed(0)
    twin = head_cls(config).double().eval()
    twin.transformer.forward = types.MethodType(_out_of_place(base_cls), twin.transformer)
    for name in ("lrp", "partial-lrp", "transformer-relevance"):
        batch, single = _batch_and_single(build_method(name, model), target=1)
        # XLM's softmax runs in float32 (scores.float()): a padded row rounds otherwise than alone.
        _assert_batch_row_is_single(batch, single, tolerance=1e-6)
        expected, _ = _batch_and_single(build_method(name, twin), target=1)
        torch.testing.assert_close(batch, expected, rtol=0, atol=0)


# -- MarkupLM's -10000 padding mask --------------------------------------------------------------------------------


def test_markuplm_grad_cam_reads_its_minus_10000_padding_as_padding():
    config = transformers.MarkupLMConfig(vocab_size=20, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32, pad_token_id=1,
                                         max_depth=4, xpath_unit_hidden_size=8, num_labels=3)
    torch.manual_seed(0)
    model = transformers.MarkupLMForTokenClassification(config).double().eval()
    method = build_method("grad-cam", model)
    # Token 2's label 0: a positive map alone (with the padding keys averaged in, 14% off).
    batch, single = _batch_and_single(method, target=(2, 0))
    _assert_batch_row_is_single(batch, single)
