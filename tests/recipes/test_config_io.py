"""YAML configs with dotted overrides: nesting, type checks, error messages, dump round trip."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
import yaml

from nonstop.models.config import ConfigError
from nonstop.recipes.config_io import dump_config, load_config, parse_override
from nonstop.sft.config import SFTRunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    rate: float = 0.5
    mode: Literal["fast", "slow"] = "fast"
    sizes: tuple[int, ...] = (3, 5)
    pair: tuple[str, int] = ("a", 1)

    def __post_init__(self) -> None:
        if self.rate < 0:
            raise ValueError(f"Inner.rate must be >= 0, got {self.rate}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    steps: int = 7
    flag: bool = False
    limit: int | None = None
    inner: Inner = Inner()
    extra: Inner | None = None


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_file_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "name: run\nsteps: 11\ninner:\n  rate: 0.25\n  sizes: [2, 3]\n")
    cfg = load_config(Outer, path, ["steps=13", "inner.mode=slow", "steps=17", "inner.rate=1e-3"])
    assert cfg == Outer(
        name="run", steps=17, inner=Inner(rate=1e-3, mode="slow", sizes=(2, 3))
    )
    assert isinstance(cfg.inner.rate, float)  # PyYAML reads "1e-3" as a string


def test_optional_sections_scalars_and_tuples():
    cfg = load_config(
        Outer,
        None,
        ["name=x", "limit=5", "extra.rate=2", "inner.sizes=11", "inner.pair=[b, 4]", "flag=true"],
    )
    assert cfg.limit == 5 and cfg.flag is True
    assert cfg.extra == Inner(rate=2.0)
    assert cfg.inner.sizes == (11,) and cfg.inner.pair == ("b", 4)
    assert load_config(Outer, None, ["name=x", "limit=null"]).limit is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("inner.speed=3", r"unknown config key 'inner.speed'.*valid keys under inner: "
                          r"\['mode', 'pair', 'rate', 'sizes'\]"),
        ("stepz=3", r"unknown config key 'stepz'.*\['extra', 'flag', 'inner', 'limit', 'name', "),
        ("inner.mode=medium", r"inner.mode='medium' is invalid; expected one of 'fast', 'slow'"),
        ("steps=2.5", r"steps=2.5 is invalid; expected an integer"),
        ("steps=true", r"steps=True is invalid; expected an integer"),
        ("flag=1", r"flag=1 is invalid; expected a boolean"),
        ("inner.rate=fast", r"inner.rate='fast' is invalid; expected a number"),
        ("inner.sizes=[1, x]", r"inner.sizes\[1\]='x' is invalid; expected an integer"),
        ("inner.pair=[a]", r"inner.pair=\['a'\] is invalid; expected a list of 2 items"),
        ("limit=abc", r"limit='abc' is invalid; expected an integer or null"),
        ("inner.rate=-1", r"inner: Inner.rate must be >= 0, got -1.0"),
        ("steps", r"not of the form key.sub=value"),
        ("steps.sub=1", r"steps is 7, not a section|steps=\{'sub': 1\} is invalid"),
    ],
)
def test_errors_name_the_key_the_value_and_what_is_valid(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Outer, None, ["name=x", override])


def test_missing_required_key_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"missing config key 'name' of Outer \(expected a string"):
        load_config(Outer, None, [])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, str(tmp_path / "nope.yaml"), [])
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(Outer, write(tmp_path, "- 1\n- 2\n"), [])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Outer, write(tmp_path, "name: [unclosed\n"), [])


def test_parse_override_values_are_yaml():
    assert parse_override("a.b=[128, 256]") == (("a", "b"), [128, 256])
    assert parse_override("x=null") == (("x",), None)
    assert parse_override("x=bfloat16") == (("x",), "bfloat16")
    assert parse_override("x=") == (("x",), "")


def test_dump_round_trips_through_yaml(tmp_path):
    cfg = load_config(Outer, None, ["name=n", "extra.mode=slow", "inner.sizes=[13, 17]"])
    dumped = dump_config(cfg)
    assert dumped["inner"]["sizes"] == [13, 17]
    path = write(tmp_path, yaml.safe_dump(dumped))
    assert load_config(Outer, path, []) == cfg


def test_run_config_examples_load_and_round_trip(tmp_path):
    from pathlib import Path

    import nonstop.recipes

    configs = Path(nonstop.recipes.__file__).parent / "configs"
    names = ["sft_tiny.yaml", "dpo_tiny.yaml", "orpo_tiny.yaml", "sft_qwen3_0_6b.yaml",
             "sft_lora_llama3_2_1b.yaml", "qlora_gemma3_1b.yaml", "dpo_qwen3_0_6b.yaml",
             "orpo_llama3_2_1b.yaml"]  # the directory also holds the RL recipes
    for name in names:
        algorithm = name.split("_")[0] if name.split("_")[0] in ("dpo", "orpo") else "sft"
        overrides = [f"algorithm={algorithm}"]
        if "tiny" not in name:
            overrides.append("model.path=/ckpt")
        cfg = load_config(SFTRunConfig, configs / name, overrides)
        again = load_config(SFTRunConfig, write(tmp_path, yaml.safe_dump(dump_config(cfg))), [])
        assert again == cfg, name


def test_run_config_cross_field_errors():
    base = ["builtin_data.task=reverse", "tokenizer.kind=char"]
    with pytest.raises(ConfigError, match=r"^builtin_data=None is invalid; expected a built-in "
                                          r"synthetic task .*set exactly one of data"):
        load_config(SFTRunConfig, None, ["tokenizer.kind=char"])
    with pytest.raises(ConfigError, match=r"^builtin_data=BuiltinData\(task='reverse'.* is "
                                          r"invalid; expected null when data is set"):
        load_config(SFTRunConfig, None, [*base, "data.paths=[a.jsonl]"])
    with pytest.raises(ConfigError, match=r"^data\.packing=PackingConfig\(.*rows_per_batch=4.* "
                                          r"is invalid; expected unset: set packing\.\* at the "
                                          r"top level"):
        load_config(SFTRunConfig, None, ["tokenizer.kind=char", "data.paths=[a.jsonl]",
                                         "data.packing.rows_per_batch=4"])
    with pytest.raises(ConfigError, match=r"^tokenizer\.path=None is invalid; expected a "
                                          r"tokenizer directory when tokenizer\.kind='pretrained'"):
        load_config(SFTRunConfig, None, ["builtin_data.task=reverse"])
    with pytest.raises(ConfigError, match="optimizer.total_steps=50 is invalid.*follows steps=100"):
        load_config(SFTRunConfig, None, [*base, "optimizer.total_steps=50"])
    with pytest.raises(ConfigError, match="rows_per_batch=6 is invalid; expected a multiple of "
                                          "grad_accum_steps x mesh.data x mesh.fsdp = 4"):
        load_config(SFTRunConfig, None, [*base, "packing.rows_per_batch=6", "mesh.fsdp=2",
                                         "grad_accum_steps=2"])
    with pytest.raises(ConfigError, match=r"^lora=None is invalid; expected adapters "
                                          r"\(lora\.rank=\.\.\.\) when quantization is set"):
        load_config(SFTRunConfig, None, [*base, "quantization.kind=nf4"])
    with pytest.raises(ConfigError, match=r"dtype='float16' is invalid; expected one of "
                                          r"'float32', 'bfloat16'"):
        load_config(SFTRunConfig, None, [*base, "dtype=float16"])
    assert load_config(SFTRunConfig, None, [*base, "steps=9"]).optimizer.total_steps == 9
