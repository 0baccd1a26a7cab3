"""The built-in recall Llama: the task's splits and evidence, the tokenizer, the shipped weights' accuracy."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from captum_transformers.errors import InputError
from captum_transformers.tasks.recall import model as recall_model, train as train_recall
from captum_transformers.tasks.recall.model import (build_recall_model, load_recall_model, recall_model_record,
                                                    recall_tokenizer, save_recall_pretrained)
from captum_transformers.tasks.recall.task import (QUERY_MARK, VALUE_WORDS, make_example,
                                                   recall_examples, split_of, vocabulary)

# Accuracy on 200 prompts (400 value words) scatters around the recorded value (2000 prompts):
# a binomial standard error below 0.01 at 0.98, so 0.03 is > 3 standard errors.
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(1)
    return load_recall_model()


def test_splits_are_deterministic_and_disjoint():
    test = recall_examples(300, seed=0, split="test")
    assert [e.prompt for e in test] == [e.prompt for e in recall_examples(300, seed=0, split="test")]
    assert [e.prompt for e in test] != [e.prompt for e in recall_examples(300, seed=1, split="test")]
    train = {e.prompt for seed in range(3) for e in recall_examples(1000, seed=seed, split="train")}
    val = {e.prompt for e in recall_examples(300, seed=0, split="val")}
    assert not train & {e.prompt for e in test} and not train & val and not val & {e.prompt for e in test}
    assert all(split_of(e.prompt) == "test" for e in test)


def test_examples_follow_the_specification():
    for example in recall_examples(200, seed=2, split="train"):
        assert 4 <= len(example.pairs) <= 8 and example.query in dict(example.pairs)
        words = [word for _, value in example.pairs for word in value]
        assert len(set(words)) == len(words) and len({key for key, _ in example.pairs}) == len(example.pairs)
        assert all(set(value) <= set(VALUE_WORDS) and len(value) == 2 for _, value in example.pairs)
        assert example.prompt.endswith(f"{QUERY_MARK} {example.query}")
        assert example.answer == " ".join(dict(example.pairs)[example.query])
        assert example.answer_ids[-1] == vocabulary()["<eos>"] and len(example.evidence) == len(example.answer_ids) - 1


def test_every_answer_word_is_a_copy_of_the_prompt_word_after_the_same_context():
    """Induction: the token the answer continues appeared in the prompt, followed by the answer word."""
    for example in recall_examples(200, seed=6, split="train"):
        sequence = example.prompt_ids + example.answer_ids
        start = len(example.prompt_ids)
        for step, evidence in enumerate(example.evidence):
            context = sequence[start + step - 1:start + step]
            assert example.prompt_ids[evidence.value - 1:evidence.value] == context


def test_evidence_points_at_value_key_and_query_tokens():
    token = {index: text for text, index in vocabulary().items()}
    for example in recall_examples(200, seed=3, split="test"):
        ids = example.prompt_ids
        assert [e.value for e in example.evidence] == [example.evidence[0].value + i for i in range(2)]
        for step, (answer_id, evidence) in enumerate(zip(example.answer_ids, example.evidence)):
            assert ids[evidence.value] == answer_id  # primary evidence: the answer token itself
            assert ids.count(answer_id) == 1  # value words are distinct, so no other position holds it
            assert token[ids[evidence.key]] == example.query and token[ids[evidence.query]] == example.query
            assert evidence.key + 1 + step == evidence.value and evidence.positions[0] == evidence.value
            assert evidence.query == len(ids) - 1


def test_make_example_refuses_duplicates_unknown_words_and_unknown_queries():
    with pytest.raises(InputError, match="distinct keys"):
        make_example([("a", ("red", "fox")), ("a", ("blue", "owl"))], "a")
    with pytest.raises(InputError, match="distinct keys and distinct value words"):
        make_example([("a", ("red", "fox")), ("b", ("red", "owl"))], "a")
    with pytest.raises(InputError, match="unknown"):
        make_example([("a", ("red", "unicorn")), ("b", ("blue", "owl"))], "a")
    with pytest.raises(InputError, match="query"):
        make_example([("a", ("red", "fox")), ("b", ("blue", "owl"))], "c")
    with pytest.raises(InputError, match="split"):
        recall_examples(1, split="dev")


def test_tokenizer_is_a_left_padding_fast_tokenizer_with_bos():
    tokenizer = recall_tokenizer()
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast) and tokenizer.padding_side == "left"
    examples = recall_examples(3, seed=4)
    for example in examples:
        assert tokenizer(example.prompt)["input_ids"] == example.prompt_ids
        assert tokenizer.decode(example.answer_ids, skip_special_tokens=True) == example.answer
    batch = tokenizer([e.prompt for e in examples], padding=True, return_tensors="pt")
    lengths = [len(e.prompt_ids) for e in examples]
    assert batch["attention_mask"].sum(-1).tolist() == lengths
    queries = torch.tensor([vocabulary()[e.query] for e in examples])
    assert (batch["input_ids"][:, -1] == queries).all()  # left padded: prompts end together


def test_chat_template_renders_the_prompt():
    tokenizer = recall_tokenizer()
    example = recall_examples(1, seed=5)[0]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert list(ids) == example.prompt_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt},
                                          {"role": "assistant", "content": example.answer}], tokenize=False)
    assert text == f"<bos>{example.prompt} {example.answer} <eos>"


def test_build_gives_a_small_gqa_llama_with_greedy_generation_config():
    model = build_recall_model()
    assert isinstance(model, transformers.LlamaForCausalLM)
    config = model.config
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2 and config.num_hidden_layers >= 2
    assert config.vocab_size == len(vocabulary())
    generation = model.generation_config
    assert generation.eos_token_id == vocabulary()["<eos>"] and generation.pad_token_id == vocabulary()["<pad>"]
    assert generation.do_sample is False and generation.num_beams == 1


def test_shipped_weights_are_small_float16_and_load_in_eval_float32(shipped):
    model, _ = shipped
    with __import__("importlib").resources.as_file(recall_model.weights_path()) as path:
        assert path.stat().st_size < 1_000_000
        state = torch.load(path, weights_only=True)
    assert all(tensor.dtype == torch.float16 for tensor in state.values())
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"].float())


def test_shipped_model_answers_the_test_prompts_by_greedy_generate(shipped):
    model, tokenizer = shipped
    scores = train_recall.generation_accuracy(model, tokenizer, recall_examples(200, seed=7, split="test"))
    record = recall_model_record()
    assert scores["tokens"] >= 0.95
    assert scores["tokens"] >= record["test_token_accuracy"] - TOLERANCE
    assert scores["exact_answer"] >= record["test_exact_answer_accuracy"] - 2 * TOLERANCE


def test_record_holds_accuracy_seed_time_and_command():
    record = recall_model_record()
    assert record["command"].startswith("python -m captum_transformers.tasks.recall.train")
    assert record["test_token_accuracy"] >= 0.95 and 0.0 <= record["test_exact_answer_accuracy"] <= 1.0
    assert isinstance(record["seed"], int) and record["train_seconds"] > 0 and record["steps"] > 0


def test_save_pretrained_round_trips_through_auto_classes(shipped, tmp_path):
    model, tokenizer = shipped
    folder = save_recall_pretrained(tmp_path / "recall")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = [e.prompt for e in recall_examples(4, seed=8)]
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    assert torch.equal(loaded_tokenizer(prompts, padding=True, return_tensors="pt")["input_ids"], batch["input_ids"])
    assert loaded_tokenizer.padding_side == "left" and loaded_tokenizer.chat_template == tokenizer.chat_template
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    assert loaded.generation_config.eos_token_id == model.generation_config.eos_token_id


def test_missing_weights_raise_input_error_naming_the_retrain_command(monkeypatch):
    monkeypatch.setattr(recall_model, "WEIGHTS_FILE", "no_such_recall.pt")
    with pytest.raises(InputError, match="no_such_recall.pt") as error:
        load_recall_model()
    assert "python -m captum_transformers.tasks.recall.train" in str(error.value)


def test_a_few_training_steps_lower_the_answer_loss():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_recall_model()
    batch = train_recall.collate(recall_examples(32, seed=9, split="train"), pad_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(**batch).loss.item()
    for _ in range(30):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model(**batch).loss.item() < 0.7 * first
