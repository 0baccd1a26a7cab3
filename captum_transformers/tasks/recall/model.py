"""The built-in generative model: a tiny Llama that solves associative recall, and its tokenizer.

``LlamaForCausalLM`` (``MODEL_CONFIG``: two layers, grouped-query attention with 4 query heads
sharing 2 key-value heads, rotary positions, RMSNorm, SwiGLU, an untied head) over the word
vocabulary of :mod:`.task`, trained by :mod:`.train` to answer
``<bos> k1 w w ; ... ? k`` with the two words bound to ``k``, then ``<eos>``.
Every answer token is a copy of one prompt token (an induction step) and has known evidence in
the prompt (``RecallExample.evidence``), so explanations of its generations can be scored.

The tokenizer is a real ``transformers.PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel
model split on whitespace) that prepends ``<bos>``, pads on the left (for batched
``generate``) and carries a chat template. The weights ship as
``captum_transformers/assets/recall_llama.pt`` (float16 state dict, loaded as float32) next to
``recall_llama.json`` (accuracies, training time, seed and the command that produced them).

Example::

    >>> from captum_transformers.tasks.recall.model import load_recall_model
    >>> model, tokenizer = load_recall_model()
    >>> batch = tokenizer(["c red fox ; q blue owl ; h green cat ; m pink bee ? h"], return_tensors="pt")
    >>> out = model.generate(**batch)
    >>> tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    'green cat'
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from .task import BOS, EOS, PAD, UNK, vocabulary
from ..shipped_weights import asset, load_shipped_record, load_shipped_weights

WEIGHTS_FILE = "recall_llama.pt"
RECORD_FILE = "recall_llama.json"
RETRAIN_COMMAND = "python -m captum_transformers.tasks.recall.train"
# Two layers are what induction needs (Olsson et al. 2022): layer 1 writes each position's preceding
# tokens into it, layer 2 matches the current context against them and copies the token found.
# The longest prompt is 8 pairs: 1 + 8 * 3 + 7 + 2 = 34 tokens, the answer 3 more.
MODEL_CONFIG: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                    attention_dropout=0.0)
# Answers are two value words and <eos>.
MAX_NEW_TOKENS = 3
# Renders a conversation of user turns (the prompt text) and assistant turns (the answer text);
# the prompt already ends with "? key", so the generation prompt adds nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('The recall chat template takes user and assistant turns, received role '"
    " + message['role']) }}{% endif %}"
    "{% endfor %}")


def recall_tokenizer():
    """The recall task's ``PreTrainedTokenizerFast``: WordLevel on whitespace, ``<bos>`` prepended, left padding.

    Example::

        >>> tokenizer = recall_tokenizer()
        >>> tokenizer("a red fox ? a")["input_ids"]
        [1, 6, 26, 46, 5, 6]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    # WordLevel has no decoder of its own: a word-piece decoder with no prefix joins words by spaces.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        unk_token=UNK, padding_side="left", model_input_names=["input_ids",
                                                                                               "attention_mask"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_recall_model(attn_implementation: Optional[str] = None):
    """A randomly initialised recall ``LlamaForCausalLM`` (``MODEL_CONFIG``), in train mode.

    Its ``generation_config`` is greedy (no sampling, one beam), stops at ``<eos>`` and pads
    with ``<pad>``. ``attn_implementation`` ("eager", "sdpa", ...) goes to the config.

    Example::

        >>> build_recall_model().config.num_key_value_heads
        2
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = vocabulary()
    special = dict(bos_token_id=vocab[BOS], eos_token_id=vocab[EOS], pad_token_id=vocab[PAD])
    config = LlamaConfig(vocab_size=len(vocab), **MODEL_CONFIG, **special)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(**special, do_sample=False, num_beams=1,
                                               max_new_tokens=MAX_NEW_TOKENS)
    return model


def weights_path():
    """Where the shipped weights live inside the installed package (a Traversable)."""
    return asset(WEIGHTS_FILE)


def recall_model_record() -> Dict[str, Any]:
    """The JSON record of the shipped weights: test accuracies, seed, training time, command."""
    return load_shipped_record(RECORD_FILE, "The recall model record", RETRAIN_COMMAND)


def load_recall_model(dtype: torch.dtype = torch.float32, attn_implementation: Optional[str] = None) -> Tuple[Any, Any]:
    """``(model, tokenizer)``: the shipped recall Llama in eval mode (in ``dtype``) and its tokenizer.

    Raises :class:`InputError` naming the expected path and the retrain command when the
    weights file is missing.

    Example::

        >>> model, tokenizer = load_recall_model()
        >>> model.training, tokenizer.padding_side
        (False, 'left')
    """
    model = load_shipped_weights(build_recall_model(attn_implementation), weights_path(), "The recall model weights",
                                 RETRAIN_COMMAND)
    return model.to(dtype), recall_tokenizer()


def save_recall_pretrained(directory, dtype: torch.dtype = torch.float32) -> Path:
    """Write the shipped model and its tokenizer with ``save_pretrained`` into ``directory``.

    ``AutoModelForCausalLM.from_pretrained(directory)`` and
    ``AutoTokenizer.from_pretrained(directory)`` then load them offline: the Hugging Face path.

    Example::

        >>> from transformers import AutoModelForCausalLM
        >>> folder = save_recall_pretrained(tmp_path / "recall")
        >>> AutoModelForCausalLM.from_pretrained(folder).config.model_type
        'llama'
    """
    directory = Path(directory)
    model, tokenizer = load_recall_model(dtype)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
