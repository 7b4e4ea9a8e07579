"""An override changes exactly the key it names, in every nested section of every run config.

A section that a run config gives its own default (`AgenticRunConfig.engine` is
`EngineConfig(max_slots=64, max_len=512)`) must keep that default's other keys when one key
inside it is overridden; building the section from its class defaults instead would, e.g., turn
`engine.max_len` from 512 into 1024 on `engine.pipeline_depth=3`.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from nonstop.models.validation import ConfigError
from nonstop.recipes.agentic_recipe import AgenticRunConfig
from nonstop.recipes.config_io import dump_config, load_config
from nonstop.recipes.rl_recipe import RLRunConfig
from nonstop.sft.config import SFTRunConfig
from nonstop.sft.vision_trainer import VisionTrainConfig

# What each run config needs besides its defaults to load at all.
REQUIRED = {
    SFTRunConfig: ["builtin_data.task=reverse", "tokenizer.kind=char"],
    RLRunConfig: [],
    AgenticRunConfig: [],
    VisionTrainConfig: ["model_path=/ckpt", "data_path=/data.jsonl"],
}


def _leaves(tree: object, prefix: str) -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf under a dumped section."""
    if isinstance(tree, dict):
        return [leaf for key, sub in tree.items() for leaf in _leaves(sub, f"{prefix}.{key}")]
    return [(prefix, tree)]


def _section_leaves() -> list[tuple[type, str, object]]:
    cases = []
    for cls, required in REQUIRED.items():
        base = load_config(cls, None, required)
        for field in dataclasses.fields(cls):
            section = getattr(base, field.name)
            if dataclasses.is_dataclass(section):
                cases += [(cls, key, value)
                          for key, value in _leaves(dump_config(section), field.name)]
    return cases


CASES = _section_leaves()


def test_every_run_config_has_sections_to_check() -> None:
    sections = {(cls.__name__, key.split(".")[0]) for cls, key, _ in CASES}
    assert {("AgenticRunConfig", "engine"), ("AgenticRunConfig", "agent"),
            ("RLRunConfig", "rollout"), ("RLRunConfig", "checkpoint"),
            ("SFTRunConfig", "optimizer"), ("VisionTrainConfig", "mesh")} <= sections


@pytest.mark.parametrize(("cls", "key", "value"), CASES,
                         ids=[f"{c.__name__}:{k}" for c, k, _ in CASES])
def test_an_override_inside_a_section_keeps_the_sections_other_keys(cls, key, value) -> None:
    base = load_config(cls, None, REQUIRED[cls])
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    overridden = load_config(cls, None, [*REQUIRED[cls], f"{key}={text}"])
    assert dump_config(overridden) == dump_config(base)


def test_the_named_key_changes_and_nothing_else() -> None:
    base = load_config(AgenticRunConfig, None, [])
    cfg = load_config(AgenticRunConfig, None, ["engine.pipeline_depth=3", "agent.max_turns=2"])
    assert (cfg.engine.max_len, cfg.engine.max_slots, cfg.engine.pipeline_depth) == (512, 64, 3)
    assert cfg.agent.max_turns == 2
    assert cfg.agent.max_tokens_per_turn == base.agent.max_tokens_per_turn == 96
    assert dataclasses.replace(cfg.engine, pipeline_depth=2) == base.engine
    rl = load_config(RLRunConfig, None, ["rollout.sampling.temperature=0.7"])
    assert rl.rollout.sampling.temperature == 0.7
    assert dataclasses.replace(rl.rollout, sampling=RLRunConfig().rollout.sampling) == \
        RLRunConfig().rollout


def test_a_bad_value_inside_a_section_names_the_dotted_key() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.max_len=1 is invalid; expected an int >= 2"):
        load_config(AgenticRunConfig, None, ["engine.max_len=1"])
    with pytest.raises(ConfigError, match=r"^agent\.sampling\.top_p=0\.0 is invalid"):
        load_config(AgenticRunConfig, None, ["agent.sampling.top_p=0"])
    with pytest.raises(ConfigError, match=r"^checkpoint\.save_every=0 is invalid"):
        load_config(RLRunConfig, None, ["checkpoint.save_every=0"])


def test_a_moved_key_names_its_new_home() -> None:
    with pytest.raises(ConfigError, match="'agent.temperature' has moved: set "
                                          "'agent.sampling.temperature'"):
        load_config(AgenticRunConfig, None, ["agent.temperature=0.5"])
    with pytest.raises(ConfigError, match="'rollout.top_p' has moved: set "
                                          "'rollout.sampling.top_p'"):
        load_config(RLRunConfig, None, ["rollout.top_p=0.9"])
