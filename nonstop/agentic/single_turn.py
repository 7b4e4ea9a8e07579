"""Single-turn RL as agentic episodes: a prompt, one model turn, a reward. No tool calls.

    examples = ExampleStream(task.iter_examples("train", seed))
    make = PromptEpisodes(tokenizer, examples, task.reward, prompt_format="raw")
    learner = StreamingLearner(trainer, engine, make, config)   # the one learner of every RL run

`nonstop rl` runs through the same orchestrator, group queue and streaming learner as
`nonstop agentic`; this module is the single-turn part. Group g is the g-th example of the
stream (all its G episodes answer it), so a resumed run that continues at group id n continues
the same stream. The reward is the task's `Reward` on the decoded completion (stop and special
tokens dropped), run through `evaluate_rewards` (a sync reward runs in a worker thread, off the
event loop) with `reward_on_error`: "skip" fails the episode, so the queue drops its group;
"zero" scores the failed term 0; "raise" stops the run (`PromptEpisodes.fatal`).

`greedy_reward` is the held-out evaluation: the mean reward of greedy completions.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator, Sequence

import numpy as np

from nonstop import perf
from nonstop.agentic.orchestrator import EpisodeSpec
from nonstop.agentic.trajectory_builder import Interaction, TurnResult
from nonstop.engine import FinishReason, RolloutClient, SamplingParams
from nonstop.models import Tokenizer
from nonstop.rl.prompts import PromptFormat, answer_text, encode_prompt
from nonstop.rl.rewards import Example, OnError, Reward, RewardError, evaluate_rewards


class ExampleStream:
    """Random access by group id into an endless example stream: `stream[g]` is its g-th
    example. Ids are asked for in roughly increasing order (groups start in id order), so only
    the last `window` examples are kept."""

    def __init__(self, examples: Iterator[Example], *, window: int = 1 << 16) -> None:
        self._it = examples
        self._kept: collections.OrderedDict[int, Example] = collections.OrderedDict()
        self._next = 0  # index of the next example the iterator yields
        self.window = window
        self.consumed = 0  # 1 + the highest group id handed out: where a resumed run continues

    def __getitem__(self, group_id: int) -> Example:
        if group_id < self._next - self.window:
            raise IndexError(f"example {group_id} was dropped from the window (examples "
                             f"{self._next - self.window}..{self._next - 1} are kept)")
        while self._next <= group_id:
            self._kept[self._next] = next(self._it)
            self._next += 1
            if len(self._kept) > self.window:
                self._kept.popitem(last=False)
        self.consumed = max(self.consumed, group_id + 1)
        return self._kept[group_id]


class PromptInteraction(Interaction):
    """One prompt, one model turn, then done; the reward scores the decoded completion."""

    def __init__(self, prompt_ids: Sequence[int], example: Example, owner: PromptEpisodes
                 ) -> None:
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.example = example
        self.owner = owner
        self.sampled: list[int] = []

    async def start(self) -> Sequence[int]:
        return self.prompt_ids

    async def step(self, sampled: Sequence[int], finish_reason: FinishReason) -> TurnResult:
        self.sampled = [int(t) for t in sampled]
        return TurnResult(tokens=(), done=True)

    async def reward(self) -> float:
        return await self.owner.score(self.example, self.sampled)


class PromptEpisodes:
    """The interaction factory of single-turn RL: group g answers `examples[g]`."""

    def __init__(self, tokenizer: Tokenizer, examples: ExampleStream, reward: Reward, *,
                 prompt_format: PromptFormat = "raw", add_bos: bool = False,
                 reward_on_error: OnError = "skip") -> None:
        self.tokenizer = tokenizer
        self.examples = examples
        self.reward = reward
        self.prompt_format = prompt_format
        self.add_bos = add_bos
        self.reward_on_error = reward_on_error
        self.failures: collections.Counter[str] = collections.Counter()  # "name/reason" -> n
        self.fatal: asyncio.Future[RewardError] | None = None  # set by `raise`; see `watch`
        self._prompts: dict[int, list[int]] = {}

    def __call__(self, spec: EpisodeSpec) -> PromptInteraction:
        example = self.examples[spec.group_id]
        ids = self._prompts.get(spec.group_id)
        if ids is None:  # the G episodes of a group share one encoding
            ids = encode_prompt(self.tokenizer, example.prompt, self.prompt_format, self.add_bos)
            self._prompts = {spec.group_id: ids}
        return PromptInteraction(ids, example, self)

    async def score(self, example: Example, sampled: Sequence[int]) -> float:
        """The reward of one completion; a failure follows `reward_on_error`."""
        on_error = "skip" if self.reward_on_error == "raise" else self.reward_on_error
        result = await evaluate_rewards(self.reward, [example.prompt],
                                        [answer_text(self.tokenizer, sampled)], [example],
                                        on_error=on_error)
        for (name, reason), n in result.failure_counts.items():
            self.failures[f"{name}/{reason}"] += n
        if result.valid[0]:
            return float(result.rewards[0])
        cause = "; ".join(f"{f.reward}: {f.reason}: {f.message}" for f in result.failures)
        if self.reward_on_error == "raise":
            error = RewardError(f"the reward failed on example {example.id!r} "
                                f"({example.prompt!r}): {cause}; set reward_on_error=skip to "
                                "drop the episode's group, or zero to score it 0")
            if self.fatal is not None and not self.fatal.done():
                self.fatal.set_result(error)
            raise error
        raise ValueError(f"reward_on_error=skip: {cause}")  # the episode fails, its group drops

    async def watch(self, run: asyncio.Future) -> object:
        """Await `run` (the learner), unless a reward fails first under `raise`: then cancel it
        and raise that `RewardError`."""
        self.fatal = asyncio.get_running_loop().create_future()
        done, _ = await asyncio.wait({run, self.fatal}, return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            return run.result()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        raise self.fatal.result()


async def greedy_reward(engine: RolloutClient, tokenizer: Tokenizer, examples: Sequence[Example],
                        reward: Reward, *, max_new_tokens: int, prompt_format: PromptFormat = "raw",
                        add_bos: bool = False, step: int | None = None) -> float:
    """Mean reward of greedy completions of `examples` (a failed reward scores 0)."""
    prompts = [encode_prompt(tokenizer, e.prompt, prompt_format, add_bos) for e in examples]
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                            stop_token_ids=tuple(tokenizer.eos_ids))
    with perf.span(perf.TRAIN_EVAL, step=step):
        completions = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        texts = [answer_text(tokenizer, c.tokens) for c in completions]
        result = await evaluate_rewards(reward, [e.prompt for e in examples], texts,
                                        list(examples), on_error="zero")
    return float(np.mean(result.rewards))


__all__ = ["ExampleStream", "PromptEpisodes", "PromptFormat", "PromptInteraction",
           "answer_text", "encode_prompt", "greedy_reward"]
