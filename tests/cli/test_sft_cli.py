"""`nonstop sft · dpo · orpo`: smoke runs of a couple of steps, and bad input that stops the run
with a message naming the key, or the file and line — never a traceback from deep in JAX."""

from __future__ import annotations

import json
import os

import pytest

from nonstop.cli.main import main
from nonstop.train.metrics import read_jsonl

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "nonstop", "recipes", "configs")
TINY = ["model.hidden_size=44", "model.intermediate_size=53", "model.head_dim=8",
        "metrics.progress_bar=false", "metrics.tensorboard=false", "optimizer.warmup_steps=0",
        "steps=2", "checkpoint.save_every=100"]
CHAT = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}
PAIR = {"prompt": "abc", "chosen": "cba", "rejected": "abc"}


def run_cli(command: str, config: str, run_dir, *overrides: str) -> int:
    return main([command, "--config", os.path.join(CONFIGS, config), f"run_dir={run_dir}",
                 *TINY, *overrides])


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def own_data(path: str, kind: str) -> list[str]:
    return ["builtin_data=null", f"data.paths=[{path}]", f"data.kind={kind}",
            "data.num_epochs=null", "data.read_threads=0"]


def test_dpo_smoke_with_lora_and_precomputed_reference(tmp_path, capsys):
    assert run_cli("dpo", "dpo_tiny.yaml", tmp_path, "builtin_data.num_train=40",
                   "lora.rank=4", "dpo.loss_type=ipo") == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for name in ("rewards_chosen", "rewards_rejected", "margins", "accuracy", "pairs", "loss"):
        assert name in records[-1]
    assert records[0]["margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert os.path.exists(tmp_path / "reference_logprobs.npz")
    assert os.path.exists(tmp_path / "export" / "model.safetensors")
    assert "nonstop dpo: " in capsys.readouterr().out


def test_orpo_smoke_counts_truncated_examples(tmp_path):
    long_pair = {"prompt": "x" * 150, "chosen": "a", "rejected": "b"}
    data = write_jsonl(tmp_path / "pairs.jsonl", [PAIR, long_pair] * 6)
    assert run_cli("orpo", "orpo_tiny.yaml", tmp_path / "run", *own_data(data, "preference"),
                   "packing.overlong=truncate", "tokenizer.chat_format=llama3") == 0
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert sum(r["truncated_tokens"] for r in records) > 0
    for name in ("nll", "odds_ratio_loss", "log_odds_ratio", "loss_tokens"):
        assert name in records[-1]


@pytest.mark.parametrize("case", ["malformed", "missing_field", "overlong", "wrong_type"])
def test_bad_data_names_the_file_and_line(tmp_path, capsys, case):
    rows = {
        "malformed": [CHAT, '{"messages": [', CHAT],
        "missing_field": [CHAT, CHAT, {"conversation": []}],
        "overlong": [CHAT, {"messages": [{"role": "user", "content": "y" * 200},
                                          {"role": "assistant", "content": "z"}]}],
        "wrong_type": [CHAT, {"messages": "hello"}],
    }[case]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    overrides = [*own_data(data, "chat"), "data.shuffle=false"]
    assert run_cli("sft", "sft_tiny.yaml", tmp_path / "run", *overrides) == 2
    err = capsys.readouterr().err
    line = {"malformed": 2, "missing_field": 3, "overlong": 2, "wrong_type": 2}[case]
    assert f"{data}:{line}" in err, err
    assert {
        "malformed": "malformed JSON line",
        "missing_field": "missing field 'messages' for kind 'chat'; the record has ['conversation']",
        "overlong": "exceeds the longest bucket 128",
        "wrong_type": "field 'messages' must be a list of messages, got str",
    }[case] in err
    assert "Traceback" not in err and err.startswith("nonstop sft: error: ")


@pytest.mark.parametrize("override, message", [
    ("optimizer.learning_rat=1e-4", "unknown config key 'optimizer.learning_rat'"),
    ("dtype=float16", "dtype='float16' is invalid; expected one of 'float32', 'bfloat16'"),
    ("dpo.loss_type=kto", "dpo.loss_type='kto' is invalid; expected one of 'sigmoid', 'ipo'"),
    ("algorithm=dpo", "algorithm='dpo' conflicts with the subcommand 'nonstop sft'"),
    ("packing.buckets=[256, 128]", "expected strictly increasing lengths, e.g. [128, 256]"),
    ("model.path=/no/such/ckpt", "/no/such/ckpt: not a directory"),
])
def test_bad_config_names_the_key_and_valid_values(tmp_path, capsys, override, message):
    assert run_cli("sft", "sft_tiny.yaml", tmp_path, override) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "unknown config key" in message:
        assert "valid keys under optimizer: ['b1', 'b2', 'eps', 'learning_rate'" in err
