"""Bad checkpoints fail loudly, naming the tensor or field and the file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from nonstop.models import (
    CheckpointError,
    ConfigError,
    ModelConfig,
    init_decoder,
    load_pretrained,
    save_pretrained,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    save_pretrained(init_decoder(ModelConfig.tiny("qwen2")), directory)
    return directory


def _copy(checkpoint, tmp_path, edit_tensors=None, edit_config=None):
    tensors = load_file(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path,
                 edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_pretrained(path)


def test_wrong_shape_names_tensor_and_file(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.bias"] = np.zeros((3,), np.float32)

    path = _copy(checkpoint, tmp_path, edit_tensors=edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*k_proj\.bias.*shape \(3,\)"):
        load_pretrained(path)


def test_unexpected_tensor_is_an_error(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.o_proj.bias"] = np.zeros((44,), np.float32)

    path = _copy(checkpoint, tmp_path, edit_tensors=edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn"):
        load_pretrained(path)


def test_unknown_architecture(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path, edit_config=lambda c: c.update(model_type="mamba"))
    with pytest.raises(ConfigError, match=r"config\.json.*'model_type' = 'mamba'.*unknown"):
        load_pretrained(path)


@pytest.mark.parametrize("field,value,words", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "yarn"),
    ("use_sliding_window", True, "sliding"),
    ("attention_dropout", 0.1, "dropout"),
    ("some_new_switch", 1, "not supported"),
])
def test_unsupported_config_field_is_named(checkpoint, tmp_path, field, value, words):
    path = _copy(checkpoint, tmp_path, edit_config=lambda c: c.update({field: value}))
    with pytest.raises(ConfigError, match=rf"config\.json: config field '{field}'.*{words}"):
        load_pretrained(path)


def test_missing_required_config_field(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path, edit_config=lambda c: c.pop("intermediate_size"))
    with pytest.raises(ConfigError, match=r"config\.json.*'intermediate_size' is missing"):
        load_pretrained(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_pretrained(tmp_path / "nope")


def _last_tensor(file):
    """The tensor stored last in a safetensors file (the one a truncation cuts first)."""
    length = int.from_bytes(file.read_bytes()[:8], "little")
    header = json.loads(file.read_bytes()[8:8 + length])
    header.pop("__metadata__", None)
    return max(header, key=lambda name: header[name]["data_offsets"][1])


def test_truncated_file_names_file_and_tensor(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    file = path / "model.safetensors"
    last = _last_tensor(file)
    file.write_bytes(file.read_bytes()[:-5])
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors: truncated: tensor '{re.escape(last)}'"):
        load_pretrained(path)


def test_truncated_header_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_pretrained(path)


def test_data_offsets_that_disagree_with_the_shape(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    file = path / "model.safetensors"
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    header["model.norm.weight"]["shape"] = [2, header["model.norm.weight"]["shape"][0]]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))  # same header length, so every offset stays valid
    assert len(text) == length
    file.write_bytes(raw[:8] + text + raw[8 + length:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' "
                                              r"\(F32 \[2, \d+\]\) needs \d+ bytes"):
        load_pretrained(path)
