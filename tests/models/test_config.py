"""ModelConfig presets and the config.json translation both ways."""

from __future__ import annotations

import json

import pytest
import transformers

from nonstop.models import ConfigError, ModelConfig
from nonstop.models.config import RopeConfig
from nonstop.models.presets import PRESETS
from nonstop.models.source import ModelSource

# Published parameter counts (billions), rounded as the model names round them.
_SIZES = {"llama3_1_8b": 8.03, "llama3_2_1b": 1.24, "llama3_2_3b": 3.21, "qwen2_5_0_5b": 0.49,
          "qwen2_5_1_5b": 1.54, "qwen2_5_7b": 7.62, "qwen3_0_6b": 0.60, "qwen3_1_7b": 1.72,
          "qwen3_4b": 4.02, "qwen3_8b": 8.19, "gemma_2b": 2.51, "gemma_7b": 8.54,
          "gemma2_2b": 2.61, "gemma2_9b": 9.24, "gemma3_1b": 1.00, "gemma3_4b": 3.88,
          "gemma3_12b": 11.77, "gemma3_27b": 27.01}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count(name):
    cfg = ModelConfig.preset(name)
    assert cfg.num_params() / 1e9 == pytest.approx(_SIZES[name], rel=0.02)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_round_trips_through_hf_config(name):
    cfg = ModelConfig.preset(name)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("name", ["llama3_2_1b", "qwen2_5_0_5b", "qwen3_0_6b", "gemma_2b",
                                  "gemma2_2b", "gemma3_1b"])
def test_transformers_reads_our_config(name):
    """transformers builds the same architecture from our config.json (on the meta device)."""
    cfg = ModelConfig.preset(name)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(hf_cfg.to_dict()) == cfg


def test_named_preset_methods():
    assert ModelConfig.qwen3_0_6b() == ModelConfig.preset("qwen3_0_6b")
    assert ModelConfig.gemma3_27b().query_pre_attn_scalar == 168.0
    assert ModelConfig.gemma3_1b().layer_types[:6] == ("sliding",) * 5 + ("full",)
    assert ModelConfig.gemma2_2b().layer_types[:2] == ("sliding", "full")
    with pytest.raises(ConfigError, match="unknown model preset 'qwen9'"):
        ModelConfig.preset("qwen9")


def test_invalid_values_are_named():
    with pytest.raises(ConfigError, match=r"^ModelConfig\.num_kv_heads=3 is invalid; "
                                          r"expected a divisor of num_heads=4$") as err:
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    assert (err.value.field, err.value.value) == ("num_kv_heads", 3)
    with pytest.raises(ConfigError, match=r"^ModelConfig\.activation='relu' is invalid; "
                                          r"expected one of 'silu', "):
        ModelConfig.tiny(activation="relu")
    with pytest.raises(ConfigError, match=r"^ModelConfig\.sliding_window=None is invalid; "
                                          r"expected .*'sliding' layers"):
        ModelConfig.tiny(layer_types=("sliding", "full"))
    with pytest.raises(ConfigError, match=r"^ModelConfig\.layer_types=\('full',\) is invalid; "
                                          r"expected num_layers=2 entries"):
        ModelConfig.tiny(num_layers=2, layer_types=("full",))
    with pytest.raises(ConfigError, match=r"^ModelConfig\.head_dim=0 is invalid; "
                                          r"expected an int >= 1$"):
        ModelConfig.tiny(head_dim=0)
    with pytest.raises(ConfigError, match=r"^RopeConfig\.kind='yarn' is invalid; "
                                          r"expected one of 'default', 'linear', 'llama3'$"):
        RopeConfig(kind="yarn")
    with pytest.raises(ConfigError, match=r"^RopeConfig\.factor=0\.0 is invalid; "
                                          r"expected a number > 0$"):
        RopeConfig(factor=0.0)


@pytest.mark.parametrize("drop, missing", [
    ("num_hidden_layers", "'num_hidden_layers'"),
    ("vocab_size", "'vocab_size'"),
    ("rope_scaling.factor", "'rope_scaling.factor'"),
])
def test_config_json_missing_key_names_file_and_key(tmp_path, drop, missing):
    hf = ModelConfig.preset("llama3_2_1b").to_hf()
    hf.pop("rope_parameters", None)
    if "." in drop:
        section, key = drop.split(".")
        del hf[section][key]
    else:
        del hf[drop]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=rf"config\.json: required config field {missing} "
                                          "is missing"):
        ModelConfig.from_hf(tmp_path)


def test_model_source_refuses_path_and_preset_together():
    with pytest.raises(ConfigError, match=r"^ModelSource\.preset='qwen3_0_6b' is invalid; "
                                          r"expected null while path='/ckpt' is set") as err:
        ModelSource(path="/ckpt", preset="qwen3_0_6b")
    assert err.value.field == "preset"
    assert ModelSource(preset="qwen3_0_6b").kind == "preset"
