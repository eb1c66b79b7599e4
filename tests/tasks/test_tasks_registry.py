"""Registry, reward scoring errors, and the safe arithmetic evaluator."""

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from treerl.tasks import (
    AdditionTask,
    CalculatorTask,
    CountdownTask,
    ExpressionError,
    Problem,
    RewardError,
    SortingTask,
    Task,
    evaluate,
    format_number,
    get_task,
    list_tasks,
    register_task,
    score,
    score_problems,
)


# ---------------------------------------------------------------------------- registry
def test_get_task_builtins():
    assert isinstance(get_task("addition", digits=3), AdditionTask) and get_task("addition", digits=3).digits == 3
    assert isinstance(get_task("sorting"), SortingTask)
    assert isinstance(get_task("countdown"), CountdownTask)
    assert isinstance(get_task("calculator"), CalculatorTask)
    assert set(list_tasks()) >= {"addition", "sorting", "countdown", "calculator", "math_jsonl"}
    for name in list_tasks():
        if name != "math_jsonl":
            assert isinstance(get_task(name), Task) and get_task(name).name == name


@pytest.mark.parametrize("typo, suggestion", [("additon", "addition"), ("sort", "sorting"), ("count_down", "countdown"),
                                              ("calculater", "calculator"), ("math", "math_jsonl")])
def test_unknown_task_suggests(typo, suggestion):
    with pytest.raises(ValueError, match=f"unknown task '{typo}'; did you mean '{suggestion}'"):
        get_task(typo)


def test_registry_errors_and_registration():
    with pytest.raises(ValueError, match=r"unknown task 'zzzzzz' \(valid: addition"):
        get_task("zzzzzz")
    with pytest.raises(ValueError, match="needs path="):
        get_task("math_jsonl")
    with pytest.raises(TypeError, match="task 'addition'.*digitz"):
        get_task("addition", digitz=3)
    register_task("addition_3", lambda **kw: AdditionTask(digits=3, **kw))
    assert get_task("addition_3").digits == 3
    with pytest.raises(ValueError, match="already registered"):
        register_task("addition_3", AdditionTask)


# ---------------------------------------------------------------------------- score
def test_score_passes_fields_and_accepts_numeric_scalars():
    def reward(prompt, completion, answer, bonus=0.0):
        return float(completion == answer) + bonus

    assert score(reward, ["a", "b"], ["1", "2"], [{"answer": "1"}, {"answer": "3", "bonus": 0.5}]) == [1.0, 0.5]
    problems = [Problem("a", "1"), Problem("b", "2", {"bonus": 0.25})]
    assert score_problems(reward, problems, ["1", "2"]) == [1.0, 1.25]
    for value in (1, np.float32(0.5), np.float64(0.5), torch.tensor(0.5), np.int64(1)):
        assert score(lambda p, c: value, ["x"], ["y"]) == [float(value)]
    task = AdditionTask()
    assert score(task.reward, ["1+2=", "1+2="], ["3", "4"]) == [1.0, 0.0]


def failing_reward(prompt, completion, **kw):
    if completion == "boom":
        raise KeyError("missing")
    return {"nan": float("nan"), "inf": float("inf"), "-inf": -math.inf, "none": None, "str": "1.0",
            "bool": True, "list": [1.0], "vec": torch.tensor([0.5, 0.5])}.get(completion, 1.0)


@pytest.mark.parametrize(
    "bad, pattern",
    [
        ("boom", r"raised on sample 2 \(prompt 'prompt 2'.*KeyError: 'missing'"),
        ("nan", r"sample 2 \(prompt 'prompt 2'\) returned nan"),
        ("inf", r"sample 2 .* returned inf"),
        ("-inf", r"sample 2 .* returned -inf"),
        ("none", r"sample 2 .* returned NoneType None"),
        ("str", r"sample 2 .* returned str '1.0'"),
        ("bool", r"sample 2 .* returned bool"),
        ("list", r"sample 2 .* returned list"),
        ("vec", r"sample 2 .* returned Tensor"),
    ],
)
def test_score_names_the_failing_sample(bad, pattern):
    prompts = [f"prompt {i}" for i in range(4)]
    completions = ["ok", "ok", bad, "ok"]
    with pytest.raises(RewardError, match=pattern) as info:
        score(failing_reward, prompts, completions)
    assert "failing_reward" in str(info.value)


def test_score_truncates_long_prompts_and_checks_lengths():
    long_prompt = "x" * 500
    with pytest.raises(RewardError) as info:
        score(lambda p, c: float("nan"), [long_prompt], ["c"])
    assert len(str(info.value)) < 200 and "..." in str(info.value)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        score(lambda p, c: 1.0, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="1 field dicts"):
        score(lambda p, c: 1.0, ["a", "b"], ["c", "d"], [{}])
    with pytest.raises(RewardError, match="sample 0: field 'completion' collides"):
        score(lambda p, c, **kw: 1.0, ["a"], ["c"], [{"completion": "x"}])


def test_task_reward_error_through_score():
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'bad'.*ValueError: addition: prompt 'bad'"):
        score(AdditionTask().reward, ["1+1=", "bad"], ["2", "2"])


# ---------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "text, value, literals",
    [
        ("1+2*3", 7, [1, 2, 3]),
        ("(1+2)*3", 9, [1, 2, 3]),
        ("10-4-3", 3, [10, 4, 3]),
        ("2*3-4*5", -14, [2, 3, 4, 5]),
        ("8/4/2", 1, [8, 4, 2]),
        ("7/2", Fraction(7, 2), [7, 2]),
        ("-3+5", 2, [3, 5]),
        ("--3", 3, [3]),
        ("-(2+3)*2", -10, [2, 3, 2]),
        (" 12 * ( 3 + 4 ) ", 84, [12, 3, 4]),
        ("007", 7, [7]),
    ],
)
def test_evaluate(text, value, literals):
    ev = evaluate(text)
    assert ev.value == value and ev.literals == literals


@pytest.mark.parametrize(
    "text", ["", "1+", "(1", "1)", "()", "1 2", "2**3", "1/0", "1/(2-2)", "1.5", "a", "__import__('os')",
             "1e3", "1+" * 200 + "1", "9" * 31, "(" * 100 + "1" + ")" * 100 + "+" * 60]
)
def test_evaluate_rejects(text):
    with pytest.raises(ExpressionError):
        evaluate(text)


def test_evaluate_options_and_format():
    with pytest.raises(ExpressionError, match="unary"):
        evaluate("-3", allow_unary=False)
    with pytest.raises(ExpressionError, match="'/'"):
        evaluate("6/3", allow_division=False)
    assert evaluate("(" * 100 + "1" + ")" * 100).value == 1  # deep nesting within the length limit
    assert [format_number(Fraction(x)) for x in (408, -3)] == ["408", "-3"] and format_number(Fraction(7, 2)) == "7/2"


def test_evaluate_matches_python_on_random_expressions():
    rng = random.Random(0)

    def gen(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.randint(0, 99))
        form = rng.randrange(3)
        if form == 0:
            return f"({gen(depth - 1)})"
        return gen(depth - 1) + rng.choice("+-*") + gen(depth - 1)

    for _ in range(500):
        text = gen(4)
        assert evaluate(text).value == eval(text)  # noqa: S307 - generated digits/operators only
