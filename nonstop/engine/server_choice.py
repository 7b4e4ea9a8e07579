"""One choice of an OpenAI request as the server (nonstop.engine.server) streams it in from the
engine: its prompt, sampling parameters, tokens and incrementally detokenized text, the text
visible so far (cut at stop strings), its logprobs and policy versions, how much of it a
stream has already sent, and the nonstop fields (`extras`) its responses carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nonstop.engine import openai_protocol as wire
from nonstop.engine.detokenize import IncrementalText
from nonstop.engine.sampling import SamplingParams
from nonstop.engine.types import Completion


@dataclasses.dataclass(eq=False)
class Choice:
    """One generation (a choice of a request) as it streams in from the engine."""

    index: int
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    text: IncrementalText
    stop: tuple[str, ...]
    arrival: float
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    completion: Completion | None = None
    sent: int = 0  # characters of visible text already sent (streaming)
    emitted: int = 0  # tokens already sent (streaming)
    last_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    def visible(self) -> str:
        """The text that can be shown now: cut before a stop string and, while the generation
        runs, without the tail a stop string could still start in."""
        text = self.text.text
        if self.completion is not None:
            why = self.completion.stop_reason
            cut = text.find(why) if isinstance(why, str) else -1
            return text if cut < 0 else text[:cut]
        cut = min((p for s in self.stop if (p := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            return text[:cut]
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return text[: len(text) - hold]

    @property
    def finish_reason(self) -> str:
        assert self.completion is not None
        return wire.WIRE_FINISH_REASONS.get(self.completion.finish_reason, "stop")

    def extras(self, start: int, stop: int, return_token_ids: bool, *, final: bool
               ) -> dict[str, Any]:
        """The nonstop fields a response carries for tokens [start, stop) of this choice: their
        policy versions, token ids if asked, and at the end why it stopped."""
        extras: dict[str, Any] = {"policy_versions": self.versions[start:stop]}
        if return_token_ids:
            extras["token_ids"] = self.tokens[start:stop]
            if start == 0:
                extras["prompt_token_ids"] = list(self.prompt_tokens)
        if final:
            assert self.completion is not None
            extras["stop_reason"] = self.completion.stop_reason
            extras["engine_finish_reason"] = self.completion.finish_reason
        return extras


__all__ = ["Choice"]
