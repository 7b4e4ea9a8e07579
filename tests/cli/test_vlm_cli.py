"""`nonstop vlm`: a two-step LoRA SFT smoke run of the shipped Gemma 3 config on a tiny random
vision-language checkpoint (the architecture of tests/models/vlm_fixtures.py, with a vocabulary
that holds the tiny Gemma tokenizer), which then resumes from its last checkpoint and refuses other
data in the same run directory; and bad input that stops the run with exit status 2 and a message
naming the key, or the file and line — never a traceback. (Crash and resume: tests/sft/
test_vision_resume.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from nonstop import perf
from nonstop.cli.main import main
from nonstop.models import Tokenizer
from nonstop.models.image_processor import ImageProcessor
from nonstop.perf import read_events
from nonstop.train.metrics import read_jsonl
from tests.models.tokenizer_fixtures import build_tiny_tokenizer
from tests.models.vlm_fixtures import IMAGE_SIZE, TOKENS_PER_IMAGE, hf_vlm_config

CONFIG = Path(__file__).parents[2] / "nonstop" / "recipes" / "configs" / "vlm_sft_gemma3_4b.yaml"
COLOURS = {"R": (220, 30, 30), "G": (30, 200, 40), "B": (30, 50, 230), "Y": (230, 220, 30)}
# The tiny Gemma tokenizer has 384 ids (<pad> 0, <eos> 1, <bos> 2); the image ids follow them.
VOCAB, BOI, IMAGE, EOI = 389, 384, 385, 386
TINY = ["steps=2", "batch_size=2", "seq_len=24", "max_images=2", "dtype=float32",
        "lora.rank=4", "optimizer.warmup_steps=0", "optimizer.learning_rate=1e-2",
        "metrics.progress_bar=false"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp("tiny_gemma3_vlm"))


def write_tiny_vlm(directory: Path) -> Path:
    """A random Gemma3ForConditionalGeneration with its tokenizer and preprocessor config."""
    base = hf_vlm_config()
    text = {**base.text_config.to_dict(), "vocab_size": VOCAB, "bos_token_id": 2,
            "eos_token_id": 1, "pad_token_id": 0}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=base.vision_config.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE, boi_token_index=BOI,
        eoi_token_index=EOI)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    # transformers initialises the image projection to zero, which would cut the vision tower
    # off from the loss (no gradient reaches its adapters); a trained checkpoint's is not zero.
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
    model.save_pretrained(directory)
    build_tiny_tokenizer(directory, "gemma")
    (directory / "preprocessor_config.json").write_text(
        json.dumps(ImageProcessor(height=IMAGE_SIZE, width=IMAGE_SIZE).to_dict()))
    return directory


def write_squares(directory: Path, n: int, *, missing_at: int | None = None) -> Path:
    """n examples "colour?<image>" -> colour letter, each a square PNG on grey; the image of
    example `missing_at` (1-based line) is named but never written."""
    rng = np.random.RandomState(0)
    lines = []
    for i in range(n):
        colour = list(COLOURS)[i % 4]
        name = f"square{i}.png"
        if i + 1 != missing_at:
            image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (128, 128, 128))
            size = int(rng.randint(10, 20))
            x, y = (int(v) for v in rng.randint(0, IMAGE_SIZE - size, 2))
            image.paste(COLOURS[colour], (x, y, x + size, y + size))
            image.save(directory / name)
        lines.append(json.dumps({"prompt": "colour?<start_of_image>", "completion": colour,
                                 "images": [name]}))
    path = directory / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_vlm(checkpoint: Path, data: Path, run_dir: Path, *overrides: str) -> int:
    return main(["vlm", "--config", str(CONFIG), f"model_path={checkpoint}",
                 f"data_path={data}", f"run_dir={run_dir}", *TINY, *overrides])


def test_vlm_sft_smoke_run_exports_a_checkpoint(checkpoint, tmp_path, capsys):
    data = write_squares(tmp_path, 4)
    # A chat record too, rendered with the checkpoint tokenizer's chat template.
    chat = {"messages": [{"role": "user", "content": [{"type": "image", "path": "square0.png"},
                                                      {"type": "text", "text": "colour?"}]},
                         {"role": "assistant", "content": "R"}]}
    data.write_text(data.read_text() + json.dumps(chat) + "\n")
    assert run_vlm(checkpoint, data, tmp_path / "run", "seq_len=48") == 0
    run = tmp_path / "run"
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert all(r["images"] == 2 and r["loss_tokens"] >= 2 for r in records)
    assert list((run / "tensorboard").iterdir())
    assert (run / "trace.json").exists()
    events = read_events(str(run)).events
    steps = [e.tags["step"] for e in events if e.ph == "X" and e.name == perf.TRAIN_STEP]
    assert steps == [1, 2]
    busy = [e for e in events if e.ph == "X" and e.name == perf.TRAINER_BUSY]
    assert len(busy) == 2
    counted = sum(e.value for e in events if e.ph == "C" and e.name == perf.TRAIN_TOKENS)
    assert counted == sum(r["tokens"] for r in records) > 0
    assert "model_path: " + str(checkpoint) in (run / "config.yaml").read_text()
    assert f"exported to {run / 'export'}" in capsys.readouterr().out

    export = run / "export"
    trained = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        export, dtype=torch.float32)
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32)
    trained_weights, base_weights = trained.state_dict(), base.state_dict()
    assert trained_weights.keys() == base_weights.keys()
    changed = {name for name, w in trained_weights.items()
               if not torch.equal(w, base_weights[name])}
    # The shipped config adapts all seven projections of the language model and the vision
    # attention (vision_lora: true); nothing else may move.
    assert changed and all(
        any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj",
                                "gate_proj", "up_proj", "down_proj")) for name in changed)
    assert any("vision_tower" in name for name in changed)
    assert any("language_model" in name for name in changed)
    assert Tokenizer.from_pretrained(export).vocab_size == 384
    assert ImageProcessor.from_pretrained(export) == ImageProcessor(height=IMAGE_SIZE,
                                                                    width=IMAGE_SIZE)

    # Checkpointed after the last step: the same command again resumes there and only exports.
    assert (run / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists()
    # examples.jsonl: each step's data lines, in the order RandomState(seed=0) shuffles them.
    drawn = (np.random.RandomState(0).permutation(5) + 1).tolist()
    assert [r["lines"] for r in read_jsonl(run / "examples.jsonl")] == [drawn[:2], drawn[2:4]]
    assert run_vlm(checkpoint, data, run, "seq_len=48") == 0
    assert "0 steps (resumed after step 2)" in capsys.readouterr().out
    # Other data in that run directory is refused, naming data_path.
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    assert run_vlm(checkpoint, data, run, "seq_len=48") == 2
    err = capsys.readouterr().err
    assert f"data_path={str(data)!r} is not the data the checkpoint of step 2 in " in err, err
    assert "start a new run_dir" in err


def test_vlm_dpo_smoke_run_starts_at_log_2(checkpoint, tmp_path):
    write_squares(tmp_path, 2)
    pairs = [{"prompt": "colour?<start_of_image>", "chosen": c, "rejected": r,
              "images": [f"square{i}.png"]} for i, (c, r) in enumerate([("R", "G"), ("G", "B")])]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    # A row holds both segments (2 x 18 tokens) and a copy of the image for each.
    assert run_vlm(checkpoint, data, tmp_path / "run", "kind=dpo", "seq_len=40",
                   "max_images=4", "export=false") == 0
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["pairs"] == 2 and r["images"] == 4 for r in records)
    # The LoRA adapters start at zero, so policy == reference: -log sigmoid(0) = log 2.
    assert records[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6)
    assert records[0]["margins"] == pytest.approx(0.0, abs=1e-6)
    assert not (tmp_path / "run" / "export").exists()


def test_missing_image_names_the_file_and_line(checkpoint, tmp_path, capsys):
    data = write_squares(tmp_path, 3, missing_at=2)
    assert run_vlm(checkpoint, data, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.startswith("nonstop vlm: error: ") and "Traceback" not in err
    assert f"{data}:2: image file" in err and "square1.png' does not exist" in err, err
    assert not (tmp_path / "run" / "export").exists()


def test_example_that_does_not_fit_names_the_file_and_line(checkpoint, tmp_path, capsys):
    data = write_squares(tmp_path, 2)
    # 18 tokens = "colour?\n\n" (9), <boi> 4 x <image> <eoi> (6), "\n\n" (2), the answer (1).
    assert run_vlm(checkpoint, data, tmp_path / "run", "seq_len=17") == 2
    err = capsys.readouterr().err
    assert (f"{data}:1: the example has 18 tokens (image tokens included), more than "
            "seq_len=17") in err and "Traceback" not in err, err
    two = {"prompt": "<start_of_image><start_of_image>?", "completion": "R",
           "images": ["square0.png", "square1.png"]}
    data.write_text(data.read_text() + json.dumps(two) + "\n")
    assert run_vlm(checkpoint, data, tmp_path / "run", "max_images=1", "seq_len=64") == 2
    err = capsys.readouterr().err
    assert f"{data}:3: the example has 2 images" in err and "max_images=1" in err, err


@pytest.mark.parametrize("override, message", [
    ("optimizer.learning_rat=1e-4", "unknown config key 'optimizer.learning_rat'"),
    ("kind=ppo", "kind='ppo' is invalid; expected one of 'sft', 'dpo'"),
    ("seq_len=0", "seq_len=0 is invalid; expected an int >= 1"),
    ("model_path=/no/such/ckpt", "model_path='/no/such/ckpt': not a directory"),
    ("data_path=/no/such.jsonl", "data_path='/no/such.jsonl': no such file"),
    ("tokenizer_path=/no/such/tok", "tokenizer directory /no/such/tok does not exist"),
])
def test_bad_config_names_the_key(checkpoint, tmp_path, capsys, override, message):
    data = write_squares(tmp_path, 1)
    assert run_vlm(checkpoint, data, tmp_path / "run", override) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("nonstop vlm: error: "), err


def test_config_without_model_path_is_an_error(capsys):
    assert main(["vlm"]) == 2
    assert "missing config key 'model_path' of VisionTrainConfig" in capsys.readouterr().err
