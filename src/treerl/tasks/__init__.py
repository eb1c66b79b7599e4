"""Tasks, rewards and environments: synthetic tasks for tiny models, JSONL math datasets,
multi-turn environments whose per-turn sequences extend each other, a character tokenizer.

A reward is a callable ``reward(prompt, completion, **sample_fields) -> float``; use
:func:`score` to call one over a batch with clear errors.
"""

from .arith import Evaluation, ExpressionError, evaluate, format_number
from .base import (
    Problem,
    RewardError,
    RewardFn,
    SingleTurnEnv,
    SyntheticTask,
    Task,
    check_reward_value,
    score,
    score_problems,
)
from .calculator_env import CalculatorEnv, CalculatorTask
from .env import (
    BatchPolicy,
    ChatFormat,
    Environment,
    Episode,
    EpisodeRunner,
    Policy,
    TurnSequence,
    run_episode,
    run_episodes,
    scripted_policy,
)
from .math import (
    DatasetError,
    JsonlTask,
    MathTask,
    answers_match,
    check_answer,
    extract_answer,
    extract_boxed,
    last_number,
    load_jsonl,
    math_reward,
    parse_number,
    reference_answer,
)
from .registry import get_task, list_tasks, register_task
from .synthetic import AdditionTask, CountdownTask, SortingTask
from .tokenizer import DEFAULT_ALPHABET, SPECIAL_TOKENS, CharTokenizer

__all__ = [
    "AdditionTask", "BatchPolicy", "CalculatorEnv", "CalculatorTask", "ChatFormat", "CharTokenizer",
    "CountdownTask", "DEFAULT_ALPHABET", "DatasetError", "Environment", "Episode", "EpisodeRunner",
    "Evaluation", "ExpressionError", "JsonlTask", "MathTask", "Policy", "Problem", "RewardError", "RewardFn",
    "SPECIAL_TOKENS", "SingleTurnEnv", "SortingTask", "SyntheticTask", "Task", "TurnSequence",
    "answers_match", "check_answer", "check_reward_value", "evaluate", "extract_answer", "extract_boxed",
    "format_number", "get_task", "last_number", "list_tasks", "load_jsonl", "math_reward", "parse_number",
    "reference_answer", "register_task", "run_episode", "run_episodes", "score", "score_problems",
    "scripted_policy",
]
