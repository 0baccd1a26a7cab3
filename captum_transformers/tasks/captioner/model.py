"""The built-in captioner: a tiny LLaVA that reads the two digits of a DigitCanvas canvas in order.

``transformers.LlavaForConditionalGeneration`` (the unmodified class): a CLIP vision tower sized
like the DigitCanvas ViT (32 px, patch 4, width 64, 4 layers, 4 heads, so 64 patch tokens), the
two-layer LLaVA projector, and a two-layer Llama decoder (``TEXT_CONFIG``). The prompt is
``<bos> <image>*64 digits:``; the answer is the canvas's two digits in reading order, then
``<eos>``, e.g. ``3 7 <eos>``. Reading order (:func:`reading_order_labels`): left to right
when the two digit boxes sit side by side, top to bottom when they are stacked (DigitCanvas
draws both layouts; stacked boxes have no left-to-right order). Each digit's exact mask is
known, so the image map a method gives for a generated digit can be scored against it
(``benchmarks/caption_mask_share.py``). Train, val and test canvases draw on disjoint samples of
sklearn's ``load_digits`` (:mod:`captum_transformers.tasks.digits.canvas`), not disjoint writers: ``load_digits`` carries
no writer ids, so a test digit's writer may also have written training digits.

The tokenizer is a ``transformers.PreTrainedTokenizerFast`` over a word vocabulary
(``VOCABULARY``) built offline; it prepends ``<bos>`` and pads on the left. The weights ship as
``captum_transformers/assets/digit_captioner.pt`` (float16 state dict, loaded as float32)
next to ``digit_captioner.json`` (accuracies, training time, seed, command of
:mod:`.train`).

Example::

    >>> from captum_transformers.tasks.captioner.model import caption_inputs, load_digit_captioner
    >>> from captum_transformers.tasks.digits.canvas import digit_canvases
    >>> model, tokenizer = load_digit_captioner()
    >>> data = digit_canvases("test", variant="two", n=2)
    >>> inputs = caption_inputs(tokenizer, data.images)
    >>> out = model.generate(**inputs)
    >>> tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    ['2 8', '7 1']
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...errors import InputError
from ..digits.canvas import CANVAS, DIGIT, DigitCanvasSet, normalize
from ..shipped_weights import asset, load_shipped_record, load_shipped_weights

WEIGHTS_FILE = "digit_captioner.pt"
RECORD_FILE = "digit_captioner.json"
RETRAIN_COMMAND = "python -m captum_transformers.tasks.captioner.train"
PAD, BOS, EOS, UNK, IMAGE, CUE = "<pad>", "<bos>", "<eos>", "<unk>", "<image>", "digits:"
DIGIT_WORDS = tuple(str(d) for d in range(10))
VOCABULARY: Dict[str, int] = {word: i for i, word in enumerate((PAD, BOS, EOS, UNK, IMAGE, CUE) + DIGIT_WORDS)}
PATCH = 4
IMAGE_TOKENS = (CANVAS // PATCH) ** 2  # 64 patch tokens (the CLS token is dropped by LLaVA's "default" strategy)
PROMPT = " ".join([IMAGE] * IMAGE_TOKENS + [CUE])  # <bos> is added by the tokenizer
MAX_NEW_TOKENS = 3  # two digits and <eos>
# The vision tower has the DigitCanvas ViT's shape (digit_model.MODEL_CONFIG) so it starts from its weights.
VISION_CONFIG: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                     image_size=CANVAS, patch_size=PATCH, num_channels=3, hidden_act="gelu",
                                     layer_norm_eps=1e-6, attention_dropout=0.0)
TEXT_CONFIG: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0)
# CLIP normalises the embeddings before layer 1 (timm's ViT does not). Inside the tower every
# reader of the residual stream is a LayerNorm, blind to the mean the pre-norm removes, so only
# its rescaling to a fixed norm differs (the projector, which reads the stream raw, starts from
# random weights anyway); a gain of the embeddings' median per-token std (0.53 on val canvases,
# measured) keeps most of the ViT's accuracy at init (two-digit top-2 set on 512 val canvases:
# 0.66 against its 0.74; 0.34 with the default gain of 1). Fine-tuning adapts to the rest.
PRE_NORM_GAIN = 0.53
# The last encoder layer's patch tokens feed the projector (LLaVA's default, -2, would leave layer 4 unused).
LLAVA_CONFIG: Dict[str, Any] = dict(vision_feature_layer=-1, vision_feature_select_strategy="default",
                                    projector_hidden_act="gelu", image_seq_length=IMAGE_TOKENS)


def captioner_tokenizer():
    """The captioner's ``PreTrainedTokenizerFast``: WordLevel on whitespace, ``<bos>`` prepended, left padding.

    Example::

        >>> captioner_tokenizer()("digits: 3 7")["input_ids"]
        [1, 5, 9, 13]
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=dict(VOCABULARY), unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                           special_tokens=[(BOS, VOCABULARY[BOS])])
    # WordLevel has no decoder of its own: a word-piece decoder with no prefix joins words by spaces.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, padding_side="left", extra_special_tokens={"image_token": IMAGE},
                                   model_input_names=["input_ids", "attention_mask"])


def build_digit_captioner():
    """A randomly initialised captioner ``LlavaForConditionalGeneration``, in train mode, greedy ``generate``.

    Example::

        >>> build_digit_captioner().config.image_token_id == VOCABULARY["<image>"]
        True
    """
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    special = dict(bos_token_id=VOCABULARY[BOS], eos_token_id=VOCABULARY[EOS], pad_token_id=VOCABULARY[PAD])
    config = LlavaConfig(vision_config=CLIPVisionConfig(**VISION_CONFIG),
                         text_config=LlamaConfig(vocab_size=len(VOCABULARY), **TEXT_CONFIG, **special),
                         image_token_index=VOCABULARY[IMAGE], **LLAVA_CONFIG)
    model = LlavaForConditionalGeneration(config)
    model.generation_config = GenerationConfig(**special, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS)
    return model


def vision_tower_from_digit_vit(model, digit_vit) -> None:
    """Copy the shipped DigitCanvas ViT (timm) into the captioner's CLIP vision tower, in place.

    The mapping is exact but for CLIP's ``pre_layrnorm`` (timm's ViT has none): the patch
    convolution's bias (CLIP's has none) is folded into the patch positions' embeddings, the
    fused ``qkv`` is split into ``q_proj``, ``k_proj``, ``v_proj``; the pre-norm gets the scalar
    gain ``PRE_NORM_GAIN``, which only rescales each embedding (training adapts to it).
    """
    source = digit_vit.state_dict()
    vision = model.model.vision_tower
    width = VISION_CONFIG["hidden_size"]
    with torch.no_grad():
        vision.embeddings.patch_embedding.weight.copy_(source["patch_embed.proj.weight"])
        positions = source["pos_embed"][0].clone()
        positions[1:] += source["patch_embed.proj.bias"]
        vision.embeddings.position_embedding.weight.copy_(positions)
        vision.embeddings.class_embedding.copy_(source["cls_token"][0, 0])
        for index, layer in enumerate(vision.encoder.layers):
            prefix = f"blocks.{index}."
            weight, bias = source[prefix + "attn.qkv.weight"], source[prefix + "attn.qkv.bias"]
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                getattr(layer.self_attn, name).weight.copy_(weight[part * width:(part + 1) * width])
                getattr(layer.self_attn, name).bias.copy_(bias[part * width:(part + 1) * width])
            pairs = {"self_attn.out_proj": "attn.proj", "layer_norm1": "norm1", "layer_norm2": "norm2",
                     "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
            for target, origin in pairs.items():
                module = layer.get_submodule(target)
                module.weight.copy_(source[prefix + origin + ".weight"])
                module.bias.copy_(source[prefix + origin + ".bias"])
        vision.pre_layrnorm.weight.fill_(PRE_NORM_GAIN)
        vision.pre_layrnorm.bias.zero_()
        vision.post_layernorm.weight.copy_(source["norm.weight"])
        vision.post_layernorm.bias.copy_(source["norm.bias"])


def reading_order_labels(data: DigitCanvasSet) -> torch.Tensor:
    """(N, 2) indices into ``data.labels[n]`` / ``data.masks[n]`` of the first and second digit read.

    Side-by-side boxes (one mask wholly left of column 16) are read left to right, stacked ones
    top to bottom: the box halves DigitCanvas uses for two digits.

    Example::

        >>> from captum_transformers.tasks.digits.canvas import digit_canvases
        >>> reading_order_labels(digit_canvases("test", variant="two", n=3)).shape
        torch.Size([3, 2])
    """
    if data.masks.dim() != 4 or data.masks.shape[1] != 2:
        raise InputError(f"reading_order_labels needs two-digit canvases (masks (N, 2, 32, 32)), received masks of "
                         f"shape {tuple(data.masks.shape)}. Use digit_canvases(..., variant='two').")
    columns = data.masks.any(dim=-2)  # (N, 2, W): columns a digit touches
    rows = data.masks.any(dim=-1)
    left_half = torch.arange(CANVAS) < DIGIT
    in_left = (columns & left_half).any(-1) & ~(columns & ~left_half).any(-1)  # (N, 2)
    in_top = (rows & left_half).any(-1) & ~(rows & ~left_half).any(-1)
    side_by_side = in_left[:, 0] != in_left[:, 1]
    stacked = in_top[:, 0] != in_top[:, 1]
    if not bool((side_by_side | stacked).all()):
        bad = torch.nonzero(~(side_by_side | stacked)).flatten().tolist()
        raise InputError(f"canvases {bad[:5]} have digit masks in neither the left/right nor the top/bottom halves; "
                         f"reading order is defined for DigitCanvas's two-digit layouts only.")
    first = torch.where(side_by_side, (~in_left[:, 0]).long(), (~in_top[:, 0]).long())
    return torch.stack([first, 1 - first], dim=1)


def caption_targets(data: DigitCanvasSet) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(labels, masks)`` in reading order: (N, 2) digit classes and (N, 2, 32, 32) their masks."""
    order = reading_order_labels(data)
    labels = data.labels.gather(1, order)
    masks = data.masks[torch.arange(len(order))[:, None], order]
    return labels, masks


def caption_inputs(tokenizer, images01: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Model inputs for canvases in [0, 1]: ``input_ids``, ``attention_mask`` of the prompt, ``pixel_values``.

    Example::

        >>> inputs = caption_inputs(captioner_tokenizer(), torch.zeros(2, 3, 32, 32))
        >>> inputs["input_ids"].shape, inputs["pixel_values"].shape
        (torch.Size([2, 66]), torch.Size([2, 3, 32, 32]))
    """
    batch = tokenizer([PROMPT] * len(images01), return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "pixel_values": normalize(images01)}


def answer_ids(labels: torch.Tensor) -> torch.Tensor:
    """(N, 3) token ids of the answers ``d1 d2 <eos>`` for reading-order labels (N, 2)."""
    digit_ids = torch.tensor([VOCABULARY[word] for word in DIGIT_WORDS])
    return torch.cat([digit_ids[labels], torch.full((len(labels), 1), VOCABULARY[EOS])], dim=1)


@torch.no_grad()
def generated_digits(model, tokenizer, images01: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, 3) greedy continuation ids of each canvas's prompt (``MAX_NEW_TOKENS``, padded with ``<pad>``)."""
    rows: List[torch.Tensor] = []
    for first in range(0, len(images01), batch_size):
        inputs = caption_inputs(tokenizer, images01[first:first + batch_size])
        out = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        rows.append(torch.nn.functional.pad(new, (0, MAX_NEW_TOKENS - new.shape[1]), value=VOCABULARY[PAD]))
    return torch.cat(rows)


def caption_accuracy(model, tokenizer, data: DigitCanvasSet) -> Dict[str, Any]:
    """Greedy ``generate`` scored against the reading-order answers.

    ``digit_accuracy``: fraction of the 2N digits generated at their place; ``exact_caption``:
    fraction of canvases answered exactly ``d1 d2 <eos>``; ``canvases``: N.
    """
    labels, _ = caption_targets(data)
    expected = answer_ids(labels)
    got = generated_digits(model, tokenizer, data.images)
    return {"digit_accuracy": (got[:, :2] == expected[:, :2]).float().mean().item(),
            "exact_caption": (got == expected).all(-1).float().mean().item(), "canvases": len(data)}


def weights_path():
    """Where the shipped weights live inside the installed package (a Traversable)."""
    return asset(WEIGHTS_FILE)


def digit_captioner_record() -> Dict[str, Any]:
    """The JSON record of the shipped weights: test accuracies, seed, training time, command."""
    return load_shipped_record(RECORD_FILE, "The digit captioner record", RETRAIN_COMMAND)


def load_digit_captioner(dtype: torch.dtype = torch.float32, attn_implementation: Optional[str] = None):
    """``(model, tokenizer)``: the shipped captioner in eval mode (in ``dtype``) and its tokenizer.

    Raises :class:`InputError` naming the expected path and the retrain command when the
    weights file is missing. ``attn_implementation`` ("eager", "sdpa") is set on the model.

    Example::

        >>> model, tokenizer = load_digit_captioner()
        >>> model.training, tokenizer.padding_side
        (False, 'left')
    """
    model = load_shipped_weights(build_digit_captioner(), weights_path(), "The digit captioner weights",
                                 RETRAIN_COMMAND)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model.to(dtype), captioner_tokenizer()
