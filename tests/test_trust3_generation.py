"""Generation inputs refused before any forward pass, with a message naming the fix: id tensors whose
padding has no attention mask, target and contrast ids outside the output vocabulary, non-UTF-8
command-line text, non-finite images, and prompts longer than a position table (one rule for the API
and the CLI: learned / fixed tables are a hard limit, rotary and relative positions are not).

Tiny models built from configs (tests/generation_models.py, tests/vlm_models.py; the recall Llama
and a GPT-2 over the recall tokenizer saved as folders for the CLI)."""
from __future__ import annotations

import warnings

import pytest
import torch
from generation_models import PAD, IdTokenizer, build
from vlm_generation_checks import PROMPT as IMAGE_PROMPT, TARGET as IMAGE_TARGET
from vlm_models import build_llava, pixels

from captum_transformers import AttnLRP, GenericAttention
from captum_transformers.cli import main
from captum_transformers.errors import InputError
from captum_transformers.generation import GenerationAttribution

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("captum_transformers.generation.serialization")

from captum_transformers.tasks.recall.model import build_recall_model, recall_tokenizer  # noqa: E402

TOKENIZER = IdTokenizer()


class _CountedForwards:
    """Counts the model's forward calls (a pre-hook), to show a refusal came before any."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.handle.remove()


@pytest.fixture(scope="module")
def llama():
    return build("llama")


# -- 5: padding without a mask ---------------------------------------------------------------------
def test_a_left_padded_id_tensor_without_a_mask_is_refused_and_its_mask_explains_it(llama):
    explainer = GenerationAttribution(AttnLRP(llama), TOKENIZER)
    padded = torch.tensor([[PAD, PAD, 1, 5, 6], [1, 7, 8, 9, 10]])
    with _CountedForwards(llama) as counted, pytest.raises(InputError) as error:
        explainer.attribute(padded, target=[[3], [4]])
    message = str(error.value)
    assert "attention_mask" in message and f"pad id {PAD}" in message and "row 0" in message, message
    assert counted.calls == 0
    # What the message asks for: the tokenizer's dict, with its mask, explains the prompts alone.
    mask = (padded != PAD).long()
    masked = explainer.attribute({"input_ids": padded, "attention_mask": mask}, target=[[3], [4]])
    alone = explainer.attribute([[1, 5, 6], [1, 7, 8, 9, 10]], target=[[3], [4]])
    assert masked[0].input_ids == [1, 5, 6]
    assert torch.allclose(masked[0].token_attr, alone[0].token_attr, atol=1e-10, rtol=0)


def test_a_right_padded_id_tensor_and_a_maskless_dict_are_refused(llama):
    explainer = GenerationAttribution(AttnLRP(llama), TOKENIZER)
    with pytest.raises(InputError, match="right padding"):
        explainer.attribute(torch.tensor([[1, 5, 6, PAD, PAD], [1, 7, 8, 9, 10]]), target=[[3], [4]])
    with pytest.raises(InputError, match="attention_mask"):
        explainer.attribute({"input_ids": torch.tensor([[PAD, 1, 5], [1, 7, 8]])}, target=[[3], [4]])
    with pytest.raises(InputError, match="attention_mask"):  # the same rows as equal-length id lists
        explainer.attribute([[PAD, 1, 5], [1, 7, 8]], target=[[3], [4]])


def test_real_id_tensors_are_not_refused(llama):
    explainer = GenerationAttribution(AttnLRP(llama), TOKENIZER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = explainer.attribute(torch.tensor([[1, 5, 6], [1, 7, 8]]), target=[[3], [4]])
        assert [r.input_ids for r in results] == [[1, 5, 6], [1, 7, 8]]
        # A pad id inside a prompt is a token like any other.
        explainer.attribute(torch.tensor([[1, PAD, 6], [1, 7, 8]]), target=[[3], [4]])


class _PadIsBosAndEos(IdTokenizer):
    """A tokenizer whose pad id is also its bos and eos id (as GPT-2's pad = eos = bos)."""

    pad_token_id = eos_token_id = bos_token_id = 1


def test_a_pad_id_that_is_also_bos_or_eos_counts_only_as_a_run(llama):
    explainer = GenerationAttribution(AttnLRP(llama), _PadIsBosAndEos())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Every row starts with one bos and ends with one eos: real prompts.
        explainer.attribute(torch.tensor([[1, 5, 6, 1], [1, 7, 8, 1]]), target=[[3], [4]])
        explainer.attribute(torch.tensor([1, 5, 6]), target=[3])
    with pytest.raises(InputError, match="left padding"):  # a run of pad ids before the bos
        explainer.attribute(torch.tensor([[1, 1, 5, 6], [1, 7, 8, 9]]), target=[[3], [4]])
    with pytest.raises(InputError, match="right padding"):  # a run of pad ids after the eos
        explainer.attribute(torch.tensor([[5, 6, 1, 1], [7, 8, 9, 1]]), target=[[3], [4]])


class _NoPadTokenizer(IdTokenizer):
    pad_token_id = None


def test_the_model_configs_pad_id_serves_when_the_tokenizer_has_none(llama):
    explainer = GenerationAttribution(AttnLRP(llama), _NoPadTokenizer())  # llama.config.pad_token_id == PAD
    with pytest.raises(InputError, match=f"pad id {PAD}"):
        explainer.attribute(torch.tensor([[PAD, 1, 5], [1, 7, 8]]), target=[[3], [4]])


def test_a_single_row_or_equally_padded_rows_starting_with_pad_warn(llama):
    explainer = GenerationAttribution(AttnLRP(llama), TOKENIZER)
    with pytest.warns(UserWarning, match="starts with 2 pad ids"):
        explainer.attribute(torch.tensor([[PAD, PAD, 1, 5, 6]]), target=[3])
    with pytest.warns(UserWarning, match="pad id"):
        explainer.attribute([PAD, 1, 5, 6], target=[3])
    with pytest.warns(UserWarning, match="pad id"):  # every row padded alike: possibly padding
        explainer.attribute(torch.tensor([[PAD, 1, 5], [PAD, 1, 7]]), target=[[3], [4]])


# -- 13: target and contrast ids outside the vocabulary ----------------------------------------------
@pytest.mark.parametrize("call, pieces", [
    (lambda e: e.attribute([1, 5, 6], target=[3, 40]), ["id 40", "step 1", "[0, 40)", "target"]),
    (lambda e: e.attribute([1, 5, 6], target=[-1]), ["id -1", "step 0", "[0, 40)"]),
    (lambda e: e.attribute([[1, 5], [1, 6, 7]], target=[[3], [4, 41]]), ["Prompt 1", "id 41", "step 1"]),
    (lambda e: e.attribute([1, 5, 6], target=[3, 4], contrast=[99]), ["contrast", "id 99", "[0, 40)"]),
    (lambda e: e.attribute([1, 5, 6], target=[3, 4], contrast=[5, -3]), ["contrast", "id -3", "step 1"]),
])
def test_out_of_vocabulary_targets_and_foils_are_refused_before_any_forward(llama, call, pieces):
    for method in (AttnLRP(llama), GenericAttention(llama)):
        with _CountedForwards(llama) as counted, pytest.raises(InputError) as error:
            call(GenerationAttribution(method, TOKENIZER))
        assert all(piece in str(error.value) for piece in pieces), str(error.value)
        assert counted.calls == 0


# -- 14: non-UTF-8 text -----------------------------------------------------------------------------
@pytest.mark.parametrize("extra, flag", [
    (["--prompt", "a \udcff\udcfe b"], "--prompt"),
    (["--prompt", "a ? a", "--target", "red \udcff"], "--target"),
    (["--prompt", "a ? a", "--contrast", "\udce9"], "--contrast"),
])
def test_cli_text_that_is_not_utf8_is_one_line(tmp_path, capsys, extra, flag):
    assert main(["explain", *extra, "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert flag in error and "UTF-8" in error, error
    assert not (tmp_path / "out").exists()


def test_api_text_that_is_not_utf8_is_refused():
    model, tokenizer = build_recall_model().eval(), recall_tokenizer()
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    with pytest.raises(InputError, match="UTF-8"):
        explainer.attribute("a \udcff ? a", target="red")
    with pytest.raises(InputError, match="UTF-8"):
        explainer.attribute("a red fox ? a", target="red \udcff")


# -- 15: non-finite images --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llava32():
    return build_llava().float()


def _nan_pixels(count=1, seed=0):
    px = pixels(count, seed=seed).float()
    px[0, 0, 1, 2] = float("nan")
    return px


@pytest.mark.parametrize("give, where", [
    (lambda px: {"inp": IMAGE_PROMPT, "images": px}, "images"),
    (lambda px: {"inp": IMAGE_PROMPT, "pixel_values": px}, "pixel_values"),
    (lambda px: {"inp": [IMAGE_PROMPT, IMAGE_PROMPT], "images": [pixels(1).float(), px]}, "prompt 1"),
])
def test_a_nan_pixel_is_named_before_any_forward(llava32, give, where):
    kwargs = give(_nan_pixels())
    inp = kwargs.pop("inp")
    target = IMAGE_TARGET if not isinstance(inp[0], list) else [IMAGE_TARGET, IMAGE_TARGET]
    for method in (AttnLRP(llava32), GenericAttention(llava32)):
        with _CountedForwards(llava32) as counted, pytest.raises(InputError) as error:
            GenerationAttribution(method, TOKENIZER).attribute(inp, target=target, **kwargs)
        message = str(error.value)
        assert "1 NaN" in message and where in message and "nan_to_num" in message, message
        assert counted.calls == 0
    with pytest.raises(InputError, match="NaN"):  # before generating a target with them, too
        GenerationAttribution(AttnLRP(llava32), TOKENIZER).attribute(inp, gen_args={"max_new_tokens": 1}, **kwargs)


def test_an_infinite_pixel_is_named(llava32):
    px = pixels(1).float()
    px[0, 1, 0, 0] = float("inf")
    with pytest.raises(InputError, match=r"1 \+inf"):
        GenerationAttribution(AttnLRP(llava32), TOKENIZER).attribute(IMAGE_PROMPT, target=IMAGE_TARGET, images=px)


# -- 16: prompt length, one rule for the API and the CLI ---------------------------------------------
LIMIT = 32  # the GPT-2's n_positions below


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The recall Llama (rotary positions, max_position_embeddings 128) and a GPT-2 with a learned
    table of LIMIT positions over the same tokenizer, both random, as save_pretrained folders."""
    tokenizer = recall_tokenizer()
    torch.manual_seed(0)
    llama = tmp_path_factory.mktemp("rope")
    build_recall_model().eval().save_pretrained(llama)
    tokenizer.save_pretrained(llama)
    gpt2 = tmp_path_factory.mktemp("table")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=len(tokenizer),
                                                         n_positions=LIMIT, **special)).eval().save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    return {"rope": llama, "table": gpt2}


def _prompt(tokens: int) -> str:
    """A recall prompt of ``tokens`` tokens (its <bos> counted)."""
    text = " ".join(["a"] * (tokens - 1))
    assert len(recall_tokenizer()(text)["input_ids"]) == tokens
    return text


def _api(folder, prompt, target=None, new_tokens=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    if target is None:
        return explainer.attribute(prompt, gen_args={"max_new_tokens": new_tokens, "do_sample": False,
                                                     "min_new_tokens": new_tokens})
    return explainer.attribute(prompt, target=target)


def _cli(folder, prompt, tmp_path, capsys, target=None, new_tokens=None):
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    output = ["--target", target] if target is not None else ["--generate", str(new_tokens)]
    status = main(["explain", "--prompt", prompt, "--model", str(folder), *output, "--method", "attn-lrp", "--out",
                   str(out)])
    captured = capsys.readouterr()
    return status, captured.err.strip()


def test_position_limit_is_the_table_not_max_position_embeddings():
    from captum_transformers.generation.positions import position_limit

    assert position_limit(build("gpt2")) == 32  # learned table wpe
    assert position_limit(build("bart")) == 32  # learned tables with an offset of 2 rows
    for rotary_or_relative in ("llama", "qwen2_sliding", "t5"):
        assert position_limit(build(rotary_or_relative)) is None
    assert position_limit(build_llava()) is None  # the vision tower's patch table is not the text's


@pytest.mark.parametrize("kind, prompt_tokens, target, accepted", [
    ("rope", 203, "red fox", True),  # past max_position_embeddings 128: rotary positions read any length
    ("rope", 182, "red", True),
    ("table", LIMIT - 1, "red fox", True),  # LIMIT - 1 + 2 - 1 = LIMIT positions read: the last one fits
    ("table", LIMIT, "red fox", False),  # LIMIT + 1 positions
    ("table", LIMIT + 1, "red", False),  # the prompt alone
])
def test_the_api_and_the_cli_accept_and_refuse_the_same_prompts(folders, tmp_path, capsys, kind, prompt_tokens,
                                                                 target, accepted):
    prompt = _prompt(prompt_tokens)
    status, error = _cli(folders[kind], prompt, tmp_path, capsys, target=target)
    if accepted:
        result = _api(folders[kind], prompt, target=target)
        assert len(result.input_ids) == prompt_tokens and status == 0, error
        return
    with pytest.raises(InputError) as refused:
        _api(folders[kind], prompt, target=target)
    assert status == 2 and len(error.splitlines()) == 1, error
    for message in (str(refused.value), error):
        assert f"at most {LIMIT} positions" in message and "wpe" in message, message


@pytest.mark.parametrize("prompt_tokens, new_tokens, accepted", [
    (LIMIT - 2, 3, True),  # LIMIT - 2 + 3 - 1 = LIMIT
    (LIMIT - 2, 4, False),
])
def test_generating_past_the_table_is_refused_before_generating(folders, tmp_path, capsys, prompt_tokens, new_tokens,
                                                                accepted):
    prompt = _prompt(prompt_tokens)
    status, error = _cli(folders["table"], prompt, tmp_path, capsys, new_tokens=new_tokens)
    if accepted:
        assert status == 0, error
        assert len(_api(folders["table"], prompt, new_tokens=new_tokens).output_ids) <= new_tokens
        return
    with pytest.raises(InputError, match="max_new_tokens") as refused:
        _api(folders["table"], prompt, new_tokens=new_tokens)
    assert status == 2 and "--generate" in error and f"at most {LIMIT}" in error, error
    assert f"at most {LIMIT - prompt_tokens + 1}" in str(refused.value)


def test_an_encoder_decoders_tables_limit_its_source_and_its_decoder():
    bart = build("bart")
    explainer = GenerationAttribution(AttnLRP(bart), TOKENIZER)
    explainer.attribute(list(range(3, 35)), target=[5])  # 32 source positions
    with pytest.raises(InputError, match="at most 32 positions"):
        explainer.attribute(list(range(3, 36)), target=[5])
    explainer.attribute([1, 5], target=[5] * 32)  # the start token + 31 read targets
    with pytest.raises(InputError, match="at most 32 positions"):
        explainer.attribute([1, 5], target=[5] * 33)
    t5 = GenerationAttribution(AttnLRP(build("t5")), TOKENIZER)
    assert t5.attribute(list(range(3, 39)) * 2, target=[5]).token_attr.shape == (1, 72)  # relative positions
