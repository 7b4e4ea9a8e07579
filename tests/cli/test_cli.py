"""The `nonstop` command as a product: --version, `python -m nonstop`, `nonstop configs`,
`--config NAME`, `--print-config` round trips, config keys in --help, and every bad file, path or
key as one line on stderr with exit status 2 — all without building a model."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import nonstop
from nonstop.cli.main import SUBCOMMANDS, main
from nonstop.cli.sft import load_run_config
from nonstop.recipes.agentic_recipe import AgenticRunConfig
from nonstop.recipes.config_io import load_config
from nonstop.recipes.demo import DemoConfig
from nonstop.recipes.rl_recipe import RLRunConfig
from nonstop.sft.config import SFTRunConfig
from nonstop.sft.vision_trainer import VisionTrainConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "nonstop" / "recipes" / "configs").glob("*.yaml"))
CONFIG_CLASS = {"sft": SFTRunConfig, "dpo": SFTRunConfig, "orpo": SFTRunConfig,
                "rl": RLRunConfig, "agentic": AgenticRunConfig, "vlm": VisionTrainConfig}
# A shipped config each config-driven command runs.
EXAMPLE = {"sft": "sft_tiny", "dpo": "dpo_tiny", "orpo": "orpo_tiny", "rl": "grpo_arithmetic",
           "agentic": "agentic_calculator_tiny", "vlm": "vlm_sft_gemma3_4b"}


def load(command: str, path: str | Path | None, overrides=()):
    """What `nonstop COMMAND --config path overrides` trains with."""
    if CONFIG_CLASS[command] is SFTRunConfig:
        return load_run_config(command, None if path is None else str(path), list(overrides))
    return load_config(CONFIG_CLASS[command], path, overrides)


def listed_configs(capsys) -> dict[str, str]:
    """`nonstop configs`' table: name -> command."""
    assert main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "COMMAND", "DESCRIPTION"]
    rows = [line.split() for line in lines[1:lines.index("")]]
    return {row[0]: row[1] for row in rows}


def single_error_line(capsys, prog: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"nonstop {nonstop.__version__}\n"
    assert importlib.metadata.version("nonstop") == nonstop.__version__


def test_python_m_nonstop_is_the_nonstop_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "nonstop", "--help"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: nonstop ")
    for name in SUBCOMMANDS:
        assert f"\n    {name} " in result.stdout, name
    result = subprocess.run([sys.executable, "-m", "nonstop", "configs", "sft_tiny", "--path"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == f"{REPO}/nonstop/recipes/configs/sft_tiny.yaml\n"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: nonstop" in capsys.readouterr().out


def test_every_subcommand_module_exists():
    for name, (module, _) in SUBCOMMANDS.items():
        assert importlib.util.find_spec(module) is not None, (name, module)


def test_configs_lists_every_shipped_yaml_with_the_command_that_runs_it(capsys):
    listed = listed_configs(capsys)
    assert list(listed) == [p.stem for p in SHIPPED]
    for name, command in listed.items():
        assert command in CONFIG_CLASS, (name, command)
        expected = ("agentic" if name.startswith("agentic") else "vlm" if name.startswith("vlm")
                    else name.split("_")[0] if name.split("_")[0] in ("dpo", "orpo", "sft")
                    else "sft" if name.startswith("qlora") else "rl")
        assert command == expected, name


def test_configs_descriptions_come_from_the_leading_comment(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^sft_tiny +sft +SFT of a tiny Llama-style model from scratch on the "
                     r"built-in\.\.\.$", out, re.MULTILINE), out
    # "e.g." does not end a sentence.
    assert "DPO of Qwen3-0.6B (e.g. after SFT) on preference pairs" in out


def test_configs_name_prints_the_file_and_path_prints_where_it_is(capsys):
    shipped = REPO / "nonstop" / "recipes" / "configs" / "grpo_arithmetic.yaml"
    assert main(["configs", "grpo_arithmetic"]) == 0
    assert capsys.readouterr().out == shipped.read_text()
    assert main(["configs", "grpo_arithmetic.yaml", "--path"]) == 0
    assert capsys.readouterr().out == f"{shipped}\n"


def test_configs_unknown_name_suggests_close_ones(capsys):
    assert main(["configs", "grpo_arithmatic"]) == 2
    line = single_error_line(capsys, "nonstop configs")
    assert "no shipped config 'grpo_arithmatic'; did you mean grpo_arithmetic" in line
    assert line.endswith("`nonstop configs` lists the shipped configs")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_print_config_of_every_shipped_config_round_trips(path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = listed_configs(capsys)[path.stem]
    assert main([command, "--config", path.stem, "--print-config", "seed=7"]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["seed"] == 7
    assert list(tmp_path.iterdir()) == []  # nothing built, no run directory
    (tmp_path / "printed.yaml").write_text(printed)
    expected = load(command, path, ["seed=7"])
    assert load(command, tmp_path / "printed.yaml") == expected
    # By name or by path, the same config.
    assert main([command, "--config", str(path), "--print-config", "seed=7"]) == 0
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("command", ["rl", "agentic"])
def test_print_config_without_a_file_prints_the_commands_default(command, tmp_path, capsys):
    """`nonstop rl` without --config: the class's defaults; `nonstop agentic`: the shipped
    agentic_calculator, which is `nonstop demo`'s whole run (the warm-up, then RL)."""
    assert main([command, "--print-config"]) == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    if command == "rl":
        want = load(command, None)
    else:
        want = dataclasses.replace(DemoConfig().agentic(warmup=True), run_dir="runs/agentic")
        assert want.warmup.steps == 900 and want.warmup.tool_fraction == 0.5
    assert load(command, tmp_path / "printed.yaml") == want


@pytest.mark.parametrize("command", ["dpo", "orpo"])
def test_print_config_records_the_subcommands_algorithm(command, capsys):
    assert main([command, "--config", "sft_tiny", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["algorithm"] == command


@pytest.mark.parametrize("command", list(CONFIG_CLASS))
def test_help_lists_the_config_keys_with_short_defaults(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    cls = CONFIG_CLASS[command]
    assert f"config keys ({cls.__name__};" in out
    keys = [line.split()[0].rstrip(":") for line in out.split("config keys (")[1].splitlines()[1:]]
    assert keys == [f.name for f in dataclasses.fields(cls) if f.init]
    assert "`nonstop configs` lists them" in " ".join(out.split())
    assert "nonstop/recipes/configs/" not in out
    if cls is RLRunConfig:
        assert f"\n  steps: {RLRunConfig().steps}\n" in out
        assert "\n  optimizer  (section: OptimizerConfig)\n" in out
    if cls is VisionTrainConfig:
        assert "\n  model_path  (required)\n" in out


BAD_YAML = "steps: [1, 2\nrun_dir: x\n"


@pytest.mark.parametrize("command", list(CONFIG_CLASS))
@pytest.mark.parametrize("case", ["malformed_yaml", "missing_file", "unknown_name", "directory",
                                  "bad_key", "not_a_mapping"])
def test_bad_config_is_one_line_and_exit_2(command, case, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text({"malformed_yaml": BAD_YAML, "not_a_mapping": "- a\n- b\n"}.get(case, ""))
    config, overrides, message = {
        "malformed_yaml": (str(bad), [], f"{bad}: not valid YAML (while parsing a flow sequence; "
                           f'in "{bad}", line 1, column 8'),
        "missing_file": (str(tmp_path / "nope.yaml"), [],
                         f"--config {tmp_path}/nope.yaml: no such file and no shipped config"),
        "unknown_name": ("grpo_arithmatic", [], "--config grpo_arithmatic: no such file and no "
                         "shipped config of that name; did you mean grpo_arithmetic"),
        "directory": (str(tmp_path), [], f"--config {tmp_path}: is a directory, not a YAML file"),
        "bad_key": (EXAMPLE[command], ["nosuchkey=1"], "unknown config key 'nosuchkey'"),
        "not_a_mapping": (str(bad), [], "the top level must be a mapping of keys, got list"),
    }[case]
    assert main([command, "--config", config, *overrides]) == 2
    assert message in single_error_line(capsys, f"nonstop {command}")


def test_sft_config_naming_another_algorithm_is_refused(tmp_path, capsys):
    assert main(["dpo", "--config", "dpo_tiny", "--print-config"]) == 0
    (tmp_path / "dpo.yaml").write_text(capsys.readouterr().out)  # says algorithm: dpo
    assert main(["sft", "--config", str(tmp_path / "dpo.yaml"), "--print-config"]) == 2
    assert ("algorithm='dpo' conflicts with the subcommand 'nonstop sft'"
            in single_error_line(capsys, "nonstop sft"))


def test_serve_bad_directories_are_one_line(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["serve", str(missing)]) == 2
    assert f"{missing}: no such directory" in single_error_line(capsys, "nonstop serve")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    assert main(["serve", str(a_file)]) == 2
    assert f"{a_file}: not a directory" in single_error_line(capsys, "nonstop serve")
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path)]) == 2
    assert single_error_line(capsys, "nonstop serve").endswith(
        f"{tmp_path}: not a Hugging Face checkpoint directory: no tokenizer.json (a nonstop run "
        "writes one to RUN_DIR/export)")
    assert main(["serve", str(tmp_path), "--port", "70000"]) == 2
    line = single_error_line(capsys, "nonstop serve")
    assert "port" in line and "70000" in line and "65535" in line, line


def test_serve_engine_settings_reach_its_engine_config_and_bad_ones_are_one_line(capsys):
    import argparse

    from nonstop.cli import serve as serve_cli
    from nonstop.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    serve_cli._add_arguments(parser)
    args = parser.parse_args(["ckpt", "--max-slots", "16", "--max-len", "96", "--engine",
                              "prefill_rows=8", "--engine", "prefill_chunks=[16, 64]",
                              "--engine", "kv_layout=paged", "--on-weight-update", "abort"])
    assert serve_cli.config_from_args(args).engine == EngineConfig(
        max_slots=16, max_len=96, prefill_rows=8, prefill_chunks=(16, 64), kv_layout="paged",
        on_weight_update="abort")
    default = serve_cli.config_from_args(parser.parse_args(["ckpt"])).engine
    assert (default.max_slots, default.max_len) == (8, 2048)
    for setting, words in (("prefill_rows=many", ("prefill_rows", "many", "int")),
                           ("bogus=1", ("unknown config key 'bogus'", "prefill_rows")),
                           ("max_slots=0", ("max_slots=0", ">= 1"))):
        assert main(["serve", "ckpt", "--engine", setting]) == 2
        line = single_error_line(capsys, "nonstop serve")
        assert all(word in line for word in words), line


def test_benchmark_servers_run_the_engine_config_they_are_given():
    """bench.remote_servers turns an EngineConfig into serve flags that rebuild it exactly."""
    import argparse

    from bench.remote_servers import engine_flags
    from nonstop.cli import serve as serve_cli
    from nonstop.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    serve_cli._add_arguments(parser)
    for engine in (EngineConfig(max_slots=64, max_len=72),
                   EngineConfig(max_slots=64, max_len=72, prefill_chunks=(16, 64), decode_buckets=4,
                                prefill_rows=8, pipeline_depth=3, parked_slots=2048,
                                swap_space_gib=0.5, cache_dtype="bfloat16", seed=7),
                   EngineConfig(max_slots=128, max_len=512, kv_layout="paged", block_size=32,
                                kv_cache_tokens=16384, prefix_cache=False)):
        args = parser.parse_args(["ckpt", *engine_flags(engine)])
        assert serve_cli.config_from_args(args).engine == engine


def test_serve_malformed_checkpoint_is_one_line(tmp_path, capsys):
    from tests.models.tokenizer_fixtures import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path, "llama3")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')  # cut off
    assert main(["serve", str(tmp_path)]) == 2
    assert f"{tmp_path}/config.json is not valid JSON" in single_error_line(capsys, "nonstop serve")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["serve", str(tmp_path)]) == 2
    assert "num_hidden_layers" in single_error_line(capsys, "nonstop serve")


def test_report_bad_directories_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope' does not exist; pass a run directory (it holds events.jsonl)" in (
        single_error_line(capsys, "nonstop report"))
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({}) + "\n")
    assert main(["report", str(events)]) == 2
    assert "events.jsonl' is not a directory" in single_error_line(capsys, "nonstop report")


@pytest.mark.parametrize("command, config, overrides, message", [
    ("rl", "grpo_gsm8k_qwen3_0_6b", ["task.path=/no/such.jsonl"],
     "No such file or directory: '/no/such.jsonl'"),
    ("rl", "grpo_gsm8k_qwen3_0_6b", ["task.path=/dev/null"],
     "/dev/null: unknown file type ''; use .jsonl, .json or .parquet"),
    ("agentic", "agentic_calculator_qwen3_0_6b", ["model.path=/no/such"],
     "tokenizer directory /no/such does not exist"),
])
def test_bad_paths_in_a_run_are_one_line(command, config, overrides, message, tmp_path, capsys):
    assert main([command, "--config", config, f"run_dir={tmp_path}", "model.path=/no/such",
                 *overrides]) == 2
    assert message in single_error_line(capsys, f"nonstop {command}")
