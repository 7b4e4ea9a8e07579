"""ModelConfig presets and the config.json translation both ways."""

from __future__ import annotations

import pytest
import transformers

from nonstop.models import ConfigError, ModelConfig
from nonstop.models.presets import PRESETS

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
    with pytest.raises(ConfigError, match="num_heads .* multiple of num_kv_heads"):
        ModelConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="activation 'relu'"):
        ModelConfig.tiny(activation="relu")
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        ModelConfig.tiny(layer_types=("sliding", "full"))
