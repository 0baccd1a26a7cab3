"""Bit-for-bit snapshots of every method's maps on every adapter family, to prove that a
refactor (modules moved, no math changed) leaves behaviour identical.

    python benchmarks/snapshot_maps.py record OUT.pt       # snapshot the importable captum_transformers
    python benchmarks/snapshot_maps.py compare A.pt B.pt   # exit 1 on any difference

``record`` builds tiny random models here (seeded, float64, CPU, one thread; no hub, no
``tests/`` builders, which a refactor edits) and runs every method: each class of the public
registries (every ``*_METHODS`` in ``captum_transformers.__all__``, so a method added there is
included), every other exported ``TraceAttribution`` / ``RuleGradientXInput`` class, and a few
option and rule-set variants. Each runs on each family as input-shaped maps, as
``return_tokens=True`` token scores and (relevance methods) with ``return_convergence_delta``;
DETR also through ``explain_detections``, the Llama through the Captum layer methods, and
``GenerationAttribution`` over text LMs and VLMs. Results are flattened to ``key -> tensor``
(``family/method/maps[0]``, ``gen_llama/AttnLRP[1].token_attr``) and saved with ``torch.save``.
A call that raises is recorded as its error class and message, encoded as a uint8 tensor under
``key!refused`` (a ``CaptumTransformersError``) or ``key!error`` (anything else, also printed),
so a changed refusal is a difference too; the package's warnings go under ``key!warnings``
and plain values (token strings, ids, flags) under ``key!value``.

To snapshot another tree, put it first on ``PYTHONPATH``; the script prints which
``captum_transformers`` it imported::

    cd OLD && PYTHONPATH=$PWD python NEW/benchmarks/snapshot_maps.py record /tmp/snapshots/old.pt
    cd NEW && PYTHONPATH=$PWD python benchmarks/snapshot_maps.py record /tmp/snapshots/new.pt
    python benchmarks/snapshot_maps.py compare /tmp/snapshots/old.pt /tmp/snapshots/new.pt

About 8500 snapshots (42 model families x 19 methods, generation rows on 10 models) in about 35 s on
2 CPU cores; recording the same tree twice gives 0 differences.

``compare`` prints how many snapshots it compared and every key missing on either side or whose
tensors differ in dtype, shape or any element (``torch.equal``; NaN equals NaN); exit 1 if any.
Only the public API is imported: ``captum_transformers``, ``captum_transformers.adapters`` and
``captum_transformers.models`` (Graphormer), plus torch, transformers, timm and torch_geometric.
"""
from __future__ import annotations

import re
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Set, Tuple

import torch

F64 = torch.float64
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


# -- storing ----------------------------------------------------------------------------------
def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def decode(tensor: torch.Tensor) -> str:
    return bytes(tensor.tolist()).decode("utf-8", "replace")


def flatten(store: Dict[str, torch.Tensor], key: str, value: Any, depth: int = 0) -> None:
    """Tensors as they are; containers and result objects (every attribute) by index or name;
    plain values (str, int, float, None and lists of them) as their repr, encoded."""
    plain = (str, int, float, bool, type(None))
    if isinstance(value, torch.Tensor):
        store[key] = value.detach().cpu().clone()
    elif isinstance(value, plain) or (isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value)):
        store[f"{key}!value"] = encode(repr(value))
    elif depth > 4:
        store[f"{key}!value"] = encode(type(value).__name__)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flatten(store, f"{key}[{i}]", item, depth + 1)
    elif isinstance(value, dict):
        for name in value:
            flatten(store, f"{key}.{name}", value[name], depth + 1)
    elif hasattr(value, "__dict__"):  # Detections, GenerationResult (dataclass fields and the rest)
        for name in sorted(vars(value)):
            flatten(store, f"{key}.{name}", vars(value)[name], depth + 1)
    else:
        store[f"{key}!value"] = encode(type(value).__name__)


def described(error: BaseException) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x?", f"{type(error).__name__}: {error}")  # no object addresses


def run(store: Dict[str, torch.Tensor], key: str, call: Callable[[], Any]) -> None:
    """Record ``call()``'s result under ``key``, or what it raised; and the package's warnings."""
    import captum_transformers as ct

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            flatten(store, key, call())
        except ct.CaptumTransformersError as error:
            store[f"{key}!refused"] = encode(described(error))
        except Exception as error:  # not a refusal of the package: shown while recording
            store[f"{key}!error"] = encode(described(error))
            print(f"  ERROR {key}: {described(error)[:200]}")
    ours = [str(w.message) for w in caught if "captum_transformers" in (w.filename or "")]
    if ours:
        store[f"{key}!warnings"] = encode(re.sub(r"0x[0-9a-f]+", "0x?", "\n".join(ours)))


# -- methods ----------------------------------------------------------------------------------
def methods() -> Tuple[Dict[str, Callable[[Any, Any], Any]], Set[str]]:
    """(name -> factory(model, adapter), the names of RuleGradientXInput methods): the registries'
    classes, the other exported method classes, and option variants."""
    import captum_transformers as ct

    classes: List[type] = []
    for name in ct.__all__:  # the registries first, in their order
        if name.endswith("_METHODS"):
            classes += [c for c in getattr(ct, name) if c not in classes]
    for name in ct.__all__:  # then any other exported, concrete method class
        obj = getattr(ct, name)
        if (isinstance(obj, type) and issubclass(obj, (ct.TraceAttribution, ct.RuleGradientXInput))
                and not getattr(obj, "__abstractmethods__", None)
                and obj not in (ct.TraceAttribution, ct.RuleGradientXInput) and obj not in classes):
            classes.append(obj)
    found = {c.__name__: (lambda m, a, c=c: c(m, adapter=a)) for c in classes}
    variants = {  # options that take other code paths
        "ConservativeLRP[AH]": lambda m, a: ct.ConservativeLRP(m, "AH", a),
        "ConservativeLRP[GI]": lambda m, a: ct.ConservativeLRP(m, "GI", a),
        "RuleGradientXInput[gradient]": lambda m, a: ct.RuleGradientXInput(m, ct.RuleSet.GRADIENT, a),
        "RuleGradientXInput[Chefer2021]": lambda m, a: ct.RuleGradientXInput(m, ct.RuleSet.CHEFER, a),
        "RawAttention[max]": lambda m, a: ct.RawAttention(m, a, head_fusion="max"),
        "AttentionRollout[min,discard=0.5]": lambda m, a: ct.AttentionRollout(m, a, head_fusion="min",
                                                                              discard_ratio=0.5),
        "AttentionGradCAM[all]": lambda m, a: ct.AttentionGradCAM(m, a, head_weights="all"),
        "GenericAttention[start_layer=1]": lambda m, a: ct.GenericAttention(m, a, start_layer=1),
        "TransformerRelevance[row_normalize]": lambda m, a: ct.TransformerRelevance(m, a, row_normalize=True),
    }
    found.update(variants)
    relevance = {c.__name__ for c in classes if issubclass(c, ct.RuleGradientXInput)} | {
        name for name in variants if name.startswith(("ConservativeLRP", "RuleGradientXInput"))}
    return found, relevance


# -- tiny models (float64, eval mode, seeded) -------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seeded(build: Callable[[], torch.nn.Module], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build().to(F64).eval()


def perturbed(model: torch.nn.Module, pattern: str, std: float, seed: int = 4) -> torch.nn.Module:
    """N(0, std) noise added to the parameters whose name matches ``pattern``: peaked maps,
    non-zero relative position biases."""
    generator = gen(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if re.search(pattern, name):
                parameter.add_(std * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Matrices at unit scale (with the 0.02 init the VLMs' maps are nearly flat)."""
    generator = gen(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                scale = 1.0 if "embed" in name else parameter[0].numel() ** -0.5
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator, dtype=F64))
    return model


def text_batch(vocab: int, seq: int = 7, seed: int = 1, left: bool = False):
    """(2, seq) ids and their mask: example 1 has 2 padding tokens (on the left for decoders)."""
    ids = torch.randint(3, vocab, (2, seq), generator=gen(seed))
    mask = torch.ones(2, seq, dtype=torch.long)
    if left:
        mask[1, :2], ids[1, :2] = 0, 0
    else:
        mask[1, seq - 2:] = 0
    return ids, mask


def images(batch: int, height: int, width: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, height, width, generator=gen(seed), dtype=F64)


DECODER = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
IMAGE, START, END = 35, 33, 34  # VLM placeholder and vision start / end ids
VLM_GENERATORS = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3_vl")


def decoder_lm(tf, family: str, impl: str = "eager") -> torch.nn.Module:
    """A 2-layer causal LM with grouped-query attention (4 heads, 2 key/value heads); Qwen2 and
    Gemma 3 with a sliding window of 3; norms moved away from 1 so that the norm rules matter."""
    config_class, model_class, extra = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 4}),
        "qwen2_sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                          {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 0}),
        "gemma3_mixed": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                         {"head_dim": 4, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]}),
    }[family]
    model = seeded(lambda: model_class(config_class(**DECODER, **extra, attn_implementation=impl)))
    generator = gen(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.rand(parameter.shape, generator=generator, dtype=F64) * 0.5)
    return model


def gpt2(tf, impl: str = "eager") -> torch.nn.Module:
    return seeded(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=40,
                                                           n_positions=32, bos_token_id=1, eos_token_id=2,
                                                           attn_implementation=impl)))


def bart(tf) -> torch.nn.Module:
    return seeded(lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, init_std=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        attn_implementation="eager")))


def t5(tf) -> torch.nn.Module:
    return seeded(lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, attn_implementation="eager")))


def llava(tf, tower: str = "clip") -> torch.nn.Module:
    """CLIP (or SigLIP, no CLS token: every feature kept) tower over 16x16 images in 4x4 patches,
    a 2-layer Llama decoder; 16 image tokens per image."""
    tower_config = tf.CLIPVisionConfig if tower == "clip" else tf.SiglipVisionConfig
    vision = tower_config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          image_size=16, patch_size=4)
    config = tf.LlavaConfig(vision_config=vision, text_config=tf.LlamaConfig(**DECODER), image_token_id=IMAGE,
                            vision_feature_layer=-1,
                            vision_feature_select_strategy="default" if tower == "clip" else "full",
                            multimodal_projector_bias=False, attn_implementation="eager")
    return randomized(seeded(lambda: tf.LlavaForConditionalGeneration(config)))


def qwen_vl(tf, version: str = "2") -> torch.nn.Module:
    """Qwen2-VL (or 2.5-VL) with a 2-layer tower (4x4 patches, 2x2 merging), M-RoPE Qwen2 decoder."""
    common = dict(depth=2, hidden_size=16, num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                  in_channels=3)
    rope = {"rope_type": "default", "mrope_section": [1, 1, 0], "rope_theta": 10000.0}
    ids = dict(image_token_id=IMAGE, video_token_id=36, vision_start_token_id=START, vision_end_token_id=END)
    if version == "2":
        config_class, model_class = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
        vision = dict(common, embed_dim=16, mlp_ratio=2)
    else:
        config_class, model_class = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
        vision = dict(common, out_hidden_size=16, intermediate_size=32, window_size=16, fullatt_block_indexes=[1])
    config = config_class(vision_config=vision, text_config={**DECODER, "rope_parameters": rope},
                          attn_implementation="eager", **ids)
    return randomized(seeded(lambda: model_class(config)))


def gemma3_vl(tf) -> torch.nn.Module:
    """Gemma 3: SigLIP tower over 16x16 images pooled to 4 image tokens, sliding + full decoder layers."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, num_channels=3, vision_use_head=False)
    text = dict(DECODER, head_dim=4, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    config = tf.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, image_token_id=IMAGE,
                             boi_token_index=START, eoi_token_index=END, attn_implementation="eager")
    return randomized(seeded(lambda: tf.Gemma3ForConditionalGeneration(config)))


def vlm_prompt(family: str, before: List[int], after: List[int]) -> List[int]:
    """Placeholders of one 16x16 image: LLaVA 16 (4x4 grid, CLS dropped), Qwen 4 (merged), Gemma 4 (pooled)."""
    if family.startswith("llava"):
        return before + [IMAGE] * 16 + after
    return before + [START] + [IMAGE] * 4 + [END] + after


def graph_batch():
    """Three ring graphs with a chord (3, 5, 4 nodes): x (12, 3), edge_index, batch."""
    xs, edges, offset = [], [], 0
    for size in (3, 5, 4):
        ring = torch.arange(size)
        edges.append(torch.stack([torch.cat([ring, (ring + 1) % size, torch.tensor([0])]),
                                  torch.cat([(ring + 1) % size, ring, torch.tensor([size // 2])])]) + offset)
        xs.append(torch.randn(size, 3, generator=gen(offset), dtype=F64))
        offset += size
    return torch.cat(xs), torch.cat(edges, dim=1), torch.cat([torch.full((n,), i) for i, n in enumerate((3, 5, 4))])


def cases() -> Dict[str, Callable[[], tuple]]:
    """family -> builder of (model, inputs, targets, attribute keywords, adapter or None)."""
    import timm
    import torch_geometric.nn as pyg
    import transformers as tf
    from timm.models.eva import Eva
    from torch import nn

    from captum_transformers.adapters import PyGGPSAdapter

    def text(model, vocab=99, left=False, targets=(0, 2)):
        ids, mask = text_batch(vocab, left=left)
        return model, ids, list(targets), {"forward_kwargs": {"attention_mask": mask}}, None

    def image(model, size=(32, 32), targets=(0, 2)):
        return model, images(2, *size), list(targets), {}, None

    def seq2seq(model):
        (source, smask), (prefix, pmask) = text_batch(40), text_batch(40, seq=4, seed=3)
        return (model, (source, prefix), [5, 7],
                {"forward_kwargs": {"attention_mask": smask, "decoder_attention_mask": pmask}}, None)

    def hf_swin(config_class, model_class):
        config = config_class(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                              window_size=4, num_labels=3)
        return image(perturbed(seeded(lambda: model_class(config)), "relative_position_bias_table", 0.5), (36, 44))

    def timm_swin(model_class, fused):
        model = seeded(lambda: model_class(img_size=(36, 44), patch_size=4, embed_dim=16, depths=(2, 2),
                                           num_heads=(2, 2), window_size=4, num_classes=3))
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = fused
        return image(perturbed(model, r"relative_position_bias_table$|^head\.", 0.5), (36, 44))

    def timm_vit(build):
        return image(perturbed(seeded(build), "", 0.3), targets=(0, 3))  # timm's init: near-uniform maps

    def detr():
        backbone = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                   layer_type="basic", out_features=["stage2"])
        config = tf.DetrConfig(backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_layers=2,
                               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3, dropout=0.0,
                               init_std=0.5, attn_implementation="eager")
        mask = torch.ones(2, 64, 48, dtype=torch.long)
        mask[1, 40:], mask[1, :, 32:] = 0, 0  # image 1: 40x32, padded
        return (seeded(lambda: tf.DetrForObjectDetection(config)), images(2, 64, 48), [(0, 1), (4, 2)],
                {"forward_kwargs": {"pixel_mask": mask}}, None)

    def lxmert():
        config = tf.LxmertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=2, x_layers=2,
                                 r_layers=1, visual_feat_dim=6, visual_pos_dim=4, vocab_size=50, num_qa_labels=3)
        ids, mask = text_batch(50, seq=5)
        regions = (torch.randn(2, 4, 6, generator=gen(3), dtype=F64), torch.rand(2, 4, 4, generator=gen(3), dtype=F64))
        return (seeded(lambda: tf.LxmertForQuestionAnswering(config)), (ids, *regions), [0, 2],
                {"forward_kwargs": {"attention_mask": mask}}, None)

    def visual_bert():
        config = tf.VisualBertConfig(**SMALL, visual_embedding_dim=8, vocab_size=50, num_labels=3)
        ids, mask = text_batch(50, seq=5)
        visual = torch.randn(2, 4, 8, generator=gen(3), dtype=F64)
        return (seeded(lambda: tf.VisualBertForVisualReasoning(config)), ids, [0, 2],
                {"forward_kwargs": {"attention_mask": mask, "visual_embeds": visual}}, None)

    def clip_dual():
        config = tf.CLIPConfig(text_config=dict(**SMALL, vocab_size=99, max_position_embeddings=16, eos_token_id=98,
                                                pad_token_id=0, bos_token_id=97),
                               vision_config=dict(**SMALL, image_size=32, patch_size=8), projection_dim=6,
                               attn_implementation="eager")
        ids, mask = text_batch(90)
        ids[:, -1], ids[1, 4], ids[1, 5:] = 98, 98, 0  # each text ends in the end-of-text token
        return (seeded(lambda: tf.CLIPModel(config)), (ids, images(2, 32, 32)), [1, 0],
                {"forward_kwargs": {"attention_mask": mask}}, None)

    class EncoderClassifier(nn.Module):  # a user's nn.TransformerEncoder (PyTorch's fast-path setup)
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 16)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2)
            self.head = nn.Linear(16, 3)

        def forward(self, ids, key_padding_mask=None):
            return self.head(self.encoder(self.embed(ids), src_key_padding_mask=key_padding_mask)[:, 0])

    def torch_mha():
        padding = torch.zeros(2, 6, dtype=torch.bool)
        padding[1, 4:] = True
        return (seeded(EncoderClassifier), torch.randint(0, 20, (2, 6), generator=gen(1)), [0, 2],
                {"forward_kwargs": {"key_padding_mask": padding}}, None)

    class GraphClassifier(nn.Module):  # node encoder, two attention layers (or GPS layers), mean pooling, head
        def __init__(self, kind):
            super().__init__()
            self.encode, self.head, self.gps = nn.Linear(3, 8), nn.Linear(8, 2), kind == "GPS"
            gin = lambda: pyg.GINConv(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
            self.layers = nn.ModuleList([pyg.GPSConv(8, gin(), heads=2, dropout=0.0) if self.gps
                                         else getattr(pyg, kind)(8, 4, heads=2) for _ in range(2)])

        def forward(self, x, edge_index, batch=None):
            hidden = self.encode(x)
            for layer in self.layers:
                hidden = layer(hidden, edge_index, batch) if self.gps else layer(hidden, edge_index)
            return self.head(pyg.global_mean_pool(hidden, batch))

    def graph(kind, adapter=None):
        x, edge_index, batch = graph_batch()
        return (seeded(lambda: GraphClassifier(kind)), x, [0, 1, 1], {"additional_forward_args": (edge_index, batch)},
                adapter)

    def graphormer():
        from captum_transformers.models import GraphormerCollator, GraphormerConfig, GraphormerForGraphClassification

        config = GraphormerConfig(num_classes=3, num_hidden_layers=2, embedding_dim=16, ffn_embedding_dim=24,
                                  num_attention_heads=4, num_atoms=1100, num_edges=600, num_in_degree=12,
                                  num_out_degree=12, num_spatial=512, num_edge_dis=6, multi_hop_max_dist=4,
                                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        model = perturbed(seeded(lambda: GraphormerForGraphClassification(config)), "graph_attn_bias|virtual", 0.5)
        with torch.no_grad():  # the padding rows of the encodings stay 0
            for name, parameter in model.named_parameters():
                if re.search("graph_attn_bias.*(spatial_pos_encoder|edge_encoder)", name):
                    parameter[0].zero_()
        graphs = []
        for k, n in enumerate((5, 3, 7)):
            ring = [(i, (i + 1) % n) for i in range(n)] + [(0, n // 2)]
            edge_index = torch.tensor(sorted({p for i, j in ring for p in ((i, j), (j, i))})).t()
            graphs.append({"x": torch.randint(0, 5, (n, 2), generator=gen(k)), "edge_index": edge_index,
                           "edge_attr": torch.randint(0, 5, (edge_index.shape[1], 2), generator=gen(k))})
        collated = GraphormerCollator()(graphs)
        collated.pop("labels", None)
        return model, collated.pop("input_nodes"), [0, 1, 2], {"forward_kwargs": collated}, None

    def vlm(model, family, batch=2):
        ids = torch.tensor([vlm_prompt(family, [1, 5 + i], [7, 9]) for i in range(batch)])
        return model, ids, [20, 21][:batch], {"forward_kwargs": {"pixel_values": images(batch, 16, 16)}}, None

    def hf(model_class, config_class, **config):
        return seeded(lambda: model_class(config_class(**config)))

    tiny = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    vit = dict(**SMALL, image_size=32, patch_size=8)  # with attn_implementation, as the tests' HF cases
    swin, swin2 = timm.models.swin_transformer.SwinTransformer, timm.models.swin_transformer_v2.SwinTransformerV2
    timm_vision = timm.models.vision_transformer.VisionTransformer
    decoder = lambda family, impl="eager": text(decoder_lm(tf, family, impl), 40, left=True, targets=(4, 9))
    return {
        "bert": lambda: text(hf(tf.BertForSequenceClassification, tf.BertConfig, **SMALL, num_labels=3,
                                attn_implementation="eager")),
        "bert_sdpa": lambda: text(hf(tf.BertForSequenceClassification, tf.BertConfig, **SMALL, num_labels=3,
                                     attn_implementation="sdpa")),
        "roberta": lambda: text(hf(tf.RobertaForSequenceClassification, tf.RobertaConfig, **SMALL, num_labels=3,
                                   vocab_size=99, pad_token_id=1, attn_implementation="eager")),
        "distilbert": lambda: text(hf(tf.DistilBertForSequenceClassification, tf.DistilBertConfig, dim=32, n_layers=2,
                                      n_heads=4, hidden_dim=64, num_labels=3, vocab_size=99,
                                      attn_implementation="eager")),
        "llama_gqa_eager": lambda: decoder("llama"),
        "llama_gqa_sdpa": lambda: decoder("llama", "sdpa"),
        "mistral": lambda: decoder("mistral"),
        "gemma": lambda: decoder("gemma"),
        "qwen2_sliding": lambda: decoder("qwen2_sliding"),
        "gemma3_mixed": lambda: decoder("gemma3_mixed"),
        "gpt2": lambda: text(gpt2(tf), 40, left=True, targets=(4, 9)),
        "gpt2_sdpa": lambda: text(gpt2(tf, "sdpa"), 40, left=True, targets=(4, 9)),
        "bart": lambda: seq2seq(bart(tf)),
        "t5": lambda: seq2seq(t5(tf)),
        "vit": lambda: image(hf(tf.ViTForImageClassification, tf.ViTConfig, **vit, num_labels=5,
                                attn_implementation="eager")),
        "vit_sdpa": lambda: image(hf(tf.ViTForImageClassification, tf.ViTConfig, **vit, num_labels=5,
                                     attn_implementation="sdpa")),
        "deit_distilled": lambda: image(hf(tf.DeiTForImageClassificationWithTeacher, tf.DeiTConfig, **vit,
                                           num_labels=5, attn_implementation="eager")),
        "clip_vision": lambda: image(hf(tf.CLIPVisionModelWithProjection, tf.CLIPVisionConfig, **vit,
                                        projection_dim=6, attn_implementation="eager")),
        "clip_dual": clip_dual,
        "swin": lambda: hf_swin(tf.SwinConfig, tf.SwinForImageClassification),
        "swinv2": lambda: hf_swin(tf.Swinv2Config, tf.Swinv2ForImageClassification),
        "timm_swin_fused": lambda: timm_swin(swin, True),
        "timm_swin_explicit": lambda: timm_swin(swin, False),
        "timm_swinv2": lambda: timm_swin(swin2, False),
        "timm_vit": lambda: timm_vit(lambda: timm_vision(**tiny)),
        "timm_vit_registers_avg": lambda: timm_vit(lambda: timm_vision(**tiny, class_token=False, reg_tokens=2,
                                                                       global_pool="avg")),
        "timm_eva_rope": lambda: timm_vit(lambda: Eva(**tiny, use_rot_pos_emb=True)),
        "detr": detr,
        "lxmert": lxmert,
        "visual_bert": visual_bert,
        "torch_mha": torch_mha,
        "pyg_TransformerConv": lambda: graph("TransformerConv"),
        "pyg_GATConv": lambda: graph("GATConv"),
        "pyg_GATv2Conv": lambda: graph("GATv2Conv"),
        "pyg_GPS": lambda: graph("GPS"),
        "pyg_GPS_ignore_local": lambda: graph("GPS", PyGGPSAdapter(ignore_local_branch=True)),
        "graphormer": graphormer,
        "llava": lambda: vlm(llava(tf), "llava"),
        "llava_siglip": lambda: vlm(llava(tf, "siglip"), "llava"),
        "qwen2_vl": lambda: vlm(qwen_vl(tf), "qwen", batch=1),  # one example: a batch's pixel rows are one tensor
        "qwen2_5_vl": lambda: vlm(qwen_vl(tf, "2.5"), "qwen", batch=1),
        "gemma3_vl": lambda: vlm(gemma3_vl(tf), "gemma"),
    }


class IdTokenizer:
    """Reads ``"1 5 7"`` as the ids [1, 5, 7]; names id ``i`` ``"t{i}"``."""

    pad_token_id, eos_token_id = 0, 2

    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(x) for x in text.split()]}


# -- recording --------------------------------------------------------------------------------
def record_families(store, found, relevance) -> None:
    """Every method on every family: maps, token scores, convergence delta, DETR's detections."""
    import captum_transformers as ct

    for family, build in cases().items():
        began = time.perf_counter()
        model, inputs, targets, call, adapter = build()
        for name, factory in found.items():
            key = f"{family}/{name}"
            run(store, f"{key}/maps", lambda: factory(model, adapter).attribute(inputs, target=targets, **call))
            run(store, f"{key}/tokens", lambda: factory(model, adapter).attribute(
                inputs, target=targets, return_tokens=True, **call))
            if name in relevance:
                run(store, f"{key}/delta", lambda: factory(model, adapter).attribute(
                    inputs, target=targets, return_convergence_delta=True, **call))
            if family == "detr":  # every query of both images (threshold 0)
                run(store, f"{key}/explain_detections",
                    lambda: ct.explain_detections(factory(model, adapter), inputs, threshold=0.0, **call))
        print(f"  {family}: {time.perf_counter() - began:.1f} s")


def record_generation(store, found) -> None:
    """GenerationAttribution with every method: two prompts (one batch) with given targets on the
    text LMs, one prompt and image on the VLMs; then its options on the Llama."""
    import captum_transformers as ct
    import transformers as tf

    prompts, targets = [[1, 5, 7, 9, 11, 13], [1, 6, 8]], [[20, 21, 22], [23, 24]]
    generators = {"llama": lambda: decoder_lm(tf, "llama"), "gpt2": lambda: gpt2(tf), "bart": lambda: bart(tf),
                  "t5": lambda: t5(tf), "qwen2_sliding": lambda: decoder_lm(tf, "qwen2_sliding"),
                  "gemma3_mixed": lambda: decoder_lm(tf, "gemma3_mixed"), "llava": lambda: llava(tf),
                  "qwen2_vl": lambda: qwen_vl(tf), "qwen2_5_vl": lambda: qwen_vl(tf, "2.5"),
                  "gemma3_vl": lambda: gemma3_vl(tf)}
    for family, build in generators.items():
        began, model = time.perf_counter(), build()
        if family in VLM_GENERATORS:
            prompt, target = vlm_prompt(family, [1, 5], [7, 9]), [20, 21, 22]
            explain = lambda explainer: explainer.attribute(prompt, target=target, images=images(1, 16, 16)[0])
        else:
            explain = lambda explainer: explainer.attribute(prompts, target=targets)
        for name, factory in found.items():
            run(store, f"gen_{family}/{name}", lambda: explain(ct.GenerationAttribution(factory(model, None),
                                                                                        IdTokenizer())))
        print(f"  gen_{family}: {time.perf_counter() - began:.1f} s")

    model, target = decoder_lm(tf, "llama"), targets[0]
    options = {"generated": dict(gen_args={"max_new_tokens": 3, "do_sample": False}),
               "contrast": dict(target=target, contrast=[30, 31, 32]), "span": dict(target=target, span=[0, 2]),
               "skip_tokens": dict(target=target, skip_tokens=[1]), "log_prob": dict(target=target, score="log_prob"),
               "prob": dict(target=target, score="prob")}
    for name in ("AttnLRP", "GenericAttention"):
        for option, kwargs in options.items():
            run(store, f"gen_llama_options/{name}/{option}", lambda: ct.GenerationAttribution(
                found[name](model, None), IdTokenizer()).attribute(prompts[0], **kwargs))


def record(path: str) -> None:
    import captum_transformers as ct
    import transformers as tf

    print("captum_transformers from", ct.__file__)
    torch.set_num_threads(1)
    start, store, (found, relevance) = time.perf_counter(), {}, methods()
    print(f"{len(found)} methods: {', '.join(found)}")
    record_families(store, found, relevance)
    # Captum's layer methods (LayerAttnLRP, ...) on the Llama, their forward the last position's logits.
    model, ids = decoder_lm(tf, "llama"), torch.randint(3, 40, (2, 6), generator=gen(7))
    for layer_class in [getattr(ct, name) for name in ct.__all__ if name.startswith("Layer")]:
        def layer_call(layer_class=layer_class):
            method = layer_class(model)
            method.forward_func = lambda x: model(x).logits[:, -1]
            return method.attribute(ids, target=[4, 9])
        run(store, f"llama_gqa_eager/{layer_class.__name__}/layer", layer_call)
    record_generation(store, found)
    torch.save(store, path)
    kinds = {kind: sum(k.endswith(kind) for k in store) for kind in ("!refused", "!error", "!warnings", "!value")}
    print(f"recorded {len(store)} snapshots ({kinds['!refused']} refusals, {kinds['!error']} other errors, "
          f"{kinds['!warnings']} warning lists, {kinds['!value']} plain values) in {time.perf_counter() - start:.0f} s"
          f" -> {path}")


# -- comparing --------------------------------------------------------------------------------
def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    return bool(torch.equal(a, b))


def shown(key: str, value: Any) -> str:
    if value is None:
        return "<missing>"
    if "!" in key and value.dtype == torch.uint8:
        return repr(decode(value)[:200])
    return f"tensor{tuple(value.shape)} {value.dtype}"


def compare(first: str, second: str) -> int:
    a, b = torch.load(first, weights_only=True), torch.load(second, weights_only=True)
    keys = sorted(set(a) | set(b))
    different = [k for k in keys if k not in a or k not in b or not same(a[k], b[k])]
    for key in different:
        left, right = a.get(key), b.get(key)
        gap = ""
        if left is not None and right is not None and left.is_floating_point() and left.dtype == right.dtype \
                and left.shape == right.shape:
            gap = f" (max |difference| {(left - right).abs().max().item():.3g})"
        print(f"DIFFERENT {key}: {shown(key, left)} | {shown(key, right)}{gap}")
    print(f"compared {len(keys)} snapshots ({len(set(a) & set(b))} on both sides): {len(different)} different")
    return 1 if different else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
