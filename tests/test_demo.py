"""The README's main-job command keeps working."""
from captum_transformers.demo import main


def test_demo_runs_offline_and_writes_the_grid(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--batch", "2"]) == 0
    printed = capsys.readouterr().out
    from captum_transformers.demo import DEMO_METHODS

    for method in DEMO_METHODS:
        assert method.__name__ in printed
    assert (tmp_path / "methods.png").stat().st_size > 0
