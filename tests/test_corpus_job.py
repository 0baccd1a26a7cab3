"""The corpus job (captum_transformers.corpus): a store equal to the method's own calls, resumed
after a kill to the same bytes, other settings refused, damaged shards recomputed, and two
torchrun processes (one killed with SIGKILL halfway) equal to one uninterrupted process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyarrow")

from captum_transformers.corpus import (digit_canvas_source, explain_dataset, read_store, rows_to_maps,
                                        table_source)
from captum_transformers.corpus.store import record_path, shard_path
from captum_transformers.errors import InputError
from captum_transformers.methods.catalog import build_method
from captum_transformers.tasks.digits.model import load_digit_model

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.corpus_kill_resume import worker_pids  # noqa: E402  (the full-size check's helper)


@pytest.fixture(scope="module")
def digit_model():
    return load_digit_model()


def _table_bytes(out):
    table = read_store(out)
    return {name: table.column(name).to_pylist() for name in table.column_names}


@pytest.mark.parametrize("method", ["generic-attention", "attn-lrp"])
def test_the_store_holds_the_methods_own_maps_of_each_batch(digit_model, tmp_path, method):
    source = digit_canvas_source(40)
    run = explain_dataset(digit_model, source, method, tmp_path, batch_size=8, shard_rows=16, progress=False)
    assert (run.shards_computed, run.shards_skipped, run.rows_computed) == (3, 0, 40)
    table = read_store(tmp_path)
    assert table.column("row_id").to_pylist() == list(range(40))
    images = source.batch(0, 40)[0][0]
    for low in range(0, 40, 8):
        batch = images[low:low + 8]
        with torch.no_grad():
            logits = digit_model(batch)
        target = logits.argmax(-1)
        expected = build_method(method, digit_model).attribute(batch, target=target).float()
        assert torch.equal(torch.stack(rows_to_maps(table, range(low, low + 8))), expected)
        assert table.column("target").to_pylist()[low:low + 8] == target.tolist()
        assert table.column("score").to_pylist()[low:low + 8] == logits.double().gather(1, target[:, None]).squeeze(1).tolist()


def test_labels_as_targets_and_a_rerun_that_finds_everything_finished(digit_model, tmp_path):
    source = digit_canvas_source(20)
    explain_dataset(digit_model, source, "generic-attention", tmp_path, batch_size=8, shard_rows=8, target="label",
                    progress=False)
    assert read_store(tmp_path).column("target").to_pylist() == source.labels.tolist()
    again = explain_dataset(digit_model, source, "generic-attention", tmp_path, batch_size=8, shard_rows=8,
                            target="label", progress=False)
    assert (again.shards_computed, again.shards_skipped) == (0, 3)


@pytest.mark.parametrize("change", [{"method": "attn-lrp"}, {"batch_size": 4}, {"shard_rows": 8}, {"rows": 24},
                                    {"weights": True}])
def test_a_run_with_other_settings_into_the_same_folder_is_refused(digit_model, tmp_path, change):
    explain_dataset(digit_model, digit_canvas_source(16), "generic-attention", tmp_path, batch_size=8,
                    shard_rows=16, progress=False)
    model = digit_model
    if change.get("weights"):
        model = load_digit_model()
        with torch.no_grad():
            next(model.parameters()).add_(1e-6)
    before = sorted(p.name for p in (tmp_path / "shards").iterdir())
    with pytest.raises(InputError, match=r"other settings.*(method|batch_size|shard_rows|rows|weights_sha256)"):
        explain_dataset(model, digit_canvas_source(change.get("rows", 16)), change.get("method", "generic-attention"),
                        tmp_path, batch_size=change.get("batch_size", 8), shard_rows=change.get("shard_rows", 16),
                        progress=False)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == before


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "record missing", "record of other rows"])
def test_a_damaged_shard_is_detected_refused_by_the_reader_and_recomputed(digit_model, tmp_path, damage):
    source = digit_canvas_source(24)
    kwargs = dict(batch_size=8, shard_rows=8, progress=False)
    explain_dataset(digit_model, source, "generic-attention", tmp_path / "clean", **kwargs)
    explain_dataset(digit_model, source, "generic-attention", tmp_path / "hurt", **kwargs)
    data, record = shard_path(tmp_path / "hurt", 1), record_path(tmp_path / "hurt", 1)
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flipped byte":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "record missing":
        record.unlink()
    else:
        entry = json.loads(record.read_text())
        record.write_text(json.dumps({**entry, "rows": [0, 8]}))
    with pytest.raises(InputError, match=r"not finished: 1 of 3 shards are missing or damaged \(first: \[1\]\)"):
        read_store(tmp_path / "hurt")
    run = explain_dataset(digit_model, source, "generic-attention", tmp_path / "hurt", **kwargs)
    assert (run.shards_computed, run.shards_skipped, run.recomputed) == (1, 2, 1)
    assert _table_bytes(tmp_path / "hurt") == _table_bytes(tmp_path / "clean")


def test_text_rows_from_json_lines_keep_their_tokens_and_drop_padding(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3, attn_implementation="eager")).eval()
    texts = ["a b c", "b c d e f", "c", "d e", "e f a b"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vocab = {w: i + 5 for i, w in enumerate("abcdef")}

    def prepare(values):
        tokens = [["[CLS]", *v.split()] for v in values]
        width = max(map(len, tokens))
        ids = torch.tensor([[1] + [vocab[w] for w in t[1:]] + [0] * (width - len(t)) for t in tokens])
        mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in tokens])[:, None]).long()
        return (ids,), {"attention_mask": mask}, tokens

    source = table_source(tmp_path / "rows.jsonl", prepare)
    explain_dataset(model, source, "attn-lrp", tmp_path / "out", batch_size=3, shard_rows=4, progress=False)
    table = read_store(tmp_path / "out")
    assert table.column("tokens").to_pylist() == [["[CLS]", *t.split()] for t in texts]
    for row, text in enumerate(texts):
        (ids,), kwargs, _ = prepare([text])
        target = model(ids, **kwargs).logits.argmax(-1)
        alone = build_method("attn-lrp", model).attribute(ids, target=target, forward_kwargs=kwargs, return_tokens=True)
        assert rows_to_maps(table, [row])[0].shape == (len(text.split()) + 1,)
        torch.testing.assert_close(rows_to_maps(table, [row])[0], alone[0].float(), rtol=1e-5, atol=1e-6)


def test_a_missing_column_and_a_missing_file_are_refused_by_name(tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"sentence": "a"}) + "\n")
    with pytest.raises(InputError, match=r"line 1 has no 'text' field.*--column"):
        table_source(tmp_path / "rows.jsonl", prepare=None)
    with pytest.raises(InputError, match=r"no such file or folder"):
        table_source(tmp_path / "absent.parquet", prepare=None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers through /proc")
def test_two_torchrun_processes_one_killed_halfway_resume_to_the_one_process_store(tmp_path):
    """Two ranks (gloo) explain 192 canvases; rank 1 is killed with SIGKILL once a few shards are
    written; the same command run again finishes, and the store equals one uninterrupted process's
    bit for bit, every row id once."""
    job = ["attribute", "--data", "digits:192", "--method", "integrated-gradients", "--batch-size", "8",
           "--shard-rows", "16", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "captum_transformers"]
    first = subprocess.Popen([*torchrun, *job, "--out", str(tmp_path / "two")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    records = tmp_path / "two" / "records"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if records.is_dir() and len(list(records.glob("*.json"))) >= 3:
            break
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()[0].decode()[-3000:]
    workers = worker_pids(first.pid)
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)  # the later-started worker; torchrun then stops the other
    first.communicate(timeout=120)
    assert first.returncode != 0
    with pytest.raises(InputError, match="not finished"):
        read_store(tmp_path / "two")
    second = subprocess.run([*torchrun, *job, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "found" in second.stdout and "found 0 finished" not in second.stdout, second.stdout
    one = subprocess.run([sys.executable, "-m", "captum_transformers", *job, "--out", str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two, single = _table_bytes(tmp_path / "two"), _table_bytes(tmp_path / "one")
    assert two["row_id"] == list(range(192))
    assert two == single
    ranks = {json.loads(p.read_text())["rank"] for p in records.glob("*.json")}
    assert ranks == {0, 1}


def test_the_command_line_writes_a_store_and_refuses_another_method_into_it(tmp_path, capsys):
    from captum_transformers.cli import main

    out = str(tmp_path / "store")
    assert main(["attribute", "--data", "digits:12", "--shard-rows", "8", "--batch-size", "4", "--out", out,
                 "--no-progress"]) == 0
    assert "computed 2 shard(s) (12 rows" in capsys.readouterr().out
    assert read_store(out).num_rows == 12
    assert main(["attribute", "--data", "digits:12", "--shard-rows", "8", "--batch-size", "4", "--out", out,
                 "--method", "rollout", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "other settings" in error and "'generic-attention', this run 'rollout'" in error
    assert main(["attribute", "--data", "digits:12", "--model", str(tmp_path / "absent"), "--out", out]) == 2
    assert "--data digits:N explains the built-in digits model; drop --model" in capsys.readouterr().err
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    assert main(["attribute", "--data", str(tmp_path / "rows.jsonl"), "--model", str(tmp_path / "absent"),
                 "--out", out]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_graphs_store_each_graphs_node_scores_and_metrics_read_them_back(tmp_path):
    pytest.importorskip("torch_geometric")
    from captum_transformers.adapters.graph.nodes import GraphBatch
    from captum_transformers.corpus import evaluate_store, motif_graph_source
    from captum_transformers.evaluation import GraphRelevanceGain
    from captum_transformers.tasks.motifs.model import load_motif_model

    model, source = load_motif_model().eval(), motif_graph_source(20)
    explain_dataset(model, source, "attn-lrp", tmp_path, batch_size=8, shard_rows=8, progress=False)
    table = read_store(tmp_path)
    method, live = build_method("attn-lrp", model), GraphRelevanceGain(model)
    for low in range(0, 20, 8):
        (x, edge_index, batch), _, _ = source.batch(low, min(low + 8, 20))
        target = model(x, edge_index, batch).argmax(-1)
        tokens = method.attribute(x, target=target, return_tokens=True, additional_forward_args=(edge_index, batch))
        nodes = GraphBatch.of(batch, x.shape[0])
        scores = tokens.float()[nodes.graph, nodes.position]
        stored = rows_to_maps(table, range(low, min(low + 8, 20)))
        assert [len(m) for m in stored] == nodes.counts.tolist()
        assert torch.equal(torch.cat(stored), scores)  # PyG's batch is sorted: graph after graph
        live.update(x, edge_index, batch, scores, target)
    assert evaluate_store(tmp_path, source, [GraphRelevanceGain(model)]) == [live.compute()]
    from captum_transformers.cli import main

    assert main(["attribute", "--data", "motifs:20", "--method", "attn-lrp", "--batch-size", "8", "--shard-rows", "8",
                 "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    assert read_store(tmp_path / "cli").column("map").to_pylist() == table.column("map").to_pylist()


def test_image_files_and_encoded_images_are_rows_and_the_modality_is_checked(tmp_path, capsys):
    pil = pytest.importorskip("PIL.Image")
    import io

    from captum_transformers.cli import main
    from captum_transformers.model_loading import load_model

    canvases = digit_canvas_source(6).batch(0, 6)[0][0]
    pixels = ((canvases - canvases.amin()) / (canvases.amax() - canvases.amin()) * 255).byte().permute(0, 2, 3, 1)
    (tmp_path / "images" / "b").mkdir(parents=True)
    encoded = []
    for i, array in enumerate(pixels.numpy()):
        image = pil.fromarray(array)
        image.save(tmp_path / "images" / ("b" if i % 2 else "") / f"{i}.png")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append({"bytes": buffer.getvalue(), "path": f"{i}.png"})
    loaded = load_model(None)
    folder = table_source(tmp_path / "images", loaded.prepare)
    assert folder.rows == 6 and folder.value_kind == "image"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": encoded}), tmp_path / "images.parquet")
    column = table_source(tmp_path / "images.parquet", loaded.prepare, column="image")
    order = [0, 2, 4, 1, 3, 5]  # the folder's rows in path order: 0.png, 2.png, 4.png, b/1.png ...
    assert torch.equal(folder.batch(0, 6)[0][0], column.batch(0, 6)[0][0][order])
    out = str(tmp_path / "store")
    assert main(["attribute", "--data", str(tmp_path / "images.parquet"), "--column", "image", "--out", out,
                 "--batch-size", "6", "--no-progress"]) == 0  # the built-in model on encoded images
    assert "6 rows of 'image'" in capsys.readouterr().out
    explain_dataset(loaded.model, folder, "generic-attention", tmp_path / "folder", batch_size=6, progress=False)
    by_column, by_folder = rows_to_maps(read_store(out)), rows_to_maps(read_store(tmp_path / "folder"))
    for position, row in enumerate(order):
        torch.testing.assert_close(by_folder[position], by_column[row], rtol=1e-5, atol=1e-6)
    (tmp_path / "texts.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    assert main(["attribute", "--data", str(tmp_path / "texts.jsonl"), "--out", out, "--no-progress"]) == 2
    assert "holds texts but built-in DigitCanvas ViT is an image model" in capsys.readouterr().err
    pq.write_table(pa.table({"image": [{"bytes": b"not an image", "path": "x.png"}]}), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"an encoded image of the data \(x.png, 12 bytes\) could not be read"):
        table_source(tmp_path / "bad.parquet", loaded.prepare, column="image").batch(0, 1)


def test_a_run_that_fails_before_its_first_shard_leaves_the_folder_free(digit_model, tmp_path):
    from captum_transformers.corpus import CorpusSource

    good = digit_canvas_source(16)

    def broken(start, stop):
        raise InputError("this source cannot be read")

    with pytest.raises(InputError, match="cannot be read"):
        explain_dataset(digit_model, CorpusSource(16, good.fingerprint, broken), "generic-attention", tmp_path,
                        batch_size=8, shard_rows=8, progress=False)
    assert not (tmp_path / "manifest.json").exists()
    explain_dataset(digit_model, good, "attn-lrp", tmp_path, batch_size=8, shard_rows=8, progress=False)  # not refused

    def late(start, stop):  # the second shard fails: the first is kept, and so is the claim
        if start >= 8:
            raise InputError("this source cannot be read")
        return good.load(start, stop)

    with pytest.raises(InputError, match="cannot be read"):
        explain_dataset(digit_model, CorpusSource(16, good.fingerprint, late), "rollout", tmp_path / "half",
                        batch_size=8, shard_rows=8, progress=False)
    assert (tmp_path / "half" / "manifest.json").exists()
