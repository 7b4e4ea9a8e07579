"""The main job behind `nonstop demo`: train a tiny model from scratch into a calculator-using
agent on a CPU, end to end, with nothing downloaded.

1. Generate tool-use demonstrations from `CalculatorEnv` (word problem → `calculator` tool call →
   tool result → final number) and run supervised fine-tuning on them (`nonstop.sft.train`,
   character tokenizer, Qwen chat format).
2. Measure the greedy solve rate on held-out problems through the real agent loop (engine,
   tool-call parser, calculator tool).
3. Agentic GRPO with asynchronous rollouts: the `StreamingLearner` keeps episodes in flight
   while it trains, with bounded staleness.
4. Measure the solve rate again; report the engine busy fraction and where the run directory,
   TensorBoard logs and the Perfetto trace are.

Tool schemas are left out of the prompt (`with_tools=False`): a character-level model pays per
character, and the demonstrations teach the call format directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from nonstop import perf
from nonstop.agentic.config import AgentConfig, LearnerConfig, OrchestratorConfig
from nonstop.agentic.envs import CalculatorEnv
from nonstop.agentic.envs.calculator import CalculatorConfig
from nonstop.agentic.orchestrator import EpisodeSpec, RolloutOrchestrator
from nonstop.agentic.parsers import get_parser
from nonstop.agentic.streaming import StreamingLearner
from nonstop.agentic.trajectory_builder import ChatInteraction
from nonstop.engine import Engine
from nonstop.models import Decoder, Tokenizer
from nonstop.perf import busy_fraction, read_events
from nonstop.recipes.char_tokenizer import char_tokenizer
from nonstop.rl import RLAlgorithmConfig
from nonstop.rl.config import KLConfig
from nonstop.rl.policy_trainer import PolicyTrainer, PolicyTrainerConfig
from nonstop.sft import SFTRunConfig, train
from nonstop.sft.config import CheckpointSettings, ModelSource, TokenizerSource
from nonstop.sft.data import DataConfig
from nonstop.train import MetricsConfig, OptimizerConfig, PackingConfig

RL_PHASE = "main/agentic_rl"
EVAL_SEED_OFFSET = 1_000_000  # held-out problems come from seeds the training never draws


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    run_dir: str = "runs/demo"
    seed: int = 0
    max_operand: int = 20
    sft_steps: int = 400
    sft_learning_rate: float = 3e-3
    rl_steps: int = 30
    rl_learning_rate: float = 1e-4
    group_size: int = 8
    groups_per_step: int = 8
    max_staleness: int = 1
    max_concurrency: int = 64
    eval_problems: int = 64
    hidden_size: int = 128
    num_layers: int = 3
    progress: bool = True

    @classmethod
    def quick(cls, run_dir: str) -> DemoConfig:
        """A shortened demo for tests."""
        return cls(run_dir=run_dir, sft_steps=60, rl_steps=4, eval_problems=24,
                   groups_per_step=4, group_size=4, progress=False)


def _interaction(env_cfg: CalculatorConfig, tokenizer: Tokenizer, task_seed: int,
                 episode_seed: int) -> ChatInteraction:
    env = CalculatorEnv(env_cfg)
    return ChatInteraction(env, tokenizer, get_parser("qwen"), task=env.sample_task(task_seed),
                           seed=episode_seed, with_tools=False)


def _agent_config(tokenizer: Tokenizer, temperature: float) -> AgentConfig:
    return AgentConfig(max_turns=3, max_tokens_per_turn=96, max_episode_tokens=200,
                       temperature=temperature, stop_token_ids=tuple(tokenizer.eos_ids),
                       step_timeout_s=30.0)


def write_demonstrations(path: Path, env_cfg: CalculatorConfig, n: int, seed: int) -> None:
    env = CalculatorEnv(env_cfg)
    with path.open("w") as f:
        for i in range(n):
            messages = [m.to_dict() for m in env.demonstration(env.sample_task(seed + i))]
            f.write(json.dumps({"messages": messages}) + "\n")


def supervised_phase(cfg: DemoConfig, tokenizer: Tokenizer, env_cfg: CalculatorConfig
                     ) -> Decoder:
    data = Path(cfg.run_dir) / "sft_data.jsonl"
    write_demonstrations(data, env_cfg, n=4000, seed=cfg.seed)
    sft = SFTRunConfig(
        run_dir=str(Path(cfg.run_dir) / "sft"), steps=cfg.sft_steps, seed=cfg.seed,
        model=ModelSource(family="qwen3", hidden_size=cfg.hidden_size,
                          intermediate_size=2 * cfg.hidden_size, num_layers=cfg.num_layers,
                          num_heads=4, num_kv_heads=2, head_dim=cfg.hidden_size // 4,
                          max_position_embeddings=512),
        tokenizer=TokenizerSource(kind="char", chat_format="qwen"),
        data=DataConfig(paths=(str(data),), kind="chat", num_epochs=None, seed=cfg.seed),
        packing=PackingConfig(buckets=(320,), rows_per_batch=8, max_segments_per_row=2,
                              overlong="truncate"),
        optimizer=OptimizerConfig(learning_rate=cfg.sft_learning_rate, schedule="constant",
                                  weight_decay=0.0),
        checkpoint=CheckpointSettings(save_every=max(cfg.sft_steps, 1)),
        metrics=MetricsConfig(progress_bar=cfg.progress), export=False)
    return train(sft, tokenizer=tokenizer).state.model()


async def solve_rate(engine: Engine, tokenizer: Tokenizer, env_cfg: CalculatorConfig,
                     problems: int) -> float:
    """Greedy episodes on held-out problems through the full agent loop."""
    def make(spec: EpisodeSpec) -> ChatInteraction:
        return _interaction(env_cfg, tokenizer, EVAL_SEED_OFFSET + spec.group_id, spec.seed)

    orchestrator = RolloutOrchestrator(engine, make, OrchestratorConfig(
        group_size=1, max_concurrency=problems, agent=_agent_config(tokenizer, 0.0)))
    with perf.span(perf.TRAIN_EVAL):
        groups = await orchestrator.run_groups(range(problems))
    await orchestrator.close()
    rewards = [t.reward or 0.0 for g in groups.values() for t in g]
    return float(np.mean(rewards))


async def _with_progress(learner: StreamingLearner, steps: int, show: bool) -> list:
    """Run the learner with a progress bar fed from its step records."""
    run = asyncio.create_task(learner.run(steps))
    with tqdm(total=steps, desc="agentic GRPO", unit="step", disable=not show) as bar:
        while not run.done():
            await asyncio.wait({run}, timeout=0.5)
            records = learner.records
            if len(records) > bar.n:
                bar.update(len(records) - bar.n)
                bar.set_postfix(reward=f"{records[-1].reward_mean:.2f}",
                                staleness=max(records[-1].staleness, default=0))
    return run.result()


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = char_tokenizer("qwen")
    env_cfg = CalculatorConfig(max_operand=cfg.max_operand)
    perf_dir = run_dir / "perf"
    with perf.run(perf_dir):
        model = supervised_phase(cfg, tokenizer, env_cfg)
        sft_seconds = time.perf_counter() - started
        algorithm = RLAlgorithmConfig.grpo()
        algorithm = dataclasses.replace(algorithm, policy_loss=dataclasses.replace(
            algorithm.policy_loss, kl=KLConfig(coef=0.0)))
        trainer = PolicyTrainer(model, PolicyTrainerConfig(
            algorithm=algorithm,
            optimizer=OptimizerConfig(learning_rate=cfg.rl_learning_rate, schedule="constant",
                                      weight_decay=0.0),
            packing=PackingConfig(buckets=(320,), rows_per_batch=16, max_segments_per_row=2,
                                  overlong="truncate"),
            seed=cfg.seed))
        learner_cfg = LearnerConfig(
            groups_per_step=cfg.groups_per_step, max_staleness=cfg.max_staleness,
            orchestrator=OrchestratorConfig(group_size=cfg.group_size,
                                            max_concurrency=cfg.max_concurrency, seed=cfg.seed,
                                            agent=_agent_config(tokenizer, 1.0)))

        def make(spec: EpisodeSpec) -> ChatInteraction:
            return _interaction(env_cfg, tokenizer, cfg.seed + spec.group_id, spec.seed)

        with Engine(trainer.model(), max_slots=cfg.max_concurrency, max_len=512,
                    tokenizer=tokenizer) as engine:
            before = asyncio.run(solve_rate(engine, tokenizer, env_cfg, cfg.eval_problems))
            rl_started = time.perf_counter()
            learner = StreamingLearner(trainer, engine, make, learner_cfg)
            with perf.span(RL_PHASE):
                records = asyncio.run(_with_progress(learner, cfg.rl_steps, cfg.progress))
            rl_seconds = time.perf_counter() - rl_started
            after = asyncio.run(solve_rate(engine, tokenizer, env_cfg, cfg.eval_problems))
    events = read_events(perf_dir).events
    phase = next(e for e in events if e.name == RL_PHASE)
    engine_busy = busy_fraction(events, perf.ENGINE, (phase.t0, phase.t1))
    summary = {
        "solve_rate_before_rl": before, "solve_rate_after_rl": after,
        "rl_steps": len(records), "train_reward_first": records[0].reward_mean if records else None,
        "train_reward_last": records[-1].reward_mean if records else None,
        "engine_busy_fraction": engine_busy,
        "sft_seconds": sft_seconds, "rl_seconds": rl_seconds,
        "seconds": time.perf_counter() - started,
        "run_dir": str(run_dir), "tensorboard": str(run_dir / "sft" / "tensorboard"),
        "trace": str(perf_dir / "trace.json"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
