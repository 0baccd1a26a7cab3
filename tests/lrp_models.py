"""Helpers and tiny models shared by the relevance-propagation tests (no hub, random weights)."""


import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from captum_transformers import RuleSet  # noqa: E402
from captum_transformers.propagation.rules.rule_set import find_norms  # noqa: E402
from hf_models import SMALL  # noqa: E402

F64 = torch.float64
PRESETS = [pytest.param(rules, id=rules.name) for rules in (RuleSet.GRADIENT, RuleSet.AH, RuleSet.AH_LN)]
GATED = [pytest.param(rules, id=rules.name) for rules in (RuleSet.AH, RuleSet.AH_LN)]
VOCAB, DIM, HEADS, FF, CLASSES = 23, 16, 2, 32, 5


# -- helpers ---------------------------------------------------------------------------------
def _zero_biases(model: nn.Module) -> nn.Module:
    """Zero every bias: Linear/Conv1D, attention in-projections, LayerNorm shifts."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1]:
                parameter.zero_()
    return model


def _random_biases(model: nn.Module, std: float, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1]:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def _random_norm_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Norm weights away from 1, so a rule that forgot the affine scale could not pass."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in find_norms(model):
            weight = getattr(site.module, "weight", None)
            if weight is not None:
                weight.copy_(1 + 0.3 * torch.randn(weight.shape, generator=generator))
    return model


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _relative_errors(relevance_sums: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return (relevance_sums - logits).abs() / logits.abs()


# -- tiny models -----------------------------------------------------------------------------
class BertClassifier(nn.Module):
    """BertModel without its tanh pooler: a linear head on the CLS token of the last layer."""

    def __init__(self, **config):
        super().__init__()
        self.bert = transformers.BertModel(transformers.BertConfig(**SMALL, vocab_size=99, **config),
                                           add_pooling_layer=False)
        self.head = nn.Linear(SMALL["hidden_size"], 3)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.bert(input_ids, attention_mask=attention_mask).last_hidden_state[:, 0])


class EncoderClassifier(nn.Module):
    """Embedding + post-norm nn.TransformerEncoder (+ optional final norm) + head on token 0."""

    def __init__(self, activation="relu", bias=False, final_norm=None, embeddings_input=False):
        super().__init__()
        self.embeddings_input = embeddings_input
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, FF, dropout=0.0, activation=activation, bias=bias,
                                           batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=final_norm, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, CLASSES, bias=bias)

    def forward(self, inputs, key_padding_mask=None):
        x = inputs if self.embeddings_input else self.embed(inputs)
        return self.head(self.encoder(x, src_key_padding_mask=key_padding_mask)[:, 0])


class GemmaStyleRMSNorm(nn.Module):
    """Hand-written RMSNorm with a zero-centred weight, ``y = x / rms(x) * (1 + w)`` (Gemma)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class ElementwiseScale(nn.Module):
    """A 1-D weight and an ``eps`` attribute, but no normalisation: ``y = x * w``."""

    def __init__(self, dim):
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * self.weight


class CenterOnly(nn.Module):
    """Centres but does not rescale: ``y = (x - mean) * w``; not a LayerNorm."""

    def __init__(self, dim):
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) * self.weight


class GemmaBlock(nn.Module):
    """Pre-norm block with hand-written RMSNorms around nn.MultiheadAttention and a ReLU MLP."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = GemmaStyleRMSNorm(DIM), GemmaStyleRMSNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, bias=False, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(DIM, FF, bias=False), nn.Linear(FF, DIM, bias=False)

    def forward(self, x, key_padding_mask=None):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class GemmaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([GemmaBlock(), GemmaBlock()])
        self.norm = GemmaStyleRMSNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES, bias=False)

    def forward(self, ids, key_padding_mask=None):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return self.head(self.norm(x)[:, 0])


def _text_inputs(batch=3, seq=7, vocab=99, low=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[1, 5:] = 0
    return ids, mask


def _images(batch=3, seed=1, dtype=F64):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _hf_vit(dtype=F64, **config):
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        **SMALL, image_size=32, patch_size=8, num_labels=5, attn_implementation="eager", **config)).to(dtype).eval()


def _timm_vit(dtype=F64, **kwargs):
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2,
                             num_classes=5, **kwargs).to(dtype).eval()


def _llama(dtype=F64, hidden_act="relu"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, vocab_size=99, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, hidden_act=hidden_act, attn_implementation="eager")).to(dtype).eval()


def _last_real(mask):
    positions = torch.arange(mask.shape[1])
    return torch.where(mask.bool(), positions, -1).amax(dim=1)


# Bias-free float64 ReLU models: name -> () -> (model, inputs, forward_kwargs, explained logits (B,))
TARGET = 1


def _case_hf_vit():
    torch.manual_seed(0)
    model = _random_norm_weights(_zero_biases(_hf_vit(hidden_act="relu")))
    x = _images()
    return model, x, None, model(x).logits[:, TARGET]


def _case_bert():
    torch.manual_seed(0)
    model = _random_norm_weights(_zero_biases(BertClassifier(hidden_act="relu").to(F64).eval()))
    ids, mask = _text_inputs()
    return model, ids, {"attention_mask": mask}, model(ids, attention_mask=mask)[:, TARGET]


def _case_distilbert():
    torch.manual_seed(0)
    model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=3, vocab_size=99, activation="relu",
        attn_implementation="eager")).to(F64).eval()  # classifier: pre_classifier -> ReLU -> classifier
    model = _random_norm_weights(_zero_biases(model))
    ids, mask = _text_inputs()
    return model, ids, {"attention_mask": mask}, model(ids, attention_mask=mask).logits[:, TARGET]


def _case_gpt2():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16, bos_token_id=0, eos_token_id=0,
        activation_function="relu", attn_implementation="eager")).to(F64).eval()
    model = _random_norm_weights(_zero_biases(model))
    ids, mask = _text_inputs()
    logits = model(ids, attention_mask=mask).logits  # next-token logits at the last real token
    return model, ids, {"attention_mask": mask}, logits[torch.arange(3), _last_real(mask), TARGET]


def _case_timm_vit():
    torch.manual_seed(0)
    model = _random_norm_weights(_zero_biases(_timm_vit(act_layer=nn.ReLU)))
    x = _images()
    return model, x, None, model(x)[:, TARGET]


def _case_torch_mha():
    torch.manual_seed(0)
    model = EncoderClassifier(final_norm=nn.LayerNorm(DIM, bias=False)).to(F64).eval()
    model = _random_norm_weights(model)
    ids, mask = _text_inputs(vocab=VOCAB, low=0)
    padding = mask == 0
    return model, ids, {"key_padding_mask": padding}, model(ids, padding)[:, TARGET]


def _case_gemma_like():
    torch.manual_seed(0)
    model = GemmaLike().to(F64).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GemmaStyleRMSNorm):
                module.weight.normal_(0, 0.3)
    ids, mask = _text_inputs(vocab=VOCAB, low=0)
    padding = mask == 0
    return model, ids, {"key_padding_mask": padding}, model(ids, padding)[:, TARGET]


CONSERVATION_CASES = {
    "hf_vit": _case_hf_vit,
    "hf_bert_no_pooler": _case_bert,
    "hf_distilbert": _case_distilbert,
    "hf_gpt2": _case_gpt2,
    "timm_vit": _case_timm_vit,
    "torch_mha_encoder": _case_torch_mha,
    "gemma_style_rmsnorm": _case_gemma_like,
}

