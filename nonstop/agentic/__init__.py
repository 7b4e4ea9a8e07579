"""Agentic RL: tools, tool-call parsers, environments, the sandbox, built-in environments, and the
asynchronous rollout pipeline."""

from nonstop.agentic.agent import Agent, StepTimeoutError, derive_seed
from nonstop.agentic.config import (
    AgentConfig,
    GroupQueueConfig,
    OrchestratorConfig,
    StreamingLearnerConfig,
)
from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    StepResult,
    Task,
    ToolEnvironment,
)
from nonstop.agentic.group_queue import GroupQueue, QueueClosed, ScoredGroup
from nonstop.agentic.orchestrator import (
    Admission,
    EpisodeSpec,
    LoopLagMonitor,
    OrchestratorClosed,
    RolloutOrchestrator,
)
from nonstop.agentic.parsers import (
    GemmaParser,
    Llama3Parser,
    ParsedTurn,
    ParseError,
    QwenParser,
    ToolCallParser,
    get_parser,
    parse_tool_calls,
)
from nonstop.agentic.ray_backend import (
    EnvironmentActorDied,
    RayEnvConfig,
    RayEnvironment,
    RayEnvironmentPool,
    init_ray,
)
from nonstop.agentic.sandbox import Sandbox, SandboxConfig, SandboxResult, SandboxUnavailable
from nonstop.agentic.single_turn import ExampleStream, PromptEpisodes, PromptInteraction
from nonstop.agentic.streaming import (
    EpisodesFailingError,
    NoSamplesError,
    NoVarianceError,
    StalenessGate,
    StepRecord,
    StreamingLearner,
    SyncLearner,
)
from nonstop.agentic.tools import Tool, ToolError, ToolErrorKind, ToolResult, ToolSet
from nonstop.agentic.trajectory_builder import (
    ChatInteraction,
    Interaction,
    ScriptedToolInteraction,
    TurnResult,
)

__all__ = [
    "NoSamplesError",
    "Agent",
    "AgentConfig",
    "GroupQueueConfig",
    "StreamingLearnerConfig",
    "OrchestratorConfig",
    "GroupQueue",
    "QueueClosed",
    "ScoredGroup",
    "Admission",
    "EpisodeSpec",
    "LoopLagMonitor",
    "OrchestratorClosed",
    "RolloutOrchestrator",
    "StalenessGate",
    "StepRecord",
    "StreamingLearner",
    "ExampleStream",
    "NoVarianceError",
    "EpisodesFailingError",
    "PromptEpisodes",
    "PromptInteraction",
    "SyncLearner",
    "ChatInteraction",
    "Interaction",
    "ScriptedToolInteraction",
    "TurnResult",
    "StepTimeoutError",
    "derive_seed",
    "AgentAction",
    "Environment",
    "GemmaParser",
    "Llama3Parser",
    "Observation",
    "ParseError",
    "ParsedTurn",
    "QwenParser",
    "EnvironmentActorDied",
    "RayEnvConfig",
    "RayEnvironment",
    "RayEnvironmentPool",
    "init_ray",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "StepResult",
    "Task",
    "Tool",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolError",
    "ToolErrorKind",
    "ToolResult",
    "ToolSet",
    "get_parser",
    "parse_tool_calls",
]
