"""Built-in tasks that make their own data (arithmetic, countdown) or load it (GSM8K-style files),
each with its reward and SFT demonstrations."""

from nonstop.recipes.tasks.arithmetic import ArithmeticOp, ArithmeticTask
from nonstop.recipes.tasks.base import GeneratedTask, Split, Task, TaskError, seeded_rng, split_of
from nonstop.recipes.tasks.countdown import CountdownTask, CountdownVerdict, check_countdown
from nonstop.recipes.tasks.expression import (
    Evaluated,
    ExpressionError,
    Operator,
    evaluate_expression,
)
from nonstop.recipes.tasks.gsm8k import Gsm8kTask, load_gsm8k
from nonstop.rl.rewards import Example

__all__ = [
    "ArithmeticOp",
    "ArithmeticTask",
    "CountdownTask",
    "CountdownVerdict",
    "Evaluated",
    "Example",
    "ExpressionError",
    "GeneratedTask",
    "Gsm8kTask",
    "Operator",
    "Split",
    "Task",
    "TaskError",
    "check_countdown",
    "evaluate_expression",
    "load_gsm8k",
    "seeded_rng",
    "split_of",
]
