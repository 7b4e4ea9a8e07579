"""Data sources, example encoding and Grain pipelines (order, resumption, errors)."""

import json
import sys
from collections import Counter

import numpy as np
import pytest

from nonstop.models.chat import ChatTemplate
from nonstop.models.tokenizer import Tokenizer
from nonstop.models.validation import ConfigError
from nonstop.sft.data import DataConfig, ExampleEncoder, make_dataset
from nonstop.sft.datasets import JsonlSource, ParquetSource, SourceRecord, open_source
from nonstop.train.packing import PackingConfig
from tests.models.tokenizer_fixtures import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "llama3"))


def _write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _segments(batch):
    """Every packed sequence of a batch as (row, segment id, tokens, loss mask)."""
    for row in range(batch.tokens.shape[0]):
        for segment in range(1, batch.segment_ids[row].max() + 1):
            where = batch.segment_ids[row] == segment
            yield row, segment, batch.tokens[row, where], batch.loss_mask[row, where]


# ------------------------------------------------------------------------------------- sources


def test_jsonl_source_records_and_line_numbers(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\n   \n{"a": 2}\n{"a": 3}')  # blank lines, no final newline
    source = JsonlSource(path)
    assert len(source) == 3
    assert [r.fields["a"] for r in source] == [1, 2, 3]
    assert [r.origin for r in source] == [f"{path}:1", f"{path}:4", f"{path}:5"]
    assert source[-1].fields == {"a": 3}


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n[1, 2]\n')
    source = JsonlSource(path)
    with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON line"):
        source[1]
    with pytest.raises(ValueError, match=rf"{path}:3: each line must be a JSON object, got list"):
        source[2]


def test_source_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: no records"):
        JsonlSource(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        open_source(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"unsupported data file suffix '\.csv'.*\.jsonl"):
        open_source(tmp_path / "data.csv")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'nonstop\[parquet\]'"):
        ParquetSource(path)


def test_parquet_rows_when_pyarrow_is_installed(tmp_path):
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    parquet.write_table(pa.table({"prompt": ["p0", "p1"], "completion": ["c0", "c1"]}), path)
    source = open_source(path)
    assert len(source) == 2
    assert source[1] == SourceRecord({"prompt": "p1", "completion": "c1"}, f"{path}:row 1")


# ------------------------------------------------------------------------------------ encoding


def test_text_example(tokenizer):
    encoder = ExampleEncoder(DataConfig(paths=("x.jsonl",), kind="text"), tokenizer)
    (seq,) = encoder.map(SourceRecord({"text": "The quick brown fox"}, "x.jsonl:1"))
    body = tokenizer.encode("The quick brown fox")
    assert seq.tokens.tolist() == [tokenizer.bos_id, *body, tokenizer.eos_ids[0]]
    assert seq.loss_mask.all()
    assert seq.origin == "x.jsonl:1"


def test_prompt_completion_masks_only_the_completion(tokenizer):
    encoder = ExampleEncoder(DataConfig(paths=("x.jsonl",), kind="prompt_completion"), tokenizer)
    record = SourceRecord({"prompt": "What is 12 + 30?", "completion": " 42"}, "x.jsonl:1")
    (seq,) = encoder.map(record)
    prompt = [tokenizer.bos_id, *tokenizer.encode("What is 12 + 30?")]
    completion = [*tokenizer.encode(" 42"), tokenizer.eos_ids[0]]
    assert seq.tokens.tolist() == prompt + completion
    assert seq.loss_mask.tolist() == [False] * len(prompt) + [True] * len(completion)


def test_preference_example_shares_the_prompt(tokenizer):
    config = DataConfig(
        paths=("x.jsonl",), kind="preference", chosen_field="good", rejected_field="bad"
    )
    record = SourceRecord({"prompt": "2 + 3 =", "good": " 5", "bad": " 6 or so"}, "x.jsonl:7")
    chosen, rejected = ExampleEncoder(config, tokenizer).map(record)
    prompt = [tokenizer.bos_id, *tokenizer.encode("2 + 3 =")]
    assert (
        chosen.tokens[: len(prompt)].tolist() == prompt == rejected.tokens[: len(prompt)].tolist()
    )
    assert chosen.tokens[len(prompt) :].tolist() == [*tokenizer.encode(" 5"), tokenizer.eos_ids[0]]
    assert not rejected.loss_mask[: len(prompt)].any() and rejected.loss_mask[len(prompt) :].all()


def test_missing_or_mistyped_field_names_record_and_choices(tokenizer):
    encoder = ExampleEncoder(DataConfig(paths=("x.jsonl",), kind="prompt_completion"), tokenizer)
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl:4: missing field 'completion' for kind 'prompt_completion'; the record "
        r"has \['answer', 'prompt'\] \(set DataConfig\.completion_field",
    ):
        encoder.map(SourceRecord({"prompt": "a", "answer": "b"}, "d.jsonl:4"))
    with pytest.raises(
        TypeError,
        match=r"d\.jsonl:5: field 'prompt' must be a string or a list of messages, got int",
    ):
        encoder.map(SourceRecord({"prompt": 3, "completion": "b"}, "d.jsonl:5"))


def test_data_config_errors():
    with pytest.raises(ConfigError, match=r"^DataConfig\.kind='dpo' is invalid; expected one of "
                                          r".*'chat'"):
        DataConfig(paths=("x.jsonl",), kind="dpo")
    with pytest.raises(ConfigError, match=r"^DataConfig\.packing\.max_segments_per_row=5 is "
                                          r"invalid; expected an even number"):
        DataConfig(
            paths=("x.jsonl",), kind="preference", packing=PackingConfig(max_segments_per_row=5)
        )
    with pytest.raises(ConfigError, match=r"^DataConfig\.num_epochs=0 is invalid; expected None "
                                          r".* or an int >= 1"):
        DataConfig(paths=("x.jsonl",), num_epochs=0)
    with pytest.raises(ConfigError, match=r"^DataConfig\.paths=\(\) is invalid; expected at "
                                          r"least one"):
        DataConfig(paths=())


# ----------------------------------------------------------------------------------- pipelines

TEXTS = [f"The answer is {i}." + " Think step by step." * (i % 4) for i in range(29)]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return _write_jsonl(
        tmp_path_factory.mktemp("data") / "texts.jsonl", [{"text": t} for t in TEXTS]
    )


def _text_config(path, **overrides) -> DataConfig:
    packing = PackingConfig(buckets=(23, 47), rows_per_batch=3)
    return DataConfig(paths=(path,), kind="text", packing=packing, **overrides)


def test_every_example_once_per_epoch(tokenizer, text_file):
    batches = list(make_dataset(_text_config(text_file, num_epochs=2, seed=3), tokenizer))
    seen = Counter()
    for packed in batches:
        assert packed.batch.tokens.shape[0] == 3 and packed.batch.tokens.shape[1] in (23, 47)
        for _, _, tokens, _ in _segments(packed.batch):
            # Strip BOS and EOS, then the text must decode back to one of the inputs, whole.
            seen[tokenizer.decode(tokens[1:-1].tolist())] += 1
    assert seen == Counter({t: 2 for t in TEXTS})
    assert sum(p.stats.units for p in batches) == 2 * len(TEXTS)


def test_shuffle_is_seeded(tokenizer, text_file):
    def first_tokens(seed):
        packed = next(iter(make_dataset(_text_config(text_file, seed=seed), tokenizer)))
        return packed.batch.tokens.tolist()

    assert first_tokens(5) == first_tokens(5)
    assert first_tokens(5) != first_tokens(6)


@pytest.mark.parametrize("consumed", [0, 1, 4])
def test_iterator_state_restores_the_same_batches(tokenizer, text_file, consumed):
    dataset = make_dataset(_text_config(text_file, num_epochs=3, seed=11), tokenizer)
    iterator = iter(dataset)
    for _ in range(consumed):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(6)]
    resumed = iter(dataset)
    resumed.set_state(json.loads(json.dumps(state)))  # the state survives serialisation
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got.batch.tokens, want.batch.tokens)
        np.testing.assert_array_equal(got.batch.segment_ids, want.batch.segment_ids)
        assert got.stats == want.stats


def test_preference_pipeline_keeps_pairs_adjacent(tokenizer, tmp_path):
    rows = [{"prompt": f"Q{i}:", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(11)]
    path = _write_jsonl(tmp_path / "prefs.jsonl", rows)
    packing = PackingConfig(buckets=(31, 61), rows_per_batch=2, max_segments_per_row=6)
    config = DataConfig(paths=(path,), kind="preference", packing=packing, seed=1)
    pairs = 0
    for packed in make_dataset(config, tokenizer):
        segments = {(row, seg): tokens for row, seg, tokens, _ in _segments(packed.batch)}
        for (row, seg), chosen in segments.items():
            if seg % 2 == 0:
                continue
            rejected = segments[(row, seg + 1)]  # the rejected side follows in the same row
            chosen_text = tokenizer.decode(chosen[1:-1].tolist())
            rejected_text = tokenizer.decode(rejected[1:-1].tolist())
            prompt, answer = chosen_text.split(":")
            assert answer == f" yes {prompt[1:]}" and rejected_text == f"{prompt}: no {prompt[1:]}"
            pairs += 1
        assert packed.batch.segment_ids.max() <= 6
    assert pairs == 11


def test_pipeline_errors_name_file_and_line(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [{"text": "fine"}, '{"text": "cut', {"t": 1}])
    config = DataConfig(paths=(path,), kind="text", shuffle=False)
    with pytest.raises(ValueError, match=rf"{path}:2: malformed JSON line"):
        list(make_dataset(config, tokenizer))
    path = _write_jsonl(tmp_path / "other.jsonl", [{"text": "fine"}, {"body": "no text"}])
    config = DataConfig(paths=(path,), kind="text", shuffle=False)
    with pytest.raises(ValueError, match=rf"{path}:2: missing field 'text'.*\['body'\]"):
        list(make_dataset(config, tokenizer))


def test_overlong_examples_error_or_are_counted(tokenizer, tmp_path):
    long_text = "The quick brown fox jumps over the lazy dog. " * 6
    path = _write_jsonl(tmp_path / "long.jsonl", [{"text": "short"}, {"text": long_text}])
    strict = PackingConfig(buckets=(13, 17), rows_per_batch=2)
    config = DataConfig(paths=(path,), kind="text", shuffle=False, packing=strict)
    with pytest.raises(ValueError, match=rf"{path}:2: example of \d+ tokens .* longest bucket 17"):
        list(make_dataset(config, tokenizer))
    lenient = PackingConfig(buckets=(13, 17), rows_per_batch=2, overlong="truncate")
    config = DataConfig(paths=(path,), kind="text", shuffle=False, packing=lenient)
    batches = list(make_dataset(config, tokenizer))
    total_length = 2 + len(tokenizer.encode(long_text))  # BOS + text + EOS
    assert sum(b.stats.truncated_units for b in batches) == 1
    assert sum(b.stats.truncated_tokens for b in batches) == total_length - 17


# ---------------------------------------------------------------------------------------- chat

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "Think step by step."},
]


def _trained_text(tokenizer, seq) -> str:
    return tokenizer.decode(seq.tokens[seq.loss_mask].tolist())


def test_chat_example_trains_only_assistant_tokens(tokenizer):
    encoder = ExampleEncoder(DataConfig(paths=("c.jsonl",), kind="chat"), tokenizer)
    (seq,) = encoder.map(SourceRecord({"messages": CHAT}, "c.jsonl:1"))
    # Reference: the whole chat rendered by the template and tokenized in one go (this Llama 3
    # style tokenizer never merges across turn boundaries, so the tokens must agree).
    rendered = ChatTemplate.from_tokenizer(tokenizer).render(CHAT)
    assert seq.tokens.tolist() == tokenizer.encode(rendered)
    # Targets: each assistant content and the end-of-turn token that closes it, nothing else.
    assert (
        _trained_text(tokenizer, seq) == "The answer is 42.<|eot_id|>Think step by step.<|eot_id|>"
    )


def test_conversational_preference_masks_prompt_assistant_turns(tokenizer):
    config = DataConfig(paths=("c.jsonl",), kind="preference")
    record = SourceRecord(
        {
            "prompt": CHAT[:4],  # holds an assistant turn that must not be trained
            "chosen": [{"role": "assistant", "content": "The answer is 5."}],
            "rejected": [{"role": "assistant", "content": "Thank you!"}],
        },
        "c.jsonl:2",
    )
    chosen, rejected = ExampleEncoder(config, tokenizer).map(record)
    assert _trained_text(tokenizer, chosen) == "The answer is 5.<|eot_id|>"
    assert _trained_text(tokenizer, rejected) == "Thank you!<|eot_id|>"
    shared = np.flatnonzero(chosen.loss_mask)[0]
    assert chosen.tokens[:shared].tolist() == rejected.tokens[:shared].tolist()


def test_chat_errors_name_the_record(tokenizer):
    encoder = ExampleEncoder(DataConfig(paths=("c.jsonl",), kind="chat"), tokenizer)
    with pytest.raises(ValueError, match=r"c\.jsonl:3: cannot build the conversation: .*role"):
        encoder.map(SourceRecord({"messages": [{"role": "narrator", "content": "x"}]}, "c.jsonl:3"))
    with pytest.raises(ValueError, match=r"c\.jsonl:4: the conversation has no assistant tokens"):
        encoder.map(SourceRecord({"messages": CHAT[:2]}, "c.jsonl:4"))
    with pytest.raises(
        TypeError, match=r"c\.jsonl:5: field 'messages' must be a list of messages, got str"
    ):
        encoder.map(SourceRecord({"messages": "hi"}, "c.jsonl:5"))
    config = DataConfig(paths=("c.jsonl",), kind="prompt_completion")
    with pytest.raises(TypeError, match=r"c\.jsonl:6: prompt and responses must all be strings"):
        ExampleEncoder(config, tokenizer).map(
            SourceRecord({"prompt": CHAT[:2], "completion": "text"}, "c.jsonl:6")
        )


def test_chat_pipeline(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 3)
    packing = PackingConfig(buckets=(67, 131), rows_per_batch=2)
    config = DataConfig(paths=(path,), kind="chat", packing=packing)
    batches = list(make_dataset(config, tokenizer))
    assert sum(b.stats.units for b in batches) == 3
    for packed in batches:
        for _, _, tokens, mask in _segments(packed.batch):
            assert tokenizer.decode(tokens[mask].tolist()).count("<|eot_id|>") == 2
