"""What the vision-language generation tests share: for LLaVA (tests/test_vlm_generation.py, test_vlm_inputs.py)
the tiny model built once, the prompt and target, the methods and the per-row check against one-step calls on each
prefix; for Qwen2-VL and Gemma 3 (test_vlm_qwen2.py, test_vlm_gemma3.py) the same check on precomputed rows."""
from __future__ import annotations

import torch
from generation_models import IdTokenizer
from vlm_models import IMAGE, build_llava, image_prompt

from captum_transformers import (AttentionFlow, AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,
                                 GenericAttention, PartialLRP, RawAttention, TransformerLRP, TransformerRelevance)

TOL = 1e-10
TOKENIZER = IdTokenizer()
PROMPT, TARGET = image_prompt([1, 5], [7, 9]), [20, 21, 22]
METHODS = {
    "AttnLRP": AttnLRP,
    "ConservativeLRP-AH+LN": lambda m: ConservativeLRP(m, "AH+LN"),
    "TransformerLRP": TransformerLRP,
    "GenericAttention": GenericAttention,
    "TransformerRelevance": TransformerRelevance,
    "AttentionRollout": AttentionRollout,
    "RawAttention": RawAttention,
    "AttentionGradCAM": AttentionGradCAM,
    "PartialLRP": PartialLRP,
    "AttentionFlow": AttentionFlow,
}
_MODEL: dict = {}


def shared_llava() -> torch.nn.Module:
    """The tiny LLaVA (seed 0), built once and shared by the tests that do not change it."""
    if "llava" not in _MODEL:
        _MODEL["llava"] = build_llava()
    return _MODEL["llava"]


def text_columns(prompt):
    return [i for i, token in enumerate(prompt) if token != IMAGE]


def prefix_differences(explainer, result, prompt, target, images):
    """Largest |difference| of each row with the same method explaining y_t alone on its prefix."""
    worst = 0.0
    n_text = len(text_columns(prompt))
    for t, token in enumerate(target):
        single = explainer.attribute(prompt + target[:t], target=[token], images=images)
        parts = [(result.token_attr[t], single.token_attr[0, :n_text]),
                 (result.target_attr[t, :t], single.token_attr[0, n_text:])]
        mine = result.image_attr if isinstance(result.image_attr, list) else [result.image_attr]
        theirs = single.image_attr if isinstance(single.image_attr, list) else [single.image_attr]
        mine_tokens = result.image_token_attr if isinstance(result.image_token_attr, list) else [result.image_token_attr]
        their_tokens = single.image_token_attr if isinstance(single.image_token_attr, list) else \
            [single.image_token_attr]
        parts += [(a[t], b[0]) for a, b in zip(mine, theirs)] + [(a[t], b[0]) for a, b in zip(mine_tokens, their_tokens)]
        for a, b in parts:
            worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


def worst_difference(result, rows) -> float:
    """Largest |difference| of each row of ``result`` with ``rows`` (one (text + earlier output, image) map pair
    per step, from one-step calls on each prefix); each step must give no credit to outputs it has not read."""
    worst = 0.0
    for t, (text, image) in enumerate(rows):
        prompt_part = result.token_attr.shape[1]
        worst = max(worst, (result.token_attr[t] - text[:prompt_part]).abs().max().item(),
                    (result.image_attr[t] - image).abs().max().item())
        if t:
            worst = max(worst, (result.target_attr[t, :t] - text[prompt_part:]).abs().max().item())
        assert not result.target_attr[t, t:].any(), f"step {t} credits output tokens it never read"
    return worst
