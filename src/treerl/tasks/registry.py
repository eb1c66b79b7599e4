"""Built-in tasks by name: ``get_task("addition", digits=3)``."""

from __future__ import annotations

import difflib
from typing import Any, Callable

from ..config import ConfigError
from .base import DatasetError, Task
from .calculator_env import CalculatorTask
from .math import JsonlTask
from .synthetic import AdditionTask, CountdownTask, SortingTask

_REGISTRY: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "countdown": CountdownTask,
    "calculator": CalculatorTask,
    "math_jsonl": JsonlTask,
}


class TaskError(ConfigError):
    """An unknown task name or missing task argument (a ValueError, one line)."""


class TaskArgumentError(ConfigError, TypeError):
    """A task constructor refused ``task.kwargs`` (also a TypeError)."""


def list_tasks() -> list[str]:
    """Names :func:`get_task` accepts."""
    return sorted(_REGISTRY)


def register_task(name: str, factory: Callable[..., Task], *, overwrite: bool = False) -> None:
    """Make ``get_task(name, **kwargs)`` call ``factory(**kwargs)``."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"task {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = factory


def get_task(name: str, **kwargs: Any) -> Task:
    """The built-in task ``name`` built with ``kwargs`` (``math_jsonl`` needs ``path=``)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TaskError(f"task.name: unknown task {name!r}{hint} (valid: {', '.join(list_tasks())})")
    if name == "math_jsonl" and "path" not in kwargs:
        raise TaskError("task 'math_jsonl' needs path=<a JSONL file with 'prompt' and 'answer'> "
                        "(set task.kwargs.path=FILE)")
    try:
        return factory(**kwargs)
    except DatasetError:
        raise
    except (TypeError, ValueError) as e:  # a constructor refusing its arguments (eval_fraction=1.0, ...)
        raise TaskArgumentError(f"task.kwargs: task {name!r}: {e}") from None
