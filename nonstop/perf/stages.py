"""The names nonstop records under: RL stages, the role each belongs to, counters and tag keys.

Every part of nonstop records through these constants, so the timeline, the TensorBoard scalars,
the XProf annotations and the later `nonstop report` all speak the same names. A name is
`"<prefix>/<what>"`; its *role* is the track it is drawn on and the unit whose busy/idle time is
measured:

- `engine`  — the inference engine's scheduler thread: prefill and decode device steps.
- `rollout` — episodes (asyncio tasks): waiting for a slot, tools, environments, rewards.
- `trainer` — the learner: waiting for data, optimizer steps, weight sync, checkpoints, evals.

Known stages map to their role through `STAGES`; any other name takes its prefix as role
(`"bench/warmup"` → `"bench"`), and a name without a slash goes to `"main"`. Each stage also has
a *kind*: `device` (work on the accelerator), `host` (work on the CPU) or `wait` (blocked on
someone else). Device-busy intervals are their own spans, `"<role>/device_busy"`, taken exactly
at the jitted call and its `block_until_ready`, so busy fractions do not depend on how widely a
caller draws its stage span.
"""

import dataclasses
from typing import Literal

StageKind = Literal["device", "host", "wait"]

ENGINE = "engine"
ROLLOUT = "rollout"
TRAINER = "trainer"
MAIN = "main"

# Rollout: one episode's life, plus the engine's device steps that serve it.
ROLLOUT_QUEUE_WAIT = "rollout/queue_wait"
ROLLOUT_PREFILL = "rollout/prefill"
ROLLOUT_DECODE = "rollout/decode"
ROLLOUT_TOOL_WAIT = "rollout/tool_wait"
ROLLOUT_ENV = "rollout/env"
ROLLOUT_REWARD = "rollout/reward"
ROLLOUT_GENERATE = "rollout/generate"  # an episode awaiting the engine for one turn

# Training.
TRAIN_DATA_WAIT = "train/data_wait"
TRAIN_STEP = "train/step"
TRAIN_WEIGHT_SYNC = "train/weight_sync"
TRAIN_CHECKPOINT = "train/checkpoint"
TRAIN_EVAL = "train/eval"

DEVICE_BUSY = "device_busy"
ENGINE_BUSY = f"{ENGINE}/{DEVICE_BUSY}"
TRAINER_BUSY = f"{TRAINER}/{DEVICE_BUSY}"

# Counters (perf.count): summed over a window they give rates.
ENGINE_TOKENS = "engine/tokens"  # generated tokens
ROLLOUT_EPISODES = "rollout/episodes"  # finished episodes
ROLLOUT_EPISODE_STATUS = "rollout/episode_status"  # finished episodes, tagged status=...
TRAIN_TOKENS = "train/tokens"  # tokens consumed by optimizer steps
TRAIN_FLOPS = "train/flops"  # model FLOPs of optimizer steps (for MFU)

# Gauges (perf.gauge): each call is one sample.
TRAIN_STALENESS = "train/staleness"  # policy versions between sampling and training, per episode
ENGINE_QUEUE_DEPTH = "engine/queue_depth"  # requests waiting for a slot
ENGINE_ACTIVE_SLOTS = "engine/active_slots"
GROUP_QUEUE_DEPTH = "rollout/group_queue_depth"  # complete groups waiting for the trainer

# Tag keys every caller uses for the same thing.
TAG_STEP = "step"
TAG_POLICY_VERSION = "policy_version"
TAG_EPISODE = "episode"
TAG_GROUP = "group"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One named stage: the role whose track it is drawn on and what kind of time it is."""

    name: str
    role: str
    kind: StageKind

    def __post_init__(self) -> None:
        if self.kind not in ("device", "host", "wait"):
            _fail("kind", self.kind, f"one of 'device', 'host', 'wait' (stage {self.name!r})")
        for field in ("name", "role"):
            if not getattr(self, field):
                _fail(field, getattr(self, field), "a non-empty string")


def _fail(field: str, value: object, valid: str) -> None:
    """Raise `nonstop.models.validation.invalid` for Stage, imported only to raise: importing
    nonstop.models pulls in jax, and importing perf must not."""
    from nonstop.models.validation import invalid

    raise invalid("Stage", field, value, valid)


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage(name=ROLLOUT_QUEUE_WAIT, role=ROLLOUT, kind="wait"),
        Stage(name=ROLLOUT_PREFILL, role=ENGINE, kind="device"),
        Stage(name=ROLLOUT_DECODE, role=ENGINE, kind="device"),
        Stage(name=ROLLOUT_TOOL_WAIT, role=ROLLOUT, kind="wait"),
        Stage(name=ROLLOUT_ENV, role=ROLLOUT, kind="host"),
        Stage(name=ROLLOUT_REWARD, role=ROLLOUT, kind="host"),
        Stage(name=TRAIN_DATA_WAIT, role=TRAINER, kind="wait"),
        Stage(name=TRAIN_STEP, role=TRAINER, kind="device"),
        Stage(name=TRAIN_WEIGHT_SYNC, role=TRAINER, kind="wait"),
        Stage(name=TRAIN_CHECKPOINT, role=TRAINER, kind="host"),
        Stage(name=TRAIN_EVAL, role=TRAINER, kind="device"),
        Stage(name=ENGINE_BUSY, role=ENGINE, kind="device"),
        Stage(name=TRAINER_BUSY, role=TRAINER, kind="device"),
    )
}

_PREFIX_ROLES = {"train": TRAINER}
_role_cache: dict[str, str] = {}


def role_of(name: str) -> str:
    """The role (track) a stage, counter or gauge name belongs to."""
    role = _role_cache.get(name)
    if role is None:
        stage = STAGES.get(name)
        if stage is not None:
            role = stage.role
        elif "/" in name:
            prefix = name.split("/", 1)[0]
            role = _PREFIX_ROLES.get(prefix, prefix)
        else:
            role = MAIN
        if len(_role_cache) < 65536:  # names are a small closed set; never grow without bound
            _role_cache[name] = role
    return role


def device_busy_name(role: str) -> str:
    """The span name of `role`'s device-busy intervals, e.g. `"engine/device_busy"`."""
    return f"{role}/{DEVICE_BUSY}"


def is_device_busy(name: str) -> bool:
    return name.endswith("/" + DEVICE_BUSY)


def idle_causes(role: str) -> list[str]:
    """Default stages that explain `role`'s idle time, most specific first: its waits, then host
    work (a trainer blocked on data is idle *because of* data, even while it checkpoints)."""
    waits = [s.name for s in STAGES.values() if s.role == role and s.kind == "wait"]
    host = [s.name for s in STAGES.values() if s.role == role and s.kind == "host"]
    device = [
        s.name
        for s in STAGES.values()
        if s.role == role and s.kind == "device" and not is_device_busy(s.name)
    ]
    return waits + host + device
