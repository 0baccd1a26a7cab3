"""benchmarks/generation_cost.py --quick runs in process and prints every row (no timing checks)."""
from __future__ import annotations

import pytest
import torch
from benchmark_scripts import benchmark_script

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("generation_cost.py", "generation_cost_benchmark") as module:
        yield module


def test_quick_run_prints_every_operation_and_ratio(bench, capsys):
    threads = torch.get_num_threads()
    lines = bench.main(["--quick"])
    assert torch.get_num_threads() == threads  # main restores the thread count
    printed = capsys.readouterr().out
    for name, label in bench.OPERATIONS.items():
        if name != "e_inseq":  # --quick never starts the scratch venv
            assert label in printed
    assert "inseq: not run (--quick)" in printed
    for ratio in ("| a / b |", "| a / d |", "| a' / b |", "| a' / d |", "| c / b |"):
        assert ratio in printed
    assert any(line.startswith("check: a' (log_prob) vs c") for line in lines)


def test_the_tokenizer_gives_back_the_same_ids(bench):
    """Every library must see the same prompt ids: the text round-trips through the tokenizer."""
    tokenizer = bench.build_tokenizer(bench.QUICK.vocab)
    prompt, target = bench.make_tokens(bench.QUICK)
    assert min(prompt + target) >= len(bench.SPECIAL)
    assert tokenizer.encode(bench.as_text(prompt)) == prompt
    assert tokenizer(bench.as_text(target), add_special_tokens=False)["input_ids"] == target


def test_the_package_and_captum_agree_on_attnlrp_of_log_prob(bench):
    """The check the benchmark prints: the same relevance through the engine and Captum's loop."""
    size = bench.QUICK
    model = bench.build_model(size)
    prompt, target = bench.make_tokens(size)
    ops = bench.make_ops(model, bench.build_tokenizer(size.vocab), prompt, target)
    ours, captums = ops["a_log_prob"](), ops["c_captum_attnlrp"]()
    assert ours.shape == captums.shape == (len(target), len(prompt))
    assert captums.abs().max() > 0
    torch.testing.assert_close(ours.double(), captums.double(), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(ours, ops["a_logit"]())  # the score kind reaches the engine
