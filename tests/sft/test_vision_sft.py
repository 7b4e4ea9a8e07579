"""Vision-language SFT: LoRA on a tiny Gemma 3 VLM learns the colour of a generated square.

Four colours (chance = 25%). Images are 28x28 PNG files written by PIL: a square of random size
and place on a grey background. The model is random (no pretrained knowledge); LoRA adapters on
the language model and the vision tower (plus nothing else) are trained on JSONL examples read
through `read_vision_sft`, and held-out accuracy (argmax over the four answers' log-likelihood)
must rise above 60%. Bad input is checked to fail with an error naming the example.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from PIL import Image

from nonstop.models import ChatTemplate, ModelConfig, Tokenizer, save_pretrained
from nonstop.models.image_processor import ImageProcessor
from nonstop.models.lora import LoRAConfig, apply_lora
from nonstop.models.multimodal import VLMConfig, init_vlm
from nonstop.models.vision import VisionConfig, apply_vision_lora
from nonstop.sft.losses import DPOConfig
from nonstop.sft.vision_data import (
    VisionDataError,
    make_vision_batch,
    read_vision_sft,
    vision_sft_loss,
)
from nonstop.sft.vision_preference import read_vision_preference, vision_dpo_loss_fn
from nonstop.sft.vision_trainer import VisionTrainConfig, train_vision
from nonstop.train.metrics import MetricsConfig, read_jsonl
from nonstop.train.optim import OptimizerConfig
from nonstop.train.state import TrainState
from nonstop.train.step import make_train_step
from tests.models.tokenizer_fixtures import build_tiny_tokenizer

# Answers are single tokens of the tiny tokenizer, so scoring has no length bias.
COLOURS = {"R": (220, 30, 30), "G": (30, 200, 40), "B": (30, 50, 230), "Y": (230, 220, 30)}
SEQ_LEN = 24


def _cfg() -> VLMConfig:
    # Window 13: the answer must see the image past the "\n\n" that follows it.
    text = ModelConfig.tiny("gemma3", vocab_size=389, num_layers=2, sliding_window=13)
    vision = VisionConfig(hidden_size=22, intermediate_size=37, num_layers=1, num_heads=2,
                          image_size=28, patch_size=7)
    return VLMConfig(text=text, vision=vision, mm_tokens_per_image=4, image_token_id=385,
                     boi_token_id=384, eoi_token_id=386)


def _write_split(directory, name, n, seed):
    rng = np.random.RandomState(seed)
    lines = []
    for i in range(n):
        colour = list(COLOURS)[i % 4]
        img = Image.new("RGB", (28, 28), (128, 128, 128))
        size = rng.randint(10, 20)
        x, y = rng.randint(0, 28 - size, 2)
        img.paste(COLOURS[colour], (int(x), int(y), int(x) + size, int(y) + size))
        img.save(directory / f"{name}{i}.png")
        lines.append(json.dumps({"prompt": "colour?<start_of_image>", "completion": colour,
                                 "images": [f"{name}{i}.png"]}))
    (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return directory / f"{name}.jsonl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("squares")
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(directory / "tok", "gemma"))
    processor = ImageProcessor(height=28, width=28)
    cfg = _cfg()
    train = read_vision_sft(_write_split(directory, "train", 64, 0), tokenizer, processor, cfg)
    held_out = read_vision_sft(_write_split(directory, "test", 32, 1), tokenizer, processor, cfg)
    return directory, tokenizer, processor, cfg, train, held_out


def _accuracy(model, tokenizer, cfg, processor, examples, colours):
    """Argmax over the four answers of the summed completion log-likelihood."""
    @jax.jit
    def score(batch):
        logits, _ = model(batch.tokens, batch.positions, batch.segment_ids,
                          images=jnp.asarray(batch.images))
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        tok = jnp.take_along_axis(lp, batch.tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(batch.loss_mask[:, 1:], tok, 0.0), axis=1)

    correct = 0
    for i, ex in enumerate(examples):
        prompt = ex.tokens[~ex.loss_mask]
        variants = []
        for c in colours:
            ans = np.asarray(tokenizer.encode(c), np.int32)
            variants.append(dataclass_replace(ex, prompt, ans))
        batch = make_vision_batch(variants, seq_len=SEQ_LEN, max_images=4)
        correct += int(np.argmax(np.asarray(score(batch)))) == i % 4
    return correct / len(examples)


def dataclass_replace(ex, prompt, ans):
    return dataclasses.replace(ex, tokens=np.concatenate([prompt, ans]),
                               loss_mask=np.r_[np.zeros(len(prompt), bool),
                                               np.ones(len(ans), bool)])


def test_lora_sft_learns_square_colour(setup):
    _, tokenizer, processor, cfg, train, held_out = setup
    model = init_vlm(cfg, seed=0)
    # With frozen tied embeddings of std 0.02 the logits cannot exceed ~1 (the final norm fixes
    # |h|); embeddings of std 0.4, as a trained model's are, let the frozen head express answers.
    embed = model.language_model.embed
    embed.set_value(embed[...] * 20.0)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj",
                                                              "o_proj", "gate_proj", "up_proj",
                                                              "down_proj")))
    apply_vision_lora(model.vision, LoRAConfig(rank=4, alpha=8.0))
    before = _accuracy(model, tokenizer, cfg, processor, held_out, list(COLOURS))
    optimizer = optax.adam(2e-2)
    state = TrainState.create(model, optimizer, rng=jax.random.key(0), wrt=nnx.LoRAParam)
    step = make_train_step(vision_sft_loss, optimizer)
    rng = np.random.RandomState(0)
    losses = []
    for _ in range(50):
        idx = rng.choice(len(train), 16, replace=False)
        batch = make_vision_batch([train[i] for i in idx], seq_len=SEQ_LEN, max_images=16)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    after = _accuracy(state.model(), tokenizer, cfg, processor, held_out, list(COLOURS))
    print(f"held-out accuracy {before:.2f} -> {after:.2f}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0]
    assert after > 0.6


def test_bad_input_names_the_example(setup, tmp_path):
    _, tokenizer, processor, cfg, _, _ = setup
    Image.new("RGB", (28, 28)).save(tmp_path / "ok.png")
    Image.new("I;16", (28, 28)).save(tmp_path / "deep.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    cases = [
        ({"prompt": "<start_of_image> x", "completion": " y", "images": ["missing.png"]},
         r"data.jsonl:2: image file .*missing.png' does not exist"),
        ({"prompt": "<start_of_image> x", "completion": " y", "images": ["broken.png"]},
         r"data.jsonl:2: image file .*broken.png' could not be read"),
        ({"prompt": "<start_of_image> x", "completion": " y", "images": ["deep.png"]},
         r"data.jsonl:2: image mode 'I;16' is not supported"),
        ({"prompt": "<start_of_image> x", "completion": " y", "images": ["ok.png", "ok.png"]},
         r"data.jsonl:2: the prompt has 1 <start_of_image> placeholder\(s\) but 2 image"),
    ]
    good = json.dumps({"prompt": "<start_of_image> x", "completion": " y", "images": ["ok.png"]})
    for record, message in cases:
        (tmp_path / "data.jsonl").write_text(good + "\n" + json.dumps(record) + "\n")
        with pytest.raises(VisionDataError, match=message):
            read_vision_sft(tmp_path / "data.jsonl", tokenizer, processor, cfg)


def test_chat_messages_with_images_render_and_expand(setup):
    directory, tokenizer, processor, cfg, _, _ = setup
    record = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what colour?"},
                                     {"type": "image", "path": "train0.png"}]},
        {"role": "assistant", "content": "R"}]}
    (directory / "chat.jsonl").write_text(json.dumps(record) + "\n")
    template = ChatTemplate.from_tokenizer(tokenizer)
    (ex,) = read_vision_sft(directory / "chat.jsonl", tokenizer, processor, cfg,
                            template=template)
    tokens = ex.tokens.tolist()
    start = tokens.index(cfg.boi_token_id)
    assert tokens[start:start + 6] == [384, 385, 385, 385, 385, 386]
    assert tokens.count(cfg.image_token_id) == 4 and ex.images.shape == (1, 28, 28, 3)
    newlines = tokenizer.encode("\n\n")
    assert tokens[start + 6:start + 6 + len(newlines)] == newlines  # as Gemma 3's processor
    targets = [t for t, m in zip(tokens, ex.loss_mask, strict=True) if m]
    assert tokenizer.decode(targets).startswith("R")


def test_dpo_on_image_pairs_starts_at_log2_and_improves(setup):
    directory, tokenizer, processor, cfg, _, _ = setup
    lines = [json.dumps({"prompt": "colour?<start_of_image>", "chosen": c, "rejected": r,
                         "images": [f"train{i}.png"]})
             for i, (c, r) in enumerate([("R", "G"), ("G", "B"), ("B", "Y"), ("Y", "R")] * 2)]
    (directory / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    pairs = read_vision_preference(directory / "pairs.jsonl", tokenizer, processor, cfg)
    assert pairs[0].images.shape[0] == 2  # one copy of the image per segment
    model = init_vlm(cfg, seed=1)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    apply_vision_lora(model.vision, LoRAConfig(rank=4, alpha=8.0))
    optimizer = optax.adam(1e-2)
    state = TrainState.create(model, optimizer, rng=jax.random.key(0), wrt=nnx.LoRAParam)
    step = make_train_step(vision_dpo_loss_fn(DPOConfig(beta=0.5)), optimizer)
    batch = make_vision_batch(pairs, seq_len=2 * SEQ_LEN, max_images=16)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    # Adapters start at zero, so policy == reference: -log sigmoid(0) = log 2 exactly.
    np.testing.assert_allclose(losses[0], np.log(2.0), atol=1e-6)
    assert losses[-1] < losses[0] - 0.05


def test_train_vision_exports_a_checkpoint_transformers_loads(setup, tmp_path):
    """The Python entry point: a few LoRA steps (language model and vision tower), merged
    export that transformers loads with the same logits."""
    directory, tokenizer, _, cfg, _, _ = setup
    base = init_vlm(cfg, seed=2)
    save_pretrained(base, tmp_path / "base")
    (tmp_path / "base" / "preprocessor_config.json").write_text(
        json.dumps(ImageProcessor(height=28, width=28).to_dict()))
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"))
    result = train_vision(VisionTrainConfig(
        model_path=str(tmp_path / "base"), data_path=str(directory / "train.jsonl"), steps=3,
        batch_size=4, seq_len=SEQ_LEN, max_images=4, lora=lora, vision_lora=True,
        optimizer=OptimizerConfig(learning_rate=1e-2, schedule="constant"),
        metrics=MetricsConfig(progress_bar=False), run_dir=str(tmp_path / "run")),
        tokenizer=tokenizer)
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == result.losses
    assert all(r["learning_rate"] == pytest.approx(1e-2) for r in records)
    # 4 rows of one image each; a row is "colour?\n\n", <boi> 4 x <image> <eoi>, "\n\n" and
    # the one-token answer (the marker expands to "\n\n" <boi> ... <eoi> "\n\n").
    row = len(tokenizer.encode("colour?\n\n")) + 6 + len(tokenizer.encode("\n\n")) + 1
    assert all(r["images"] == 4 and r["tokens"] == 4 * row for r in records)
    assert all(r["loss_tokens"] == 4 for r in records)  # one answer token a row
    assert result.export_dir == str(tmp_path / "run" / "export")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        result.export_dir, dtype=torch.float32).eval()
    tokens = np.array([[2, 7, 384, 385, 385, 385, 385, 386, 9]], np.int64)
    images = np.random.RandomState(0).randn(1, 28, 28, 3).astype(np.float32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(images).permute(
            0, 3, 1, 2), token_type_ids=torch.tensor(tokens == 385).long()).logits.numpy()
    ours, _ = result.model(jnp.asarray(tokens, jnp.int32), images=jnp.asarray(images))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
    assert ImageProcessor.from_pretrained(result.export_dir) == ImageProcessor(height=28, width=28)
