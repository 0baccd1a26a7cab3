"""benchmarks/gpu_long_context.py --tiny runs on the CPU and prints every row (no timing checks)."""
from __future__ import annotations

import pytest
from benchmark_scripts import benchmark_script

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("gpu_long_context.py", "gpu_long_context_benchmark") as module:
        yield module


def test_tiny_cpu_run_prints_one_row_per_operation(bench, capsys):
    lines = bench.main(["--tiny", "--device", "cpu", "--tokens", "64"])
    printed = capsys.readouterr().out
    rows = [line for line in lines if line.startswith("| 64 |")]
    names = [row.split("|")[2].strip() for row in rows]
    expected = ["forward + backward", "AttnLRP", "ConservativeLRP", "GenericAttention",
                f"GenerationAttribution(AttnLRP), {bench.GENERATED} tokens"]
    assert names[:5] == expected and all(row in printed for row in rows)
    assert rows[0].split("|")[4].strip() == "1.00x"  # the reference is its own unit
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[3:7]]
        assert float(cells[0]) > 0 and cells[1].endswith("x") and float(cells[2]) >= 0, row
    lxt = bench.lxt_status()
    assert ("LXT: side by side" in lines[0]) == (lxt is None)
    if lxt is None:
        assert "LXT AttnLRP" in names and "LXT CP-LRP" in names
    else:
        assert f"not run ({lxt})" in lines[0]
    assert "Llama 2 layers, width 64" in lines[0] and "CPU" in lines[0]


def test_cuda_without_a_gpu_is_refused(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cuda"])
