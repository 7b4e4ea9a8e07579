"""Tasks solved by writing Python: a `python` tool runs the model's code in the Sandbox.

The tasks are small computations with one integer answer ("How many primes are there below 97?"),
drawn from a seed, each with reference code for its demonstration; the reward is 1 when the final
answer's last number is right. The tool reports stdout, stderr (tracebacks), a non-zero exit code
and a kill (timeout, CPU, output) to the model as text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal

from nonstop.agentic.environment import (
    Split,
    Task,
    ToolEnvironment,
    draw_in_split,
    numeric_reward,
)
from nonstop.agentic.sandbox import Sandbox, SandboxConfig, SandboxResult
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message, ToolCall
from nonstop.models.validation import check, check_int

# (question, reference code) templates; the code prints the answer.
_TEMPLATES = (
    ("What is the sum of the squares of the integers from 1 to {n}?",
     "print(sum(i * i for i in range(1, {n} + 1)))"),
    ("How many primes are there below {n}?",
     "print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))"),
    ("What is {a} to the power {b} modulo {m}?", "print(pow({a}, {b}, {m}))"),
    ("What is the {n}th Fibonacci number, with F(1) = F(2) = 1?",
     "a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a)"),
    ("How many integers from 1 to {n} are divisible by 3 or 7?",
     "print(sum(1 for i in range(1, {n} + 1) if i % 3 == 0 or i % 7 == 0))"),
)  # fmt: skip


def format_result(result: SandboxResult, max_chars: int = 4096) -> str:
    """The tool output the model sees for one run, at most `max_chars` long.

    The last line says how the run ended (killed and why, or a non-zero exit code); output too
    long to fit loses its middle, so that line, the start of stdout and the end of stderr (where a
    traceback's error is) always reach the model."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if result.killed_reason == "timeout":
        status = f"[killed: timed out after {result.duration_s:.1f}s]"
    elif result.killed_reason == "cpu_limit":
        status = "[killed: used up its CPU-time limit]"
    elif result.killed_reason == "output_limit":
        status = "[killed: printed more output than the sandbox allows]"
    elif result.killed_reason == "signal":
        status = f"[killed by signal {_signal_name(result.exit_code)}]"
    elif result.exit_code:
        status = f"[exit code {result.exit_code}]"
    else:
        status = "" if parts else "[no output]"
    body = "\n".join(parts)
    room = max_chars - len(status) - 1
    if len(body) > room:
        marker = f"\n[... {len(body) - room} chars cut ...]\n"
        keep = max(room - len(marker), 0)
        body = body[: keep - keep // 2] + marker + body[len(body) - keep // 2 :]
        body = body[: max(room, 0)]
    return "\n".join(p for p in (body, status) if p)[:max_chars]


def _signal_name(exit_code: int | None) -> str:
    with contextlib.suppress(TypeError, ValueError):
        return signal.Signals(-exit_code).name
    return str(exit_code)


_MAX_OUTPUT_CHARS = 4096


def python_tool(sandbox: Sandbox, *, timeout_s: float = 60.0) -> Tool:
    """A `python(code)` tool; `timeout_s` covers waiting for a sandbox slot plus the run."""

    async def python(code: str) -> str:
        return format_result(await sandbox.run(code), max_chars=_MAX_OUTPUT_CHARS)

    return Tool(
        python,
        name="python",
        description="Run a Python 3 script (standard library only) and return what it prints.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the script"}},
            "required": ["code"],
        },
        timeout_s=timeout_s,
        max_output_chars=_MAX_OUTPUT_CHARS,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonEnvConfig:
    max_n: int = 60
    max_turns: int = 4
    eval_fraction: float = 0.1  # questions held out for evaluation (by a hash of the question)

    def __post_init__(self) -> None:
        check_int("PythonEnvConfig", "max_n", self.max_n, low=10)
        check_int("PythonEnvConfig", "max_turns", self.max_turns)
        check(
            isinstance(self.eval_fraction, float) and 0.0 < self.eval_fraction < 1.0,
            "PythonEnvConfig",
            "eval_fraction",
            self.eval_fraction,
            "a float in (0, 1), exclusive",
        )


def reference_answer(code: str) -> str:
    """Run reference code in-process (it is ours, not the model's) and return what it prints."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue().strip()


def make_task(rng: random.Random, config: PythonEnvConfig) -> Task:
    question, code = rng.choice(_TEMPLATES)
    values = {"n": rng.randint(10, config.max_n), "a": rng.randint(2, 99),
              "b": rng.randint(10, 999), "m": rng.randint(7, 997)}  # fmt: skip
    code = code.format(**values)
    return Task(prompt=question.format(**values), answer=reference_answer(code),
                info={"code": code})  # fmt: skip


_SHARED: Sandbox | None = None


def shared_sandbox() -> Sandbox:
    """One process-wide Sandbox (its semaphore bounds concurrency across all PythonEnvs)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = Sandbox(SandboxConfig())
    return _SHARED


class PythonEnv(ToolEnvironment):
    system_prompt = "Use the python tool to compute the answer, then give the final number."

    def __init__(
        self,
        config: PythonEnvConfig | None = None,
        *,
        sandbox: Sandbox | None = None,
        tools: ToolSet | None = None,
    ):
        self.config = config or PythonEnvConfig()
        self.sandbox = sandbox or shared_sandbox()
        super().__init__(
            tools=tools or ToolSet([python_tool(self.sandbox)]),
            reward_fn=numeric_reward,
            max_turns=self.config.max_turns,
        )

    def sample_task(self, seed: int, split: Split = "train") -> Task:
        """A question of `split` (by a hash of the question)."""
        return draw_in_split(
            lambda rng: make_task(rng, self.config),
            random.Random(seed),
            split,
            self.config.eval_fraction,
            owner="PythonEnv",
        )

    def demonstration(self, task: Task) -> list[Message]:
        call = ToolCall(name="python", arguments={"code": task.info["code"]}, id="call_0")
        return [
            Message.system(self.system_prompt),
            Message.user(task.prompt),
            Message.assistant(tool_calls=[call]),
            Message.tool(task.answer + "\n", tool_call_id="call_0", name="python"),
            Message.assistant(task.answer),
        ]
