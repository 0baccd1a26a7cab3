# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Bi-modal and encoder-decoder Transformers
#
# Chefer, Gur & Wolf (ICCV 2021) keep one relevancy map per pair of token *streams* (text
# and image for LXMERT, encoder and decoder for DETR) and update them attention call by
# attention call. `captum_transformers` records which streams each call mixes, so the same
# `attribute()` call explains these models too:
#
# * a tuple of inputs gets a tuple of maps back, each input scored by its own stream
#   (inputs without tokens, such as LXMERT's box coordinates, get zeros);
# * `return_tokens=True` gives the raw token scores, one tensor per stream.
#
# **Every model here is built from a config with random weights** (no download), so the
# numbers show how to call the methods, not what a trained model looks at. Replace the
# `...Config(...)` lines by `from_pretrained(...)` for a real checkpoint.

# %%
import os
import tempfile

import torch
import transformers

from captum_transformers import (AttentionGradCAM, AttentionRollout, GenericAttention, RawAttention,
                                 explain_detections)
from captum_transformers.visualization import detection_view, text_image_view, text_regions_view

OUT = os.environ.get("QUICKSTART_OUT") or tempfile.mkdtemp(prefix="multimodal_")
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(0)

# %% [markdown]
# ## LXMERT: co-attention between text and image regions
#
# LXMERT's cross-attention module runs twice per cross layer (text over image, then image
# over text). GenericAttention applies the paper's co-attention rules (Eq. 10-11, with the
# row normalisation of Eq. 8-9) and reads the text [CLS] row of `R^{tt}` and `R^{ti}`.

# %%
lxmert = transformers.LxmertForQuestionAnswering(transformers.LxmertConfig(
    hidden_size=32, num_attention_heads=4, intermediate_size=64, l_layers=2, x_layers=2, r_layers=1,
    visual_feat_dim=16, visual_pos_dim=4, vocab_size=100, num_qa_labels=5)).eval()
input_ids = torch.randint(5, 100, (2, 7))
attention_mask = torch.ones(2, 7, dtype=torch.long)
attention_mask[1, 5:] = 0                                     # the second question is shorter
visual_feats, visual_pos = torch.randn(2, 9, 16), torch.rand(2, 9, 4)

on_ids, on_feats, on_pos = GenericAttention(lxmert).attribute(
    (input_ids, visual_feats, visual_pos), target=[1, 3], forward_kwargs={"attention_mask": attention_mask})
print("text map", tuple(on_ids.shape), "region map", tuple(on_feats.shape), "box map is zero:", bool((on_pos == 0).all()))

for method in (RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention):
    text, regions = method(lxmert).attribute((input_ids, visual_feats, visual_pos), target=[1, 3],
                                             forward_kwargs={"attention_mask": attention_mask}, return_tokens=True)
    print(f"{method.__name__:>18}: most relevant region per example {regions.argmax(-1).tolist()}, "
          f"padding scored {float(text[1, 5:].abs().sum()):.1f}")

# %% [markdown]
# `text_regions_view` draws both streams of each example: the question's tokens, the region
# scores as a strip, and each region's box over the image in its relevance colour (boxes as
# `(x0, y0, x1, y1)` fractions of the image, the form of a real LXMERT's `visual_pos`). Each
# stream has its own colour scale, stated beside it. Here the "image" is grey, the tokens are
# the ids, and the boxes are made from the random `visual_pos` (which are not valid boxes).

# %%
lxmert_text, lxmert_regions = GenericAttention(lxmert).attribute(
    (input_ids, visual_feats, visual_pos), target=[1, 3], forward_kwargs={"attention_mask": attention_mask},
    return_tokens=True)[:2]
boxes = torch.cat([visual_pos[..., :2].clamp(max=0.6), visual_pos[..., :2].clamp(max=0.6) + 0.4], dim=-1)
lxmert_view = text_regions_view([[f"id{i}" for i in row] for row in input_ids.tolist()], lxmert_text, lxmert_regions,
                                attention_mask=attention_mask, images=torch.full((2, 3, 48, 64), 0.6), boxes=boxes)
lxmert_view.save(os.path.join(OUT, "lxmert_streams.html"))
lxmert_view  # shown inline in a notebook

# %% [markdown]
# ## CLIP: which words and which patches make an image match a text
#
# The score is `logits_per_image[b, target_b]`: image `b` against the text `target_b`. Both
# towers are explained in one backward pass; `target=None` pairs each image with its own
# text, and any target must be a permutation of the texts (each text map then explains
# exactly one similarity). `start_layer` skips each tower's first layers.

# %%
clip = transformers.CLIPModel(transformers.CLIPConfig(
    text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=16, bos_token_id=0, pad_token_id=1, eos_token_id=2),
    vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8),
    projection_dim=16)).eval()
texts = torch.randint(5, 100, (2, 6))
texts[:, -1] = 2                                               # the end-of-text token CLIP pools at
pictures = torch.randn(2, 3, 32, 32)
on_text, on_image = GenericAttention(clip).attribute((texts, pictures))
print("CLIP text map", tuple(on_text.shape), "image map", tuple(on_image.shape))
# Both towers side by side: each text's tokens and its image's map (random pixels shown in [0, 1]).
shown_pictures = (pictures - pictures.min()) / (pictures.max() - pictures.min())
clip_view = text_image_view([[f"id{i}" for i in row] for row in texts.tolist()], on_text, shown_pictures, on_image,
                            patch_grid=(4, 4))
clip_view.save(os.path.join(OUT, "clip_streams.png"))
clip_view  # shown inline in a notebook

# %% [markdown]
# ## BART: source and prefix relevance for a generated token
#
# The explained output is the next-token logit at the last decoder position, so `target`
# is a token id; truncate `decoder_input_ids` to explain an earlier generated token.

# %%
bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, max_position_embeddings=32)).eval()
source, prefix = torch.randint(5, 100, (2, 8)), torch.randint(5, 100, (2, 4))
on_source, on_prefix = GenericAttention(bart).attribute((source, prefix), target=[17, 42])
# Random weights with BART's small init give small gradients: show each map relative to its maximum.
print("source relevance", (on_source[0] / on_source[0].max()).numpy().round(2),
      "prefix relevance (the last token includes its own identity)", on_prefix[0].numpy().round(3))

# %% [markdown]
# ## DETR: every confident detection explained in one batch
#
# A detection is a query `q` with a class `c`; the target is the pair `(q, c)`, and the map
# is row `q` of the decoder-to-encoder relevancy `R^{de}`, upsampled from the backbone's
# feature grid to the image. `explain_detections` finds every detection above a score
# threshold and explains them all in one `attribute` call.

# %%
backbone = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                     layer_type="basic", out_features=["stage2"])
detr = transformers.DetrForObjectDetection(transformers.DetrConfig(
    backbone_config=backbone, use_pretrained_backbone=False, d_model=32, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    num_queries=6, num_labels=3, init_std=0.5)).eval()
images = torch.randn(2, 3, 64, 48)

found = explain_detections(GenericAttention(detr), images, threshold=0.5)
print(f"{len(found)} detections: images {found.image_index.tolist()}, queries {found.query_index.tolist()}, "
      f"classes {found.label.tolist()}")

# %% [markdown]
# `detection_view` draws each explained detection's map over its image with the detection's
# box (from the model's `pred_boxes`), one row per image.

# %%
if len(found):
    with torch.no_grad():
        predicted_boxes = detr(images).pred_boxes
    shown_images = (images - images.min()) / (images.max() - images.min())
    detection_view(shown_images, found, pred_boxes=predicted_boxes).save(os.path.join(OUT, "detr_detections.png"))
print("figures in", OUT)
