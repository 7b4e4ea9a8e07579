"""`nonstop agentic` refuses, before any model is built, a run whose prompts cannot fit the
engine's context, naming the key to change and a value that would fit."""

from __future__ import annotations

import pytest

from nonstop.cli.main import main
from nonstop.models.validation import ConfigError
from nonstop.recipes.agentic_recipe import AgenticRunConfig, run_agentic
from nonstop.recipes.config_io import load_config


def test_a_prompt_longer_than_the_engine_context_is_refused_before_any_model(tmp_path):
    cfg = load_config(AgenticRunConfig, None, [f"run_dir={tmp_path}", "engine.max_len=64"])
    with pytest.raises(ConfigError, match=r"engine\.max_len=64 is invalid; expected more than "
                                          r"the (\d+) tokens of a training prompt of env "
                                          r"'calculator'.*engine\.max_len=\d+"):
        run_agentic(cfg, progress=False)
    assert not (tmp_path / "perf").exists()  # the perf run (and the model) never started


def test_the_agent_context_limit_is_named_when_it_is_the_tighter_one(tmp_path):
    cfg = load_config(AgenticRunConfig, None, [f"run_dir={tmp_path}",
                                               "agent.max_context_tokens=100"])
    with pytest.raises(ConfigError, match=r"agent\.max_context_tokens=100 is invalid"):
        run_agentic(cfg, progress=False)


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    assert main(["agentic", f"run_dir={tmp_path}", "engine.max_len=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("nonstop agentic: error: ")
    assert "engine.max_len=64 is invalid" in err


@pytest.mark.parametrize("override, key, expected", [
    ("group_size=128", "max_concurrency=64", "at least group_size=128"),
    ("max_staleness=-1", "max_staleness=-1", "an int >= 0"),
    ("agent.sampling.temperature=-1", "agent.sampling.temperature=-1.0", "a finite float >= 0"),
    ("eval_every=-5", "eval_every=-5", "an int >= 0"),
    ("pass_k=-1", "pass_k=-1", "an int >= 0"),
])
def test_bad_settings_are_refused_when_the_config_loads(override, key, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(AgenticRunConfig, None, [override])
    message = str(caught.value)
    assert message.startswith(f"{key} is invalid") and expected in message, message
