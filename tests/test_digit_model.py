"""The built-in DigitCanvas ViT: shipped weights load, are small, reach the recorded accuracy; training learns."""
import json

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("sklearn")
pytest.importorskip("skimage")

from captum_transformers.errors import InputError
from captum_transformers.tasks.digits import model as digit_model, train as train_digits
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
from captum_transformers.tasks.digits.model import build_digit_model, digit_model_record, load_digit_model

# Accuracy on a few hundred canvases scatters around the recorded value (measured on 2000):
# a binomial standard error of about 0.015 at n = 400, so 0.05 is > 3 standard errors.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_digit_model()


def test_build_gives_the_documented_architecture():
    from timm.models.vision_transformer import VisionTransformer
    net = build_digit_model()
    assert isinstance(net, VisionTransformer)
    assert net.patch_embed.patch_size == (4, 4) and net.embed_dim == 64 and len(net.blocks) == 4
    assert net.blocks[0].attn.num_heads == 4 and net.num_classes == 10 and net.global_pool == "token"
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_shipped_weights_are_small_float16_and_load_in_eval_float32(model):
    with __import__("importlib").resources.as_file(digit_model.weights_path()) as path:
        assert path.stat().st_size < 1_000_000
        state = torch.load(path, weights_only=True)
    assert all(tensor.dtype == torch.float16 for tensor in state.values())
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.head.weight, state["head.weight"].float())


def test_record_holds_accuracy_seed_time_and_command():
    record = digit_model_record()
    assert record["command"].startswith("python -m captum_transformers.tasks.digits.train")
    assert 0.0 <= record["test_top1_one_digit"] <= 1.0 and 0.0 <= record["test_top2_set_two_digit"] <= 1.0
    assert isinstance(record["seed"], int) and record["train_seconds"] > 0


def test_shipped_model_reaches_recorded_one_digit_accuracy(model):
    data = digit_canvases("test", "one", n=400, seed=11)
    accuracy = train_digits.top1_accuracy(model, data)
    assert accuracy >= digit_model_record()["test_top1_one_digit"] - TOLERANCE


def test_shipped_model_ranks_both_digits_top2(model):
    data = digit_canvases("test", "two", n=300, seed=12)
    accuracy = train_digits.top2_set_accuracy(model, data)
    assert accuracy >= digit_model_record()["test_top2_set_two_digit"] - TOLERANCE


def test_missing_weights_raise_input_error_naming_the_file(monkeypatch):
    monkeypatch.setattr(digit_model, "WEIGHTS_FILE", "no_such_weights.pt")
    with pytest.raises(InputError, match="no_such_weights.pt"):
        load_digit_model()


def test_multi_hot_targets():
    assert torch.equal(train_digits.multi_hot(torch.tensor([2, 0]), 3), torch.tensor([[0., 0., 1.], [1., 0., 0.]]))
    assert torch.equal(train_digits.multi_hot(torch.tensor([[0, 2]]), 3), torch.tensor([[1., 0., 1.]]))


def test_a_few_training_steps_lower_the_loss():
    # On one fixed batch the recipe's step must fit it: the loss falls clearly below chance (ln 10 = 2.30).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = digit_canvases("train", "one", n=32, seed=5)
    inputs, targets = normalize(data.images), train_digits.multi_hot(data.labels)
    model = build_digit_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [train_digits.training_step(model, optimizer, inputs, targets, 1e-3) for _ in range(30)]
    assert losses[0] > 2.0 and losses[-1] < 0.8 * losses[0]


def test_training_is_seeded_and_deterministic():
    torch.set_num_threads(1)
    first = train_digits.train(epochs=1, seed=0, canvases_per_epoch=256, max_steps=3, evaluate_n=16)
    again = train_digits.train(epochs=1, seed=0, canvases_per_epoch=256, max_steps=3, evaluate_n=16)
    assert len(first["losses"]) == 3 and first["losses"] == again["losses"]
    assert all(torch.equal(a, b) for a, b in zip(first["model"].state_dict().values(),
                                                 again["model"].state_dict().values()))


def test_training_command_writes_weights_and_record(tmp_path, monkeypatch):
    monkeypatch.setattr(train_digits, "CANVASES_PER_EPOCH", 64)
    monkeypatch.setattr(train_digits, "EVALUATE_N", 16)
    out = tmp_path / "model.pt"
    assert train_digits.main(["--out", str(out), "--epochs", "1", "--seed", "3"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["seed"] == 3 and record["command"].endswith("--epochs 1 --seed 3 --threads 1")
    state = torch.load(out, weights_only=True)
    assert set(state) == set(build_digit_model().state_dict())


def test_bad_epochs_raise_input_error():
    with pytest.raises(InputError, match="epochs"):
        train_digits.train(epochs=0)


def test_curriculum_ramps_clutter_to_the_benchmark_canvases():
    from captum_transformers.tasks.digits.train import CLUTTER_RAMP_EPOCHS, clutter_at

    assert clutter_at(0) == 0.0 and clutter_at(CLUTTER_RAMP_EPOCHS // 2) == pytest.approx(0.5, abs=0.05)
    assert clutter_at(CLUTTER_RAMP_EPOCHS) == 1.0 and clutter_at(10 * CLUTTER_RAMP_EPOCHS) == 1.0
