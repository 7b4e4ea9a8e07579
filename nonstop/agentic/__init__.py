"""Agentic RL: tools, tool-call parsers, environments, the sandbox, built-in environments, and the
asynchronous rollout pipeline."""

from nonstop.agentic.environment import (
    AgentAction,
    Environment,
    Observation,
    StepResult,
    Task,
    ToolEnvironment,
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
from nonstop.agentic.sandbox import Sandbox, SandboxConfig, SandboxResult
from nonstop.agentic.tools import Tool, ToolError, ToolErrorKind, ToolResult, ToolSet

__all__ = [
    "AgentAction",
    "Environment",
    "GemmaParser",
    "Llama3Parser",
    "Observation",
    "ParseError",
    "ParsedTurn",
    "QwenParser",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
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
