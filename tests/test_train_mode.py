"""One train-mode rule for every adapter and method (``capture/stochastic_layers.py``).

A model in training mode whose forward is random or batch-dependent (active dropout as a
module or called inline, drop path, batch norm on batch statistics) is refused with a
``StochasticForwardError`` naming what was found and the fix (``model.eval()``); the method's
``allow_stochastic=True`` explains one random draw on purpose; training mode whose layers are
all inactive (p = 0, no dropout at all, gradient checkpointing) is explained as in eval mode.
Before the rule, HF, timm, nn.TransformerEncoder, Swin and PyG feature-dropout models gave a
different map on every identical call, while Graphormer and PyG attention dropout were refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import captum_transformers as ct
from captum_transformers.compat import stochastic_layers
from captum_transformers.errors import CaptureError, InputError, StochasticForwardError
from captum_transformers.methods.catalog import METHOD_FACTORIES
from restore import assert_same, snapshot

transformers = pytest.importorskip("transformers")
pyg = pytest.importorskip("torch_geometric.nn")

P = 0.3  # the active probability of every dropout-like layer below


# -- tiny models, each with its dropout probability p (0: inactive) -------------------------------

def _bert(p):
    from hf_models import SMALL
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        **SMALL, num_labels=3, hidden_dropout_prob=p, attention_probs_dropout_prob=p, attn_implementation="eager"))
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, ids, {"attention_mask": torch.ones_like(ids)}


def _timm_vit(p):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              drop_rate=p, attn_drop_rate=p, proj_drop_rate=p, drop_path_rate=p)
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), {}


class _Encoder(nn.Module):
    def __init__(self, p):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 16)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=p, batch_first=True), 2,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids))[:, 0])


def _torch_encoder(p):
    return _Encoder(p), torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(1)), {}


def _hf_swin(p):
    from swin_models import hf_swin
    model = hf_swin(hidden_dropout_prob=p, attention_probs_dropout_prob=p, drop_path_rate=p)
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), {}


def _timm_swin(p):
    from swin_models import timm_swin
    model = timm_swin(attn_drop_rate=p, proj_drop_rate=p, drop_rate=p)
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), {}


class _FeatureDropoutGraphs(nn.Module):
    """A PyG classifier with inline feature dropout between its layers, as PyG examples write it
    (``F.dropout(x, p, training=self.training)``): no dropout module for a module walk to see."""

    def __init__(self, p, kind="TransformerConv"):
        super().__init__()
        from pyg_models import layer, FEATURES, CHANNELS
        torch.manual_seed(0)
        self.p = p
        self.encode = nn.Linear(FEATURES, CHANNELS)
        self.convs = nn.ModuleList([layer(kind), layer(kind)])
        self.head = nn.Linear(CHANNELS, 2)

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = F.dropout(conv(hidden, edge_index).relu(), p=self.p, training=self.training)
        return self.head(pyg.global_mean_pool(hidden, batch))


def _pyg(p):
    from pyg_models import graphs
    _, (x, edge_index, batch) = graphs()
    return _FeatureDropoutGraphs(p), x, {"additional": (edge_index, batch)}


def _pyg_attention_dropout(p):
    from pyg_models import graph_classifier, graphs
    model = graph_classifier("TransformerConv")
    for conv in model.convs:
        conv.dropout = p
    _, (x, edge_index, batch) = graphs()
    return model, x, {"additional": (edge_index, batch)}


def _graphormer(p):
    from graphormer_models import batch, graphs, model
    nodes, rest = batch(graphs())
    return model(seed=3, dropout=p, attention_dropout=p, activation_dropout=p), nodes, rest


FAMILIES = {"hf_bert": _bert, "timm_vit": _timm_vit, "torch_encoder": _torch_encoder, "hf_swin": _hf_swin,
            "timm_swin": _timm_swin, "pyg_feature_dropout": _pyg, "pyg_attention_dropout": _pyg_attention_dropout,
            "graphormer": _graphormer}
GRAPHS = {"pyg_feature_dropout", "pyg_attention_dropout", "graphormer"}


def _timm_vit_drop_path(p):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              drop_path_rate=p)
    return model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), {}


def _case(family, p, train=True):
    model, inputs, kwargs = (_timm_vit_drop_path if family == "timm_vit_drop_path" else FAMILIES[family])(p)
    model.train(train)
    kwargs = dict(kwargs)
    additional = kwargs.pop("additional", None)
    return model, inputs, additional, kwargs or None


def _explain(method, inputs, additional, kwargs, target=1):
    return method.attribute(inputs, target=target, additional_forward_args=additional, forward_kwargs=kwargs,
                            return_tokens=inputs.dim() == 2 and not inputs.is_floating_point())


# What each family is explained with in the method matrix: the attention methods, the LRP
# methods, the Captum baselines the package wraps (token ids: at the embeddings; graphs are
# explained by the package's methods and the PyG bridge below).
METHODS = ["raw-attention", "rollout", "grad-cam", "generic-attention", "transformer-relevance", "partial-lrp",
           "attn-lrp", "conservative-lrp", "gradient-x-input", "saliency", "integrated-gradients"]
BASELINES = {"saliency", "integrated-gradients"}
# Families whose eval-mode model a method does not explain at all (refused for other reasons).
UNSUPPORTED = {("graphormer", m) for m in BASELINES} | {(f, m) for f in ("pyg_feature_dropout",
                                                                         "pyg_attention_dropout")
                                                        for m in BASELINES | {"transformer-relevance", "partial-lrp"}}


UNSUPPORTED |= {("torch_encoder", m) for m in BASELINES}  # token ids, and no get_input_embeddings()
# Explanations that cannot follow the random forward even when allowed: the adapter recomputes
# the attention (per-operation LRP rules on nn.MultiheadAttention; PyG TransformerConv's
# message with attention dropout) and refuses rather than explain another computation.
NOT_WITH_DROPOUT = {("torch_encoder", m) for m in ("transformer-relevance", "partial-lrp", "attn-lrp")} | {
    ("pyg_attention_dropout", m) for m in METHODS}


def _matrix():
    return [pytest.param(f, m, id=f"{f}-{m}") for f in FAMILIES for m in METHODS if (f, m) not in UNSUPPORTED]


def _build(name, model, **options):
    if name == "integrated-gradients":
        options.setdefault("n_steps", 4)
    return METHOD_FACTORIES[name](model, **options)


# -- the refusal ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family, method", _matrix())
def test_train_mode_with_active_dropout_is_refused_naming_the_layer_and_the_fix(family, method):
    model, inputs, additional, kwargs = _case(family, P)
    before = snapshot(model)
    with pytest.raises(StochasticForwardError) as caught:
        _explain(_build(method, model), inputs, additional, kwargs)
    message = str(caught.value)
    assert "training mode" in message and "model.eval()" in message and "allow_stochastic=True" in message
    assert f"p={P}" in message or f"probability {P}" in message or f"dropout={P}" in message
    assert isinstance(caught.value, InputError) and isinstance(caught.value, CaptureError)
    assert model.training
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("family, where", [
    ("hf_bert", "bert.embeddings.dropout: Dropout(p=0.3)"),
    ("timm_vit", "blocks.0.attn.attn_drop: Dropout(p=0.3)"),
    ("timm_vit_drop_path", "blocks.1.drop_path1: DropPath(drop probability 0.3"),
    ("torch_encoder", "encoder.layers.0.self_attn: MultiheadAttention(dropout=0.3)"),
    ("hf_swin", "swin.embeddings.dropout: Dropout(p=0.3)"),
    ("timm_swin", "layers.0.blocks.0.attn.attn_drop: Dropout(p=0.3)"),
    ("pyg_feature_dropout", "the model (_FeatureDropoutGraphs): F.dropout(p=0.3, training=True)"),
    ("pyg_attention_dropout", "convs.0 (TransformerConv): F.dropout(p=0.3, training=True)"),
    ("graphormer", "encoder.graph_encoder.dropout_module: Dropout(p=0.3)"),
])
def test_the_message_names_the_module_found(family, where):
    model, inputs, additional, kwargs = _case(family, P)
    with pytest.raises(StochasticForwardError) as caught:
        _explain(ct.GenericAttention(model), inputs, additional, kwargs)
    assert where in str(caught.value)
    assert str(caught.value).startswith(f"{type(model).__name__} is in training mode")


# -- the opt-in -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family, method", _matrix())
def test_allow_stochastic_explains_one_random_draw_per_call(family, method):
    model, inputs, additional, kwargs = _case(family, P)
    explainer = _build(method, model, allow_stochastic=True)
    assert explainer.allow_stochastic is True
    if (family, method) in NOT_WITH_DROPOUT:
        with pytest.raises(CaptureError, match=r"model\.eval\(\)") as caught:
            _explain(explainer, inputs, additional, kwargs)
        assert not isinstance(caught.value, StochasticForwardError)
        return
    first = _explain(explainer, inputs, additional, kwargs)
    second = _explain(explainer, inputs, additional, kwargs)
    assert torch.isfinite(first).all()
    assert not torch.equal(first, second)  # genuinely stochastic: another dropout draw
    torch.manual_seed(5)
    third = _explain(explainer, inputs, additional, kwargs)
    torch.manual_seed(5)
    assert torch.equal(_explain(explainer, inputs, additional, kwargs), third)  # the draw is the RNG's


def test_every_method_takes_the_keyword():
    import inspect
    for name, factory in METHOD_FACTORIES.items():
        parameters = inspect.signature(factory).parameters
        assert "allow_stochastic" in parameters and parameters["allow_stochastic"].default is False, name
    with pytest.raises(InputError, match="allow_stochastic must be True or False"):
        ct.GenericAttention(_case("timm_vit", 0.0)[0], allow_stochastic="yes")


# -- training mode with nothing random is explained as usual -----------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["generic-attention", "rollout", "attn-lrp"])
def test_train_mode_with_inactive_dropout_equals_eval_mode(family, method):
    model, inputs, additional, kwargs = _case(family, 0.0)
    trained = _explain(_build(method, model), inputs, additional, kwargs)
    model.eval()
    evaluated = _explain(_build(method, model), inputs, additional, kwargs)
    torch.testing.assert_close(trained, evaluated, rtol=1e-5, atol=1e-6)


def test_a_llama_in_train_mode_is_explained():
    from hf_models import CASES
    spec = CASES["llama_gqa"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    expected = ct.GenericAttention(model).attribute(ids, forward_kwargs=kwargs, return_tokens=True)
    model.train()  # attention_dropout = 0.0: F.dropout(p=0.0, training=True) is the identity
    torch.testing.assert_close(ct.GenericAttention(model).attribute(ids, forward_kwargs=kwargs, return_tokens=True),
                               expected)


def test_gradient_checkpointing_in_train_mode_without_dropout_is_explained():
    model, ids, _, kwargs = _case("hf_bert", 0.0)
    expected = ct.AttnLRP(model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)
    model.gradient_checkpointing_enable()
    torch.testing.assert_close(ct.AttnLRP(model).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True),
                               expected, rtol=1e-5, atol=1e-6)


# -- batch norm: batch-dependent, and it would change the model ------------------------------------

class _NormedEncoder(nn.Module):
    """A token classifier with a batch norm over the features of its embeddings."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 16)
        self.norm = norm
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        hidden = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(self.encoder(hidden)[:, 0])


class _FunctionalNorm(nn.Module):
    """Batch norm called inline with its running statistics, as custom layers write it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(16))
        self.register_buffer("running_var", torch.ones(16))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=self.training)


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm1d(16), _FunctionalNorm], ids=["module", "functional"])
@pytest.mark.parametrize("allowed", [False, True])
def test_batch_norm_updating_running_statistics_is_refused_even_when_allowed(norm, allowed):
    model = _NormedEncoder(norm()).train()
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    before = snapshot(model)
    with pytest.raises(StochasticForwardError, match="running statistics") as caught:
        ct.GenericAttention(model, allow_stochastic=allowed).attribute(ids, target=0, return_tokens=True)
    assert "model.eval()" in str(caught.value) and "norm" in str(caught.value)
    assert_same(before, snapshot(model))  # refused before the statistics moved
    assert int(model.norm.running_mean.abs().sum()) == 0


def test_batch_statistics_without_running_statistics_need_the_opt_in():
    model = _NormedEncoder(nn.BatchNorm1d(16, track_running_stats=False)).train()
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(StochasticForwardError, match="batch statistics"):
        ct.GenericAttention(model).attribute(ids, target=0, return_tokens=True)
    whole = ct.GenericAttention(model, allow_stochastic=True).attribute(ids, target=0, return_tokens=True)
    alone = ct.GenericAttention(model, allow_stochastic=True).attribute(ids[:1], target=0, return_tokens=True)
    assert not torch.allclose(whole[:1], alone)  # batch-dependent, as the refusal said


# -- the PyG explainer bridge and the detection helper ----------------------------------------------

@pytest.mark.parametrize("method", ["generic-attention", "attn-lrp"])
def test_the_pyg_explainer_bridge_follows_the_rule(method):
    """PyG's ``Explainer`` switches the model to eval mode around its algorithm itself; the
    algorithm called on a model in training mode follows the package's rule."""
    from torch_geometric.explain import Explainer
    from captum_transformers.integrations.pyg import TransformerExplainer
    model, x, (edge_index, batch), _ = _case("pyg_feature_dropout", P)
    target = torch.tensor([0, 1, 1])

    def explainer(**options):
        return Explainer(model, TransformerExplainer(method, **options), explanation_type="phenomenon",
                         node_mask_type="attributes", edge_mask_type="object",
                         model_config=dict(mode="multiclass_classification", task_level="graph", return_type="raw"))

    through_pyg = explainer()(x, edge_index, target=target, batch=batch)  # explained in eval mode, by PyG's choice
    assert model.training
    with pytest.raises(StochasticForwardError, match="F.dropout"):
        explainer().algorithm(model, x, edge_index, target=target, batch=batch)
    allowed = explainer(allow_stochastic=True).algorithm
    first = allowed(model, x, edge_index, target=target, batch=batch)
    second = allowed(model, x, edge_index, target=target, batch=batch)
    assert not torch.equal(first.node_mask, second.node_mask)
    model.eval()
    torch.testing.assert_close(explainer().algorithm(model, x, edge_index, target=target, batch=batch).node_mask,
                               through_pyg.node_mask)


def test_the_detection_helper_follows_the_rule():
    from detr_models import detr, images
    model = detr().train()
    for module in model.modules():  # DETR's layers call F.dropout(x, p=self.dropout, training=self.training)
        if isinstance(getattr(module, "dropout", None), float):
            module.dropout = P
    refused = ct.GenericAttention(model)
    refused.attribute = lambda *args, **kwargs: pytest.fail("the finding forward should have been refused")
    with pytest.raises(StochasticForwardError, match=r"model\.eval\(\)"):
        ct.explain_detections(refused, images(), threshold=0.0)
    found = ct.explain_detections(ct.GenericAttention(model, allow_stochastic=True), images(), threshold=0.0)
    assert len(found) > 0


# -- the cost in eval mode -------------------------------------------------------------------------------

def test_eval_mode_installs_no_observer(monkeypatch):
    """In eval mode the rule is one pass reading ``module.training``: no torch-function mode
    observes the forward (a mode costs a Python call per torch operation)."""
    created = []
    original = stochastic_layers._FunctionalWatch.__init__

    def counting(self, *args, **kwargs):
        created.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(stochastic_layers._FunctionalWatch, "__init__", counting)
    model, inputs, _, kwargs = _case("hf_bert", P, train=False)
    ct.GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs)
    assert created == []
    model.train()
    ct.GenericAttention(model, allow_stochastic=True).attribute(inputs, target=1, forward_kwargs=kwargs)
    assert len(created) == 1


def test_pyg_gps_attention_dropout_and_batch_norm_follow_the_rule():
    from pyg_models import gps_classifier, graphs
    _, (x, edge_index, batch) = graphs()
    model = gps_classifier(norm="layer_norm")
    for layer in model.layers:
        layer.attn.dropout = P
    model.train()
    with pytest.raises(StochasticForwardError, match=r"layers\.0\.attn: MultiheadAttention\(dropout=0\.3\)"):
        ct.ConservativeLRP(model, variant="AH").attribute(x, additional_forward_args=(edge_index, batch), target=0)
    normed = gps_classifier().train()  # its batch norms would update their running statistics
    before = snapshot(normed)
    with pytest.raises(StochasticForwardError, match=r"layers\.0\.norm1\.module: BatchNorm1d .*running"):
        ct.ConservativeLRP(normed, variant="AH", allow_stochastic=True).attribute(
            x, additional_forward_args=(edge_index, batch), target=0)
    assert_same(before, snapshot(normed))
