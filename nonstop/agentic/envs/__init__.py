"""Built-in environments: calculator word problems, Python in a sandbox, a grid game, retrieval."""

from nonstop.agentic.envs.calculator import (
    CalculatorConfig,
    CalculatorEnv,
    calculator_tool,
    evaluate,
    make_problem,
)
from nonstop.agentic.envs.gridworld import GridWorldConfig, GridWorldEnv, shortest_path
from nonstop.agentic.envs.python_env import PythonEnv, PythonEnvConfig, format_result, python_tool
from nonstop.agentic.envs.retrieval import (
    BM25Index,
    Document,
    RetrievalEnv,
    contains_answer,
    generate_corpus,
    load_documents,
    search_tool,
)

__all__ = [
    "BM25Index",
    "CalculatorConfig",
    "CalculatorEnv",
    "Document",
    "GridWorldConfig",
    "GridWorldEnv",
    "PythonEnv",
    "PythonEnvConfig",
    "RetrievalEnv",
    "calculator_tool",
    "contains_answer",
    "evaluate",
    "format_result",
    "generate_corpus",
    "load_documents",
    "make_problem",
    "python_tool",
    "search_tool",
    "shortest_path",
]
