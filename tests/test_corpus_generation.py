"""The corpus job for language models (captum_transformers.corpus.explain_generations): each row
of the store is GenerationAttribution's result for that prompt alone, resumed runs keep their
shards, other settings are refused; and the tables a job reads or writes in other tools' formats
(a datasets save_to_disk folder in; datasets.load_dataset("parquet") out)."""
import json

import pytest
import torch

pytest.importorskip("pyarrow")

from captum_transformers.corpus import (explain_dataset, explain_generations, prompt_table_source, read_store,
                                        recall_prompt_source, rows_to_maps, table_source, table_values)
from captum_transformers.corpus.store import shard_path
from captum_transformers.errors import InputError
from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.catalog import build_method
from captum_transformers.tasks.recall.model import MAX_NEW_TOKENS, load_recall_model


@pytest.fixture(scope="module")
def recall():
    model, tokenizer = load_recall_model()
    return model.eval(), tokenizer


def _alone(recall, method, prompt, score="logit"):
    model, tokenizer = recall
    return GenerationAttribution(build_method(method, model), tokenizer, score=score).attribute(
        prompt, gen_args={"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False})


@pytest.mark.parametrize("method", ["attn-lrp", "generic-attention"])
def test_each_row_is_the_prompts_own_generation_attribution(recall, tmp_path, method):
    model, tokenizer = recall
    source = recall_prompt_source(10)
    run = explain_generations(model, tokenizer, source, method, tmp_path, max_new_tokens=MAX_NEW_TOKENS,
                              batch_size=4, shard_rows=6, progress=False)
    assert (run.shards_computed, run.rows_computed) == (2, 10)
    table = read_store(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["kind"] == "generation"
    maps = rows_to_maps(table)
    worst = 0.0
    for row, prompt in enumerate(source.prompts(0, 10)):
        alone = _alone(recall, method, prompt)
        assert table.column("prompt")[row].as_py() == prompt
        assert table.column("output_ids")[row].as_py() == alone.output_ids
        assert table.column("input_tokens")[row].as_py() == list(alone.input_tokens)
        assert table.column("target_attr_tokens")[row].as_py() == list(alone.target_attr_tokens)
        token_attr, target_attr = maps[row]
        assert token_attr.shape == alone.token_attr.shape and target_attr.shape == alone.target_attr.shape
        scale = alone.token_attr.abs().max()
        worst = max(worst, float((token_attr - alone.token_attr.float()).abs().max() / scale))
        torch.testing.assert_close(target_attr, alone.target_attr.float(), rtol=1e-4, atol=1e-4 * float(scale))
        torch.testing.assert_close(torch.tensor(table.column("scores")[row].as_py(), dtype=torch.float64), alone.scores.double(),
                                   rtol=1e-5, atol=1e-5)
    assert worst < 1e-4  # batched passes (padding) round differently from one prompt's pass


def test_at_batch_size_one_the_rows_equal_the_single_calls_bit_for_bit(recall, tmp_path):
    model, tokenizer = recall
    source = recall_prompt_source(3, seed=1)
    explain_generations(model, tokenizer, source, "attn-lrp", tmp_path, max_new_tokens=MAX_NEW_TOKENS, batch_size=1,
                        progress=False)
    for row, (token_attr, target_attr) in enumerate(rows_to_maps(read_store(tmp_path))):
        alone = _alone(recall, "attn-lrp", source.prompts(row, row + 1)[0])
        assert torch.equal(token_attr, alone.token_attr.float()) and torch.equal(target_attr, alone.target_attr.float())


def test_a_generation_store_resumes_and_refuses_another_score_or_length(recall, tmp_path):
    model, tokenizer = recall
    source = recall_prompt_source(12)
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, batch_size=4, shard_rows=4, progress=False)
    explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "clean", **kwargs)
    explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "cut", **kwargs)
    shard_path(tmp_path / "cut", 2).write_bytes(b"PAR1 truncated")
    again = explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "cut", **kwargs)
    assert (again.shards_computed, again.shards_skipped, again.recomputed) == (1, 2, 1)
    assert read_store(tmp_path / "cut").equals(read_store(tmp_path / "clean"))
    with pytest.raises(InputError, match=r"other settings.*score: the folder has 'logit', this run 'prob'"):
        explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "cut", **{**kwargs}, score="prob")
    with pytest.raises(InputError, match=r"other settings.*max_new_tokens: the folder has 3, this run 2"):
        explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "cut", **{**kwargs, "max_new_tokens": 2})
    with pytest.raises(InputError, match="integrated-gradients explains the next-token logit only"):
        explain_generations(model, tokenizer, source, "integrated-gradients", tmp_path / "ig", score="prob")
    assert not (tmp_path / "ig").exists()  # refused before the folder was claimed
    with pytest.raises(InputError, match="a PromptSource"):
        explain_generations(model, tokenizer, table_source.__class__, "attn-lrp", tmp_path / "other")


def test_prompts_from_a_table_and_from_the_command_line(recall, tmp_path, capsys):
    from captum_transformers.cli import main

    prompts = recall_prompt_source(5).prompts(0, 5)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    source = prompt_table_source(tmp_path / "prompts.jsonl")
    assert source.prompts(0, 5) == prompts
    assert main(["attribute", "--data", "recall:5", "--method", "attn-lrp", "--batch-size", "2", "--out",
                 str(tmp_path / "cli"), "--no-progress"]) == 0
    assert "5 associative-recall test prompts, attn-lrp; this process computed 1 shard(s) (5 rows" in \
        capsys.readouterr().out
    model, tokenizer = recall
    explain_generations(model, tokenizer, source, "attn-lrp", tmp_path / "api", max_new_tokens=MAX_NEW_TOKENS,
                        batch_size=2, progress=False)
    cli, api = read_store(tmp_path / "cli"), read_store(tmp_path / "api")
    for column in ("output_ids", "token_attr", "target_attr", "scores"):
        assert cli.column(column).to_pylist() == api.column(column).to_pylist()
    assert main(["attribute", "--data", str(tmp_path / "prompts.jsonl"), "--generate", "3", "--out",
                 str(tmp_path / "x")]) == 2
    assert "needs --model, a language model folder" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(InputError, match=r"row 0 of .* is ''; a generation job's prompts are non-empty strings"):
        prompt_table_source(tmp_path / "bad.jsonl")


def test_a_datasets_save_to_disk_folder_is_read_and_the_store_loads_in_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    from captum_transformers.tasks.digits.model import load_digit_model

    texts = [f"row {i} " + "w" * (i % 7) for i in range(23)]
    saved = datasets.Dataset.from_dict({"text": texts, "label": [i % 3 for i in range(23)]})
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # several Arrow files, read in their order
    values, fingerprint, _ = table_values(tmp_path / "saved", "text")
    assert values == texts and fingerprint != table_values(tmp_path / "saved", "label")[1]
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(InputError, match=r"DatasetDict \(splits \['train'\]\); give one split's folder"):
        table_values(tmp_path / "dict", "text")
    saved.shuffle(seed=0).save_to_disk(str(tmp_path / "shuffled"))
    assert table_values(tmp_path / "shuffled", "text")[0] == saved.shuffle(seed=0)["text"]  # saved flattened

    from captum_transformers.corpus import digit_canvas_source

    explain_dataset(load_digit_model(), digit_canvas_source(20), "generic-attention", tmp_path / "store",
                    batch_size=8, shard_rows=8, progress=False)
    loaded = datasets.load_dataset("parquet", data_dir=str(tmp_path / "store" / "shards"), split="train")
    ours = read_store(tmp_path / "store")
    assert sorted(loaded["row_id"]) == list(range(20))
    by_id = dict(zip(loaded["row_id"], loaded["map"]))
    assert [by_id[i] for i in range(20)] == ours.column("map").to_pylist()
