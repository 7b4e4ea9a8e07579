"""The main job behind `nonstop demo`: train a tiny model from scratch into a calculator-using
agent on a CPU, end to end, with nothing downloaded.

1. Generate demonstrations of training-split problems from `CalculatorEnv` and run supervised
   fine-tuning on them (`nonstop.sft.train`, character tokenizer, Qwen chat format). Like data
   gathered from several sources, they disagree on how to answer: half call the `calculator`
   tool (word problem -> tool call -> tool result -> final number), half state the number at
   once. The SFT model learns both and, for a given problem, picks either.
2. Measure the greedy solve rate and pass@k on held-out problems through the real agent loop
   (engine, tool-call parser, calculator tool).
3. Agentic GRPO with asynchronous rollouts: the `StreamingLearner` keeps episodes in flight
   while it trains, with bounded staleness. The reward is the right final number, however it
   was reached: RL finds that the calculator pays (a tiny model's mental arithmetic rarely
   does) and makes calling it the policy.
4. Measure the solve rate again; report the engine busy fraction and where the run directory,
   TensorBoard logs and the Perfetto trace are.

The whole is one `nonstop agentic` run (`agentic_recipe.py`) with a warm-up
(`agentic_warmup.py`): `nonstop agentic` with no config runs the same. Tool
schemas are left out of the prompt (`with_tools_in_prompt=False`): a character-level model pays
per character, and the demonstrations teach the call format directly.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from nonstop import perf
from nonstop.agentic.config import AgentConfig
from nonstop.engine import EngineConfig
from nonstop.models.source import ModelSource, TokenizerSource
from nonstop.recipes.agentic_recipe import (
    AgenticRunConfig,
    EnvSettings,
    engine_busy_during,
    run_agentic,
)
from nonstop.recipes.agentic_warmup import WarmupSettings
from nonstop.train import OptimizerConfig, PackingConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    run_dir: str = "runs/demo"
    seed: int = 0
    max_operand: int = 20
    sft_steps: int = 900  # it copies numbers into tool calls and answers from ~600-800 on
    sft_learning_rate: float = 3e-3
    # The share of demonstrations that call the calculator; the rest answer without it. At 1.0
    # every demonstration calls it, and RL is left only the copying errors of a model still
    # learning to copy (SFT teaches those faster, docs/agentic.md).
    tool_demo_fraction: float = 0.5
    rl_steps: int = 40
    rl_learning_rate: float = 1e-4
    group_size: int = 8
    groups_per_step: int = 8
    max_staleness: int = 1
    max_concurrency: int = 64
    eval_problems: int = 64
    pass_k: int = 4  # pass@k on the held-out problems too (k samples at the training temperature)
    hidden_size: int = 128
    num_layers: int = 3
    progress: bool = True

    def __post_init__(self) -> None:
        self.warmup()  # the SFT settings are checked up front

    @classmethod
    def quick(cls, run_dir: str) -> DemoConfig:
        """A shortened demo for tests."""
        return cls(run_dir=run_dir, sft_steps=60, rl_steps=4, eval_problems=24,
                   groups_per_step=4, group_size=4, pass_k=2, progress=False)

    def model_source(self) -> ModelSource:
        return ModelSource(family="qwen3", hidden_size=self.hidden_size,
                           intermediate_size=2 * self.hidden_size, num_layers=self.num_layers,
                           num_heads=4, num_kv_heads=2, head_dim=self.hidden_size // 4,
                           max_position_embeddings=512)

    def warmup(self) -> WarmupSettings:
        """The SFT phase: `sft_steps` on 4,000 demonstrations, `tool_demo_fraction` of them
        calling the calculator."""
        return WarmupSettings(
            steps=self.sft_steps, demonstrations=4000, tool_fraction=self.tool_demo_fraction,
            optimizer=OptimizerConfig(learning_rate=self.sft_learning_rate, schedule="constant",
                                      weight_decay=0.0),
            packing=PackingConfig(buckets=(320,), rows_per_batch=8, max_segments_per_row=2,
                                  overlong="truncate"))

    def agentic(self, *, warmup: bool = False) -> AgenticRunConfig:
        """The RL phase as an `nonstop agentic` run on the calculator environment, given the SFT
        model; `warmup`: the whole demo, the SFT phase first (what `nonstop agentic` with no
        config runs)."""
        return AgenticRunConfig(
            warmup=self.warmup() if warmup else WarmupSettings(),
            run_dir=str(Path(self.run_dir) / "agentic"), seed=self.seed, steps=self.rl_steps,
            num_eval=self.eval_problems, pass_k=self.pass_k, model=self.model_source(),
            tokenizer=TokenizerSource(kind="char", chat_format="qwen"),
            env=EnvSettings(name="calculator", max_operand=self.max_operand,
                            with_tools_in_prompt=False),
            group_size=self.group_size, groups_per_step=self.groups_per_step,
            max_staleness=self.max_staleness, max_concurrency=self.max_concurrency,
            agent=AgentConfig(max_turns=3, max_tokens_per_turn=96, max_episode_tokens=200,
                              step_timeout_s=30.0),
            optimizer=OptimizerConfig(learning_rate=self.rl_learning_rate, schedule="constant",
                                      weight_decay=0.0),
            packing=PackingConfig(buckets=(320,), rows_per_batch=16, max_segments_per_row=2,
                                  overlong="truncate"),
            engine=EngineConfig(max_slots=self.max_concurrency, max_len=512))


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    perf_dir = run_dir / "perf"
    with perf.run(perf_dir):
        rl = run_agentic(cfg.agentic(warmup=True), progress=cfg.progress)
    summary = {
        "solve_rate_before_rl": rl["solve_rate_before"], "solve_rate_after_rl":
        rl["solve_rate_after"], "rl_steps": rl["steps"],
        **({f"pass@{cfg.pass_k}_before_rl": rl["eval_before"][f"pass@{cfg.pass_k}"],
            f"pass@{cfg.pass_k}_after_rl": rl["eval_after"][f"pass@{cfg.pass_k}"]}
           if cfg.pass_k else {}),
        "train_reward_first": rl["train_reward_first"],
        "train_reward_last": rl["train_reward_last"],
        "engine_busy_fraction": engine_busy_during(perf_dir),
        "sft_seconds": rl["warmup_seconds"], "rl_seconds": rl["rl_seconds"],
        "seconds": time.perf_counter() - started, "run_dir": str(run_dir),
        "tensorboard": str(Path(rl["run_dir"]) / "tensorboard"),
        "trace": str(perf_dir / "trace.json"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
