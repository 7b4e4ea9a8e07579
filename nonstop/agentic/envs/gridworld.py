"""A small multi-turn grid game: move the agent `A` to the goal `G` around walls `#`.

Each turn the agent moves with the `move` tool (one or more calls, applied in order) or by writing
a direction (the last of up/down/left/right in its text). It sees the grid after every move. The
episode ends at the goal or after `max_steps` moves; the reward is `goal_reward` on reaching the
goal minus `step_penalty` per move taken (so shorter paths score higher), and `-step_penalty *
steps` otherwise. Layouts come from a seed and always have a path; the demonstration follows a
shortest one (breadth-first search).
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
from typing import Literal

from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    Split,
    StepResult,
    Task,
    draw_in_split,
)
from nonstop.agentic.tools import Tool, ToolSet
from nonstop.models.chat import Message, ToolCall
from nonstop.models.validation import check, check_int, check_ints

Direction = Literal["up", "down", "left", "right"]
DIRECTIONS: dict[Direction, tuple[int, int]] = {
    "up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)
}  # fmt: skip
_DIRECTION_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
Cell = tuple[int, int]  # (row, column)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GridWorldConfig:
    height: int = 4
    width: int = 5
    num_walls: int = 3
    max_steps: int = 16
    goal_reward: float = 1.0
    step_penalty: float = 0.02
    eval_fraction: float = 0.1  # layouts held out for evaluation (by a hash of the layout)

    def __post_init__(self) -> None:
        owner = "GridWorldConfig"
        check(isinstance(self.eval_fraction, float) and 0.0 < self.eval_fraction < 1.0, owner,
              "eval_fraction", self.eval_fraction, "a float in (0, 1), exclusive")
        check_ints(owner, self, ("height", "width"), low=2)
        most = self.height * self.width - 2  # the start and the goal stay free
        check(isinstance(self.num_walls, int) and 0 <= self.num_walls <= most, owner, "num_walls",
              self.num_walls, f"an int in [0, {most}] (height * width - 2 for a "
              f"{self.height}x{self.width} grid)")
        check_int(owner, "max_steps", self.max_steps)


def shortest_path(
    height: int, width: int, walls: frozenset[Cell], start: Cell, goal: Cell
) -> list[Direction] | None:
    """The moves of a shortest path from start to goal, or None if there is none."""
    previous: dict[Cell, tuple[Cell, Direction] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves: list[Direction] = []
            while previous[cell] is not None:
                cell, move = previous[cell]  # type: ignore[misc]
                moves.append(move)
            return moves[::-1]
        for name, (dr, dc) in DIRECTIONS.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < height and 0 <= nxt[1] < width and nxt not in walls:
                if nxt not in previous:
                    previous[nxt] = (cell, name)
                    queue.append(nxt)
    return None


def make_layout(rng: random.Random, config: GridWorldConfig) -> Task:
    cells = [(r, c) for r in range(config.height) for c in range(config.width)]
    while True:
        start, goal, *walls = rng.sample(cells, 2 + config.num_walls)
        path = shortest_path(config.height, config.width, frozenset(walls), start, goal)
        if path is not None and len(path) <= config.max_steps:
            break
    info = {"start": start, "goal": goal, "walls": tuple(sorted(walls)), "path": tuple(path)}
    grid = render(config, start, goal, frozenset(walls))
    prompt = f"Move A to G; # is a wall. Use the move tool.\n{grid}"
    return Task(prompt=prompt, answer=str(len(path)), info=info)


def render(config: GridWorldConfig, agent: Cell, goal: Cell, walls: frozenset[Cell]) -> str:
    rows = []
    for r in range(config.height):
        row = ""
        for c in range(config.width):
            cell = (r, c)
            row += "A" if cell == agent else "G" if cell == goal else "#" if cell in walls else "."
        rows.append(row)
    return "\n".join(rows)


class GridWorldEnv(Environment):
    system_prompt = "Reach the goal G in as few moves as possible."

    def __init__(self, config: GridWorldConfig | None = None):
        self.config = config or GridWorldConfig()
        self.tools = ToolSet([Tool(
            self._move, name="move", description="Move one cell: up, down, left or right.",
            parameters={"type": "object", "required": ["direction"], "properties": {
                "direction": {"type": "string", "enum": list(DIRECTIONS)}}},
            timeout_s=1.0,
        )])  # fmt: skip
        self.task: Task | None = None
        self.steps = 0
        self.done = False

    def sample_task(self, seed: int, split: Split = "train") -> Task:
        """A layout of `split` (the rendered grid, start to goal and walls, is what is hashed)."""
        return draw_in_split(lambda rng: make_layout(rng, self.config), random.Random(seed),
                             split, self.config.eval_fraction, owner="GridWorldEnv")

    async def reset(self, task: Task | None = None, *, seed: int = 0) -> Observation:
        self.task = task if task is not None else self.sample_task(seed)
        self.agent: Cell = tuple(self.task.info["start"])  # type: ignore[assignment]
        self.goal: Cell = tuple(self.task.info["goal"])  # type: ignore[assignment]
        self.walls = frozenset(tuple(w) for w in self.task.info["walls"])
        self.steps, self.done = 0, False
        return Observation(text=self.task.prompt, system=self.system_prompt, task=self.task)

    def grid(self) -> str:
        return render(self.config, self.agent, self.goal, self.walls)

    async def _move(self, direction: Direction) -> str:
        if self.done:
            return "The episode is over."
        self.steps += 1
        dr, dc = DIRECTIONS[direction]
        r, c = self.agent[0] + dr, self.agent[1] + dc
        blocked = not (0 <= r < self.config.height and 0 <= c < self.config.width)
        blocked = blocked or (r, c) in self.walls
        if not blocked:
            self.agent = (r, c)
        if self.agent == self.goal:
            self.done = True
            return f"{self.grid()}\nYou reached the goal."
        if self.steps >= self.config.max_steps:
            self.done = True
            return f"{self.grid()}\nOut of moves."
        return ("Blocked.\n" if blocked else "") + self.grid()

    async def step(self, action: AgentAction) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() before reset() or after the episode ended")
        if action.tool_calls or action.parse_errors:
            messages = []
            for call in action.tool_calls:  # in order: each move sees the one before
                if self.done:
                    break
                messages.append((await self.tools.call(call)).message())
            messages += [self.tools.parse_error_result(e).message() for e in action.parse_errors]
        else:
            words = _DIRECTION_WORD.findall(action.content)
            text = (
                await self._move(words[-1].lower())
                if words
                else ("Reply with a move: up, down, left or right.\n" + self.grid())
            )
            messages = [Message.user(text)]
        reward = self._reward() if self.done else None
        return StepResult(
            messages=tuple(messages),
            reward=reward,
            done=self.done,
            info={"steps": self.steps, "reached": self.agent == self.goal},
        )

    def _reward(self) -> float:
        reached = self.config.goal_reward if self.agent == self.goal else 0.0
        return reached - self.config.step_penalty * self.steps

    async def final_reward(self) -> float:
        return self._reward() if self.done else 0.0

    def demonstration(self, task: Task) -> list[Message]:
        """One move call per turn along a shortest path, each followed by the grid it produces."""
        config = self.config
        agent, goal = tuple(task.info["start"]), tuple(task.info["goal"])
        walls = frozenset(tuple(w) for w in task.info["walls"])
        messages = [Message.system(self.system_prompt), Message.user(task.prompt)]
        for i, move in enumerate(task.info["path"]):
            dr, dc = DIRECTIONS[move]
            agent = (agent[0] + dr, agent[1] + dc)
            call = ToolCall(name="move", arguments={"direction": move}, id=f"call_{i}")
            grid = render(config, agent, goal, walls)  # type: ignore[arg-type]
            text = f"{grid}\nYou reached the goal." if agent == goal else grid
            messages += [Message.assistant(tool_calls=[call]),
                         Message.tool(text, tool_call_id=call.id, name="move")]  # fmt: skip
        return messages
