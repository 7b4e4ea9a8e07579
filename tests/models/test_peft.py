"""LoRA adapters in PEFT's format: round trips through `peft` itself, in float32, both ways."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from nonstop.models import load_adapters, load_pretrained, save_adapters
from nonstop.models.checkpoint import CheckpointError
from nonstop.models.hf_weights import weight_specs
from nonstop.models.lora import LoRAConfig, LoRAWeight, apply_lora, has_lora
from nonstop.models.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.models.hf_fixtures import build_hf_model, hf_logits

ATOL = 1e-4
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = np.random.RandomState(0).randint(3, 257, (2, 11)).astype(np.int32)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def base(request, tmp_path_factory):
    """(family, directory of a tiny random transformers checkpoint)."""
    directory = tmp_path_factory.mktemp(request.param)
    build_hf_model(request.param, directory, seed=5, num_layers=2)
    return request.param, directory


def _hf_base(directory) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _randomize(model, seed: int = 0) -> None:
    """Non-zero A and B in every adapter (B starts at zero, which would hide layout bugs)."""
    keys = iter(jax.random.split(jax.random.key(seed), 10_000))
    for block in model.layers:
        for owner in (block.attn, block.mlp):
            for weight in vars(owner).values():
                if isinstance(weight, LoRAWeight):
                    for param in (weight.lora_a, weight.lora_b):
                        shape = param.get_value().shape
                        param.set_value(0.1 * jax.random.normal(next(keys), shape))


def _logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(TOKENS))[0])


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_nonstop_adapters_load_in_peft(base, tmp_path):
    family, directory = base
    targets = ALL if family != "qwen3" else ("q_proj", "v_proj", "o_proj", "down_proj")
    model = apply_lora(load_pretrained(directory), LoRAConfig(rank=3, alpha=5.0, targets=targets))
    _randomize(model)
    ours = _logits(model)
    save_adapters(model, tmp_path / "adapters", base_model_name_or_path=str(directory))

    hf_base = _hf_base(directory)
    base_logits = hf_logits(hf_base, TOKENS)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters change the output
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapters").eval()
    np.testing.assert_allclose(hf_logits(adapted, TOKENS), ours, atol=ATOL, rtol=0)

    # The same tensor names, shapes and config values as PEFT's own save_pretrained.
    reference = peft.get_peft_model(_hf_base(directory), peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=list(targets), task_type="CAUSAL_LM"))
    reference.save_pretrained(tmp_path / "reference")
    theirs = load_file(tmp_path / "reference" / ADAPTER_WEIGHTS)
    mine = load_file(tmp_path / "adapters" / ADAPTER_WEIGHTS)
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    their_cfg = json.loads((tmp_path / "reference" / ADAPTER_CONFIG).read_text())
    my_cfg = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert set(my_cfg["target_modules"]) == set(their_cfg["target_modules"])
    for key in set(my_cfg) & set(their_cfg) - {"target_modules", "base_model_name_or_path"}:
        assert my_cfg[key] == their_cfg[key], key


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_adapters_load_in_nonstop(base, tmp_path, use_rslora):
    family, directory = base
    if use_rslora and family != "llama":
        pytest.skip("rsLoRA's scale is family-independent: checked once")
    peft_model = peft.get_peft_model(_hf_base(directory), peft.LoraConfig(
        r=5, lora_alpha=7, target_modules=list(ALL), task_type="CAUSAL_LM",
        use_rslora=use_rslora))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapters")
    expected = hf_logits(peft_model, TOKENS)
    assert np.abs(expected - hf_logits(_hf_base(directory), TOKENS)).max() > 1e-2

    model = load_adapters(load_pretrained(directory), tmp_path / "adapters")
    assert has_lora(model)
    np.testing.assert_allclose(_logits(model), expected, atol=ATOL, rtol=0)


def test_save_then_load_gives_identical_parameters(base, tmp_path):
    _, directory = base
    cfg = LoRAConfig(rank=3, alpha=6.0, targets=("k_proj", "o_proj", "up_proj"))
    model = apply_lora(load_pretrained(directory), cfg)
    _randomize(model, seed=2)
    save_adapters(model, tmp_path)
    expected = _flat(model)
    for target in (load_pretrained(directory), apply_lora(load_pretrained(directory), cfg)):
        loaded = _flat(load_adapters(target, tmp_path))
        assert loaded.keys() == expected.keys()
        for path, value in expected.items():
            np.testing.assert_array_equal(loaded[path], value, err_msg=str(path))


def test_layout_matches_the_checkpoint_mapping(base, tmp_path):
    """PEFT's B·A in [out, in] is our A·B converted by weight_specs' own to_hf."""
    _, directory = base
    model = apply_lora(load_pretrained(directory), LoRAConfig(rank=2, targets=ALL))
    _randomize(model, seed=3)
    specs = {s.path: s for s in weight_specs(model.cfg)}
    saved = {}
    for path, spec in specs.items():
        if path[-1] in ALL and path[1] == 0:
            w = getattr(getattr(model.layers[0], path[2]), path[3])
            a, b = np.asarray(w.lora_a.get_value()), np.asarray(w.lora_b.get_value())
            saved[spec] = spec.to_hf(np.tensordot(a, b, axes=1))
    assert len(saved) == len(ALL)
    save_adapters(model, tmp_path)
    tensors = load_file(tmp_path / ADAPTER_WEIGHTS)
    for spec, delta in saved.items():
        module = "base_model.model." + spec.hf_name.removesuffix(".weight")
        product = tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"]
        np.testing.assert_allclose(product, delta, atol=1e-6, err_msg=spec.hf_name)


# --- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A llama base checkpoint and adapters (q, v) saved from nonstop."""
    root = tmp_path_factory.mktemp("refusals")
    build_hf_model("llama", root / "base", seed=7, num_layers=2)
    model = apply_lora(load_pretrained(root / "base"), LoRAConfig(rank=3,
                                                                  targets=("q_proj", "v_proj")))
    _randomize(model)
    save_adapters(model, root / "adapters")
    return root / "base", root / "adapters"


def _copy(adapters, tmp_path, *, config=None, tensors=None):
    cfg = json.loads((adapters / ADAPTER_CONFIG).read_text())
    weights = load_file(adapters / ADAPTER_WEIGHTS)
    if config is not None:
        config(cfg)
    if tensors is not None:
        tensors(weights)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    save_file(weights, str(tmp_path / ADAPTER_WEIGHTS))
    return tmp_path


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,message", [
    (dict(tensors=lambda t: t.pop(f"{Q0}.lora_B.weight")),
     f"tensor '{Q0}.lora_B.weight' is missing"),
    (dict(tensors=lambda t: t.update({f"{Q0}.lora_A.weight": np.zeros((3, 43), np.float32)})),
     f"tensor '{Q0}.lora_A.weight' has shape (3, 43)"),
    (dict(tensors=lambda t: t.update({"base_model.model.lm_head.lora_A.weight":
                                      np.zeros((3, 44), np.float32)})),
     "unexpected tensor 'base_model.model.lm_head.lora_A.weight'"),
    (dict(config=lambda c: c.update(use_dora=True)), "use_dora=True"),
    (dict(config=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
     "['embed_tokens'] are not projections"),
    (dict(config=lambda c: c.update(layers_to_transform=[0])), "layers_to_transform=[0]"),
    (dict(config=lambda c: c.update(r=4)), "has shape (3, 44), but the base model and r=4"),
])
def test_refuses_what_does_not_fit(saved, tmp_path, edit, message):
    base_dir, adapters = saved
    directory = _copy(adapters, tmp_path, **edit)
    with pytest.raises(CheckpointError) as error:
        load_adapters(load_pretrained(base_dir), directory)
    assert message in str(error.value)
    assert str(directory) in str(error.value)


def test_refuses_adapters_unlike_the_models_own(saved):
    base_dir, adapters = saved
    model = apply_lora(load_pretrained(base_dir), LoRAConfig(rank=3, targets=("q_proj",)))
    with pytest.raises(CheckpointError, match=r"target_modules \['q_proj', 'v_proj'\] differ"):
        load_adapters(model, adapters)
    model = apply_lora(load_pretrained(base_dir), LoRAConfig(rank=2, targets=("q_proj", "v_proj")))
    with pytest.raises(CheckpointError, match="r=3, scale .* differ from the model's"):
        load_adapters(model, adapters)


def test_refuses_a_model_without_adapters_and_a_missing_directory(saved, tmp_path):
    base_dir, _ = saved
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        save_adapters(load_pretrained(base_dir), tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_adapters(load_pretrained(base_dir), tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=f"{ADAPTER_CONFIG}: not found"):
        load_adapters(load_pretrained(base_dir), tmp_path)
