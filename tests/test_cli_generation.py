"""``captum-transformers explain --prompt``: a language model's generation explained by every
method from the command line: the three files, scores.json equal to GenerationAttribution's
results, --target / --contrast / --score, a local save_pretrained folder, and one-line errors."""
from __future__ import annotations

import json

import pytest
import torch

from captum_transformers.cli import main
from captum_transformers.cli.generation_explain import GENERATION_METHODS
from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.catalog import build_method

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
serialization = pytest.importorskip("captum_transformers.generation.serialization")
pytest.importorskip("captum_transformers.visualization.generation_text")

from captum_transformers.tasks.recall.model import (MAX_NEW_TOKENS, build_recall_model,  # noqa: E402
                                                    recall_tokenizer, save_recall_pretrained, weights_path)
from captum_transformers.tasks.recall.task import make_example  # noqa: E402

# The task writes the prompt (its format is the task's): "h" is asked, the answer is "green cat".
EXAMPLE = make_example([("c", ("red", "fox")), ("q", ("blue", "owl")), ("h", ("green", "cat")),
                        ("m", ("pink", "bee"))], "h")
PROMPT, ANSWER = EXAMPLE.prompt, EXAMPLE.answer
FILES = ("generation.html", "generation.png", "scores.json")
needs_shipped_weights = pytest.mark.skipif(
    not weights_path().is_file(), reason="the recall model's shipped weights (captum_transformers/assets/"
                                         "recall_llama.pt) are not trained yet: python -m "
                                         "captum_transformers.tasks.recall.train")


@pytest.fixture(scope="module")
def random_folder(tmp_path_factory):
    """The recall Llama with random weights, saved as a HuggingFace folder (needs no shipped weights)."""
    folder = tmp_path_factory.mktemp("random_recall")
    torch.manual_seed(0)
    build_recall_model().eval().save_pretrained(folder)
    recall_tokenizer().save_pretrained(folder)
    return folder


def _loaded(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def _assert_equal_results(read, made):
    assert read.input_tokens == made.input_tokens and read.output_tokens == made.output_tokens
    assert read.output_ids == made.output_ids and read.score_kind == made.score_kind
    assert read.contrast_tokens == made.contrast_tokens and read.signed == made.signed
    for field in ("token_attr", "target_attr", "output_probs", "scores", "first_token_share"):
        assert torch.equal(getattr(read, field), getattr(made, field).detach().cpu()), field


def test_default_methods_write_the_three_files_and_scores_read_back_equal(random_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["explain", "--prompt", PROMPT, "--model", str(random_folder), "--generate", "3", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    for name in GENERATION_METHODS:
        assert f"{name}: " in printed
    assert "attention-flow" not in printed and "integrated-gradients" not in printed
    for name in FILES:
        assert (out / name).stat().st_size > 1000, name
    html = (out / "generation.html").read_text()
    assert "Output token 0" in html and "attn-lrp" in html
    read = serialization.load_scores_json(out / "scores.json")
    assert list(read) == list(GENERATION_METHODS)
    model, tokenizer = _loaded(random_folder)
    for name in ("attn-lrp", "rollout"):
        made = GenerationAttribution(build_method(name, model), tokenizer).attribute(
            PROMPT, gen_args={"max_new_tokens": 3, "do_sample": False})
        _assert_equal_results(read[name], made)


def test_target_contrast_and_score_reach_the_explanation(random_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["explain", "--prompt", PROMPT, "--model", str(random_folder), "--target", ANSWER, "--contrast",
                 "blue", "--score", "log_prob", "--method", "gradient-x-input", "--method", "attn-lrp", "--out",
                 str(out)]) == 0
    assert "(given)" in capsys.readouterr().out
    read = serialization.load_scores_json(out / "scores.json")
    model, tokenizer = _loaded(random_folder)
    for name in ("gradient-x-input", "attn-lrp"):
        assert read[name].output_tokens == ["green", "cat"] and read[name].contrast_tokens == ["blue", "blue"]
        made = GenerationAttribution(build_method(name, model), tokenizer, score="log_prob").attribute(
            PROMPT, target=ANSWER, contrast="blue")
        _assert_equal_results(read[name], made)
    payload = json.loads((out / "scores.json").read_text())
    assert payload["prompt"] == PROMPT and payload["model"] == str(random_folder)
    assert payload["score_kind"] == "log_prob" and payload["target"] == ANSWER and payload["contrast"] == "blue"


@needs_shipped_weights
def test_builtin_model_answers_and_its_scores_equal_generation_attribution(tmp_path, capsys):
    from captum_transformers.tasks.recall.model import load_recall_model

    out = tmp_path / "out"
    assert main(["explain", "--prompt", PROMPT, "--method", "attn-lrp", "--method", "generic-attention", "--out",
                 str(out)]) == 0
    printed = capsys.readouterr().out
    assert "built-in recall Llama" in printed and f"-> '{ANSWER} <eos>' (generated)" in printed
    read = serialization.load_scores_json(out / "scores.json")
    model, tokenizer = load_recall_model()
    for name in ("attn-lrp", "generic-attention"):
        made = GenerationAttribution(build_method(name, model), tokenizer).attribute(
            PROMPT, gen_args={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False})
        _assert_equal_results(read[name], made)
    # The trained model copies the words bound to the asked key: each answer word's top prompt token
    # (after <bos>) is one of its evidence tokens (the word, its key, the asked key), and it is printed.
    rows = read["attn-lrp"].token_attr
    for row, evidence in enumerate(EXAMPLE.evidence):
        top = 1 + int(rows[row, 1:].argmax())
        assert top in (evidence.value, evidence.key, evidence.query), (row, top, evidence)
        assert f"{read['attn-lrp'].output_tokens[row]!r} <- {read['attn-lrp'].input_tokens[top]!r}" in printed


@needs_shipped_weights
def test_a_save_pretrained_folder_explains_like_the_builtin_model(tmp_path, capsys):
    folder = save_recall_pretrained(tmp_path / "recall")
    assert main(["explain", "--prompt", PROMPT, "--model", str(folder), "--method", "conservative-lrp", "--out",
                 str(tmp_path / "local")]) == 0
    assert main(["explain", "--prompt", PROMPT, "--method", "conservative-lrp", "--out",
                 str(tmp_path / "builtin")]) == 0
    local = serialization.load_scores_json(tmp_path / "local" / "scores.json")["conservative-lrp"]
    builtin = serialization.load_scores_json(tmp_path / "builtin" / "scores.json")["conservative-lrp"]
    assert local.output_tokens == builtin.output_tokens
    torch.testing.assert_close(local.token_attr, builtin.token_attr, rtol=1e-4, atol=1e-5)


def _no_config_folder(tmp_path):
    (tmp_path / "empty_model").mkdir()
    return ["--model", str(tmp_path / "empty_model")]


@pytest.mark.parametrize("extra, message", [
    (["--generate", "3", "--target", "cat"], "--generate 3 and --target 'cat' both say what to explain"),
    (["--prompt", "   "], "--prompt is empty"),
    # (A prompt past max_position_embeddings is explained on this rotary Llama, as by the API: only a learned
    # position table limits the length; tests/test_trust3_generation.py refuses it on GPT-2 through both paths.)
    (["--method", "nope"], "unknown method 'nope'; expected one of"),
    (["--score", "probability"], "--score 'probability': expected one of logit, log_prob, prob"),
    (["--generate", "0"], "--generate 0: expected a positive number"),
    (["--method", "saliency", "--contrast", "blue"], "saliency explain(s) the next-token logit only; drop --contrast"),
    (["--text", "a film"], "--text belong(s) to the classifier explanations"),
    (["--device", "cuda:99"], "--device cuda:99"),
    (_no_config_folder, "is a directory that has no config.json"),
    (["--model", "someone/no-such-model"], "the hub cannot be reached (HF_HUB_OFFLINE is set)"),
])
def test_mistakes_are_one_line_exit_2_and_leave_no_out_folder(random_folder, tmp_path, capsys, monkeypatch, extra,
                                                              message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = extra(tmp_path) if callable(extra) else extra
    argv = ["explain", "--prompt", PROMPT, "--model", str(random_folder), *extra, "--out", str(tmp_path / "out")]
    if "--prompt" in extra:  # the case's prompt replaces the default one
        argv = ["explain", "--model", str(random_folder), *extra, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error, error
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    assert not (tmp_path / "out").exists()


def test_generation_options_without_prompt_are_refused_and_classifier_checks_stay(capsys):
    assert main(["explain", "--generate", "3", "--samples", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--generate explain(s) a language model's generation and need(s) --prompt" in error
    for argv, usage in ((["explain", "--method", "nope"], "invalid choice: 'nope'"),
                        (["explain", "--target", "cat"], "invalid int value: 'cat'")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and usage in capsys.readouterr().err


def test_methods_a_bfloat16_folder_cannot_run_are_refused_before_any_work(tmp_path, capsys):
    import torch
    from captum_transformers.cli import main
    from captum_transformers.tasks.recall.model import save_recall_pretrained

    folder = tmp_path / "bf16"
    save_recall_pretrained(folder, dtype=torch.bfloat16)
    out = tmp_path / "out"
    status = main(["explain", "--prompt", "c red fox ; h green cat ? h", "--model", str(folder), "--out", str(out)])
    assert status == 2 and not out.exists()
    error = capsys.readouterr().err
    assert "transformer-relevance" in error and "bfloat16" in error and "raw-attention" not in error
