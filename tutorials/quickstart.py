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
# # captum_transformers quickstart
#
# **Looking for maps of trained models?** This quickstart shows the API on models with random
# weights. Two tutorials explain real trained models, offline, each in under a CPU minute:
# `tutorials/digit_canvas_vit.py` (the built-in DigitCanvas ViT: every method side by side,
# an evaluation loop next to Captum's Integrated Gradients, class specificity on two-digit
# canvases) and `tutorials/movie_minilm.py` (the pretrained MiniLM briefly fine-tuned on movie
# reviews: signed token heat maps, and one sentence explained for each class).
#
# `captum_transformers` puts Transformer explanation methods behind Captum's
# `Attribution` interface:
#
# | method | what it reads | class-specific | passes |
# |---|---|---|---|
# | `RawAttention` | last layer's attention row of the CLS token | no | 1 forward |
# | `AttentionRollout` | attention multiplied through the residual stream (Abnar & Zuidema 2020) | no | 1 forward |
# | `AttentionGradCAM` | last layer's heads weighted by their mean gradient | yes | forward + backward |
# | `GenericAttention` | gradient-weighted attention of every layer (Chefer et al., ICCV 2021) | yes | forward + backward |
#
# Each has `attribute(inputs, target=None, additional_forward_args=None, return_tokens=False,
# forward_kwargs=None)` and returns maps shaped like the inputs (images: `(B, C, H, W)`),
# or `(B, N)` token scores with `return_tokens=True`.
#
# This tutorial runs offline in a few seconds on a CPU. **Both models are built from
# configs with random weights** (no download), so the maps below show *how to call* the
# methods, not what a trained model looks at. With a trained checkpoint, replace the
# `...Config(...)` lines by `from_pretrained(...)`; nothing else changes.
#
# Files (a heat-map PNG and a text-attribution HTML page) are written to the directory
# named by the `QUICKSTART_OUT` environment variable, or to a fresh temporary directory.

# %%
import os
import tempfile

import torch
from captum.attr import IntegratedGradients, NoiseTunnel, Saliency
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

from captum_transformers import AttentionGradCAM, AttentionRollout, GenericAttention, RawAttention
from captum_transformers.visualization import TokenHeatmap, image_overlay

torch.manual_seed(0)
OUT = os.environ.get("QUICKSTART_OUT") or tempfile.mkdtemp(prefix="captum_transformers_quickstart_")
os.makedirs(OUT, exist_ok=True)
print("writing outputs to", OUT)

# %% [markdown]
# ## 1. A tiny ViT
#
# Two layers, 64-dim, 4 heads, 32x32 images cut into 8x8 patches: a 4x4 patch grid plus the
# CLS token, 17 tokens. Random weights.

# %%
vit_hf = ViTForImageClassification(ViTConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    image_size=32, patch_size=8, num_labels=10,
)).eval()

# %% [markdown]
# Captum's own methods (`IntegratedGradients`, `Saliency`, ...) call the model and expect a
# tensor of scores back, while a HF model returns an output object. A three-line wrapper
# returns the logits. The attention methods accept either: they find the HF model inside
# the wrapper. We use the wrapper everywhere, so every method explains *the same model*.


# %%
class Logits(torch.nn.Module):
    """Return the logits tensor of a HF model, for Captum's model-agnostic methods."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs).logits


vit = Logits(vit_hf).eval()

# A batch of 4 synthetic "images": a bright square on a dark, noisy background,
# at a different place in each image.
images = 0.1 * torch.randn(4, 3, 32, 32)
for i, (row, col) in enumerate([(2, 2), (2, 18), (18, 2), (18, 18)]):
    images[i, :, row:row + 12, col:col + 12] += 1.0

with torch.no_grad():
    predicted = vit(images).argmax(dim=1)
print("predicted classes:", predicted.tolist())

# %% [markdown]
# ## 2. GenericAttention next to Captum's gradient methods
#
# All three give an attribution with the shape of the input. `GenericAttention` computes
# token relevance over the 4x4 patch grid and upsamples it (bilinearly) to 32x32 on every
# channel; `Saliency` and `IntegratedGradients` work per pixel and channel.

# %%
target = predicted  # explain the predicted class of each image (a (B,) tensor)

generic = GenericAttention(vit).attribute(images, target=target)
saliency = Saliency(vit).attribute(images, target=target)
integrated = IntegratedGradients(vit).attribute(images, target=target, n_steps=16)

for name, attribution in [("GenericAttention", generic), ("Saliency", saliency),
                          ("IntegratedGradients", integrated)]:
    print(f"{name:20s} shape {tuple(attribution.shape)}  range [{attribution.min():.3g}, {attribution.max():.3g}]")

# %% [markdown]
# The other three attention methods are called the same way. `RawAttention` and
# `AttentionRollout` are class-agnostic (no backward pass; `target` is not needed).
# `return_tokens=True` gives the `(B, 17)` token scores before upsampling: token 0 is
# CLS, tokens 1..16 the patches in row-major order.

# %%
rollout = AttentionRollout(vit, head_fusion="mean", discard_ratio=0.5)
rollout_maps = rollout.attribute(images)
raw_tokens = RawAttention(vit).attribute(images, return_tokens=True)
gradcam_tokens = AttentionGradCAM(vit).attribute(images, target=target, return_tokens=True)
print("rollout maps", tuple(rollout_maps.shape), "| raw tokens", tuple(raw_tokens.shape),
      "| Grad-CAM tokens", tuple(gradcam_tokens.shape))
print("image 0 rollout, patch grid:")
print(rollout.attribute(images, return_tokens=True)[0, 1:].reshape(4, 4))

# %% [markdown]
# ## 3. Smoothing with Captum's NoiseTunnel
#
# The methods are ordinary Captum `Attribution`s, so Captum's wrappers work on them.
# `NoiseTunnel` with `nt_type="smoothgrad"` averages the map over `nt_samples` noisy copies
# of each input (`stdevs` is the noise level). The class-specific `GenericAttention` and the
# class-agnostic `AttentionRollout` both work:

# %%
smooth_generic = NoiseTunnel(GenericAttention(vit)).attribute(
    images, nt_type="smoothgrad", nt_samples=4, stdevs=0.1, target=target)
smooth_rollout = NoiseTunnel(AttentionRollout(vit)).attribute(
    images, nt_type="smoothgrad", nt_samples=4, stdevs=0.1)
print("smoothed GenericAttention", tuple(smooth_generic.shape), "| smoothed rollout", tuple(smooth_rollout.shape))

# %% [markdown]
# ## 4. Drawing a map
#
# `captum_transformers.visualization.image_overlay` draws a map over its image: the image in
# grey, relevance on top (red for the explained class, blue against it, the image itself where
# the relevance is zero) and a colour bar with the scale. A (C, H, W) map is summed over its
# channels, and `patch_grid` marks the 4x4 patches. The image must be in [0, 1] (what you
# would show), so we rescale the random input for display. In a notebook the overlay shows
# itself; `save` writes PNG, SVG or HTML.

# %%
shown_image = (images[0] - images[0].min()) / (images[0].max() - images[0].min())  # to [0, 1] for display
overlay = image_overlay(shown_image, generic[0], title="GenericAttention (random weights)", patch_grid=(4, 4))
heatmap_path = str(overlay.save(os.path.join(OUT, "vit_generic_attention.png")))
print("saved", heatmap_path)
overlay  # a notebook shows the picture here (a script ignores this line)

# %% [markdown]
# ## 5. Per-example targets
#
# `target` takes every form Captum accepts: one int for the whole batch, a list with one
# class per example, or a tensor (a scalar, or one class per example). `target=None`
# explains each example's predicted class.

# %%
explainer = GenericAttention(vit)
same_class = explainer.attribute(images, target=3, return_tokens=True)         # class 3 for all
as_list = explainer.attribute(images, target=[3, 3, 3, 3], return_tokens=True)  # one per example
as_tensor = explainer.attribute(images, target=torch.tensor([3, 3, 3, 3]), return_tokens=True)
mixed = explainer.attribute(images, target=[0, 1, 2, 3], return_tokens=True)
as_predicted = explainer.attribute(images, return_tokens=True)                  # predicted classes
print("int == list == tensor:", torch.allclose(same_class, as_list), torch.allclose(same_class, as_tensor))
print("target=None == target=predicted:", torch.allclose(as_predicted, explainer.attribute(
    images, target=predicted.tolist(), return_tokens=True)))
print("class-specific: example 0 explained for class 0 vs class 3 differ:",
      not torch.allclose(mixed[0], same_class[0]))

# %% [markdown]
# ## 6. Text: a tiny BERT with a padding mask
#
# A 2-layer BERT classifier with random weights, and a toy whitespace tokenizer over a
# 20-word vocabulary (a real model would use its own tokenizer; nothing below changes).

# %%
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "movie", "was", "great", "awful", "plot", "acting",
         "and", "not", "very", "good", "boring", "a", "film", "loved", "it"]
word_id = {word: i for i, word in enumerate(vocab)}

bert_hf = BertForSequenceClassification(BertConfig(
    vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, max_position_embeddings=32, num_labels=2, pad_token_id=0,
)).eval()
bert = Logits(bert_hf).eval()


def tokenize(sentences):
    """[CLS] words [SEP], padded to the longest sentence; returns ids, mask and tokens."""
    tokens = [["[CLS]"] + s.lower().split() + ["[SEP]"] for s in sentences]
    length = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), length, dtype=torch.long)
    mask = torch.zeros(len(tokens), length, dtype=torch.long)
    for row, sentence in enumerate(tokens):
        ids[row, :len(sentence)] = torch.tensor([word_id.get(w, word_id["[UNK]"]) for w in sentence])
        mask[row, :len(sentence)] = 1
    return ids, mask, tokens


sentences = ["the movie was great", "the plot was boring and the acting was not very good",
             "loved it"]
input_ids, attention_mask, tokens = tokenize(sentences)
print(input_ids.shape, "padding per sentence:", (attention_mask == 0).sum(dim=1).tolist())

# %% [markdown]
# The mask is passed with `forward_kwargs` (a HF model's second positional argument is not
# always the mask). With `return_tokens=True` the result is one score per token, and
# padding tokens get exactly zero. GenericAttention's relevance starts from the identity,
# so the explained token (CLS) keeps a self-relevance of at least 1; with random weights the
# other tokens get tiny scores. We print the words' scores scaled by each sentence's largest
# word score.
#
# (Captum wrappers that enlarge the batch, like `NoiseTunnel`, expand
# `additional_forward_args` but not `forward_kwargs`: pass the mask positionally there,
# e.g. to a wrapper `forward(self, embeddings, attention_mask)`.)

# %%
with torch.no_grad():
    probabilities = bert(input_ids, attention_mask=attention_mask).softmax(dim=-1)
text_target = probabilities.argmax(dim=-1)

token_scores = GenericAttention(bert).attribute(
    input_ids, target=text_target, return_tokens=True, forward_kwargs={"attention_mask": attention_mask})
print("token scores", tuple(token_scores.shape), "| zero on padding:",
      bool((token_scores[attention_mask == 0] == 0).all()))
print("CLS self-relevance:", [round(v, 3) for v in token_scores[:, 0].tolist()])
for sentence_tokens, scores in zip(tokens, token_scores):
    words = scores[1:len(sentence_tokens) - 1]
    words = words / words.max().clamp(min=1e-12)
    print("  " + " ".join(f"{t}:{s:.2f}" for t, s in zip(sentence_tokens[1:-1], words.tolist())))

# %% [markdown]
# `TokenHeatmap` renders token scores as signed colours in HTML (in a notebook it shows
# itself). The padding is dropped with the attention mask; [CLS] and [SEP] are drawn grey and
# left out of the colour scale (CLS's self-relevance of about 1 would otherwise wash out
# every word), and each line is scaled by its largest |score|.

# %%
words_view = TokenHeatmap(tokens, {"GenericAttention": token_scores}, attention_mask=attention_mask,
                          special_tokens={"[CLS]", "[SEP]"}, titles=sentences,
                          title="GenericAttention on a random BERT")
html_path = str(words_view.save(os.path.join(OUT, "bert_generic_attention.html")))
print("saved", html_path)
words_view  # shown inline in a notebook

# %% [markdown]
# ## Where next
#
# * `AttentionRollout(model, head_fusion="max", discard_ratio=0.9)` follows the settings
#   popular for ViTs; `start_layer=` skips the first layers in rollout and GenericAttention.
# * `explainer.trace(inputs, target=...)` returns the raw per-layer `AttentionTrace`.
# * Any Captum tool that takes an `Attribution` (NoiseTunnel, metrics such as
#   `captum.metrics.infidelity`) takes these methods too.
