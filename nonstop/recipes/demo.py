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

Steps 2-4 are the `nonstop agentic` recipe (`agentic_recipe.py`) given the SFT model. Tool
schemas are left out of the prompt (`with_tools_in_prompt=False`): a character-level model pays
per character, and the demonstrations teach the call format directly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

from nonstop import perf
from nonstop.agentic.config import AgentConfig
from nonstop.agentic.envs import CalculatorEnv
from nonstop.agentic.envs.calculator import CalculatorConfig
from nonstop.engine import EngineConfig
from nonstop.models import Decoder, Tokenizer
from nonstop.models.char_tokenizer import char_tokenizer
from nonstop.models.chat import Message
from nonstop.models.source import ModelSource, TokenizerSource
from nonstop.models.validation import check
from nonstop.recipes.agentic_recipe import (
    AgenticRunConfig,
    EnvSettings,
    engine_busy_during,
    run_agentic,
)
from nonstop.sft import SFTRunConfig, train
from nonstop.sft.data import DataConfig
from nonstop.train import CheckpointConfig, MetricsConfig, OptimizerConfig, PackingConfig


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
        fraction = self.tool_demo_fraction
        check(type(fraction) in (int, float) and 0 <= fraction <= 1, "DemoConfig",
              "tool_demo_fraction", fraction, "a float in [0, 1]")

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

    def agentic(self) -> AgenticRunConfig:
        """The RL phase as an `nonstop agentic` run on the calculator environment."""
        return AgenticRunConfig(
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


def write_demonstrations(path: Path, env_cfg: CalculatorConfig, n: int, seed: int,
                         tool_fraction: float = 1.0) -> None:
    """`n` demonstrations of training-split problems: a share `tool_fraction` call the
    calculator, the rest state the answer at once (drawn per problem from `seed`)."""
    env = CalculatorEnv(env_cfg)
    choice = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            task = env.sample_task(seed + i)
            if choice.random() < tool_fraction:
                messages = env.demonstration(task)
            else:
                messages = [Message.system(env.system_prompt), Message.user(task.prompt),
                            Message.assistant(task.answer)]
            f.write(json.dumps({"messages": [m.to_dict() for m in messages]}) + "\n")


def supervised_phase(cfg: DemoConfig, tokenizer: Tokenizer) -> Decoder:
    data = Path(cfg.run_dir) / "sft_data.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_demonstrations(data, CalculatorConfig(max_operand=cfg.max_operand), n=4000,
                         seed=cfg.seed, tool_fraction=cfg.tool_demo_fraction)
    sft = SFTRunConfig(
        run_dir=str(Path(cfg.run_dir) / "sft"), steps=cfg.sft_steps, seed=cfg.seed,
        model=cfg.model_source(), tokenizer=TokenizerSource(kind="char", chat_format="qwen"),
        data=DataConfig(paths=(str(data),), kind="chat", num_epochs=None, seed=cfg.seed),
        packing=PackingConfig(buckets=(320,), rows_per_batch=8, max_segments_per_row=2,
                              overlong="truncate"),
        optimizer=OptimizerConfig(learning_rate=cfg.sft_learning_rate, schedule="constant",
                                  weight_decay=0.0),
        checkpoint=CheckpointConfig(save_every=max(cfg.sft_steps, 1)),
        metrics=MetricsConfig(progress_bar=cfg.progress), export=False)
    return train(sft, tokenizer=tokenizer).state.model()


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    perf_dir = run_dir / "perf"
    with perf.run(perf_dir):
        model = supervised_phase(cfg, char_tokenizer("qwen"))
        sft_seconds = time.perf_counter() - started
        rl = run_agentic(cfg.agentic(), model=model, progress=cfg.progress)
    summary = {
        "solve_rate_before_rl": rl["solve_rate_before"], "solve_rate_after_rl":
        rl["solve_rate_after"], "rl_steps": rl["steps"],
        **({f"pass@{cfg.pass_k}_before_rl": rl["eval_before"][f"pass@{cfg.pass_k}"],
            f"pass@{cfg.pass_k}_after_rl": rl["eval_after"][f"pass@{cfg.pass_k}"]}
           if cfg.pass_k else {}),
        "train_reward_first": rl["train_reward_first"],
        "train_reward_last": rl["train_reward_last"],
        "engine_busy_fraction": engine_busy_during(perf_dir),
        "sft_seconds": sft_seconds, "rl_seconds": rl["rl_seconds"],
        "seconds": time.perf_counter() - started, "run_dir": str(run_dir),
        "tensorboard": str(run_dir / "sft" / "tensorboard"),
        "trace": str(perf_dir / "trace.json"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
