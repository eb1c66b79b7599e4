"""Synthetic tasks: hand-written reward cases, randomised checks against independent oracles,
determinism and train/eval separation."""

import itertools
import random
import re

import pytest

from treerl.tasks import AdditionTask, CalculatorTask, CountdownTask, Problem, SortingTask, get_task

TASKS = ["addition", "sorting", "countdown", "calculator"]


def oracle_eval(expr: str) -> int:
    """Independent evaluator for the tests: Python on strings of digits and operators only."""
    assert re.fullmatch(r"[0-9+\-*/() ]+", expr), expr
    return eval(expr)  # noqa: S307 - sanitised above, test-only oracle


# ---------------------------------------------------------------------------- addition
@pytest.mark.parametrize(
    "completion, expected",
    [("46", 1.0), (" 46 ", 1.0), ("46\nblah", 1.0), ("45", 0.0), ("046", 0.0), ("4 6", 0.0), ("", 0.0), ("abc", 0.0),
     ("46+0", 0.0), ("-46", 0.0)],
)
def test_addition_cases(completion, expected):
    assert AdditionTask().reward("12+34=", completion) == expected


def test_addition_format_reward_and_bad_prompt():
    task = AdditionTask(format_reward=0.1)
    assert task.reward("12+34=", "45") == 0.1
    assert task.reward("12+34=", "x") == 0.0
    assert task.reward("12+34=", "46") == 1.0
    assert task.is_correct("12+34=", "46") and not task.is_correct("12+34=", "45")
    with pytest.raises(ValueError, match="not of the form"):
        task.reward("12-34=", "46")


@pytest.mark.parametrize("digits", [1, 2, 3, 5])
def test_addition_random(digits):
    task = AdditionTask(digits=digits)
    rng = random.Random(digits)
    for p in task.train_problems(200, seed=digits):
        a, b = p.prompt[:-1].split("+")
        assert len(a) <= digits and len(b) <= digits
        truth = int(a) + int(b)
        assert task.reward(p.prompt, str(truth)) == 1.0
        wrong = truth + rng.choice([-11, -1, 1, 10, 100])
        assert task.reward(p.prompt, str(abs(wrong))) < 1.0 or abs(wrong) == truth
        assert task.reward(p.prompt, str(truth) + "0") < 1.0


# ---------------------------------------------------------------------------- sorting
@pytest.mark.parametrize(
    "completion, expected",
    [("1134", 1.0), ("1134\n", 1.0), ("1143", 0.0), ("134", 0.0), ("11344", 0.0), ("", 0.0), ("a", 0.0)],
)
def test_sorting_cases(completion, expected):
    assert SortingTask().reward("3141>", completion) == expected


def test_sorting_partial_credit_needs_a_permutation():
    task = SortingTask(format_reward=0.2)
    assert task.reward("3141>", "4311") == 0.2
    assert task.reward("3141>", "1135") == 0.0
    with pytest.raises(ValueError):
        task.reward("3141", "1134")


def test_sorting_random():
    task = SortingTask(min_length=2, max_length=8)
    rng = random.Random(1)
    for p in task.train_problems(300, seed=3):
        digits = p.prompt[:-1]
        assert 2 <= len(digits) <= 8
        truth = "".join(sorted(digits, key=int))
        assert task.reward(p.prompt, truth) == 1.0
        i = rng.randrange(len(truth))
        perturbed = truth[:i] + str((int(truth[i]) + 1) % 10) + truth[i + 1 :]
        assert task.reward(p.prompt, perturbed) < 1.0
        if len(set(truth)) > 1:
            assert task.reward(p.prompt, truth[::-1]) < 1.0


# ---------------------------------------------------------------------------- countdown
@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3+5*7", 1.0),
        ("5*7+3", 1.0),
        ("(5*7)+3", 1.0),
        ("7*5+3\nextra", 1.0),
        ("3+5+7", 0.0),  # valid, wrong value
        ("35+3", 0.0),  # 35 not given
        ("5*7+3+3", 0.0),  # 3 used twice
        ("-3+5*7+6", 0.0),  # 6 not given, unary minus
        ("41-3", 0.0),
        ("38", 0.0),
        ("", 0.0),
        ("3+5*", 0.0),
        ("(3+5*7", 0.0),
        ("__import__('os')", 0.0),
        ("3+5*7.0", 0.0),
    ],
)
def test_countdown_cases(completion, expected):
    assert CountdownTask().reward("3,5,7>38=", completion) == expected


def test_countdown_rules():
    task = CountdownTask(format_reward=0.1)
    assert task.reward("3,5,7>38=", "3+5+7") == 0.1  # well formed, wrong target
    assert task.reward("3,5,7>38=", "5*7+3+3") == 0.0  # rule broken: no partial credit
    assert task.reward("3,3,7>27=", "3*7+3+3") == 0.0
    assert task.reward("3,3,7>24=", "3*7+3") == 1.0  # at most once each: a subset is fine
    assert task.reward("3,5,7>15=", "3*5") == 1.0
    with pytest.raises(ValueError, match="not of the form"):
        task.reward("3,5,7>-32=", "3-5*7")  # targets are non-negative
    assert task.reward("6,2,1>3=", "6/2") == 0.0  # division not allowed by default
    assert CountdownTask(ops="+-*/").reward("6,2,1>3=", "6/2") == 1.0
    assert CountdownTask(ops="+-*/").reward("6,4,1>3=", "6/4") == 0.0  # 3/2
    assert CountdownTask(ops="+-*/").reward("6,0,1>3=", "6/0") == 0.0  # division by zero: malformed
    with pytest.raises(ValueError, match="not of the form"):
        task.reward("3 5 7>38=", "3+5*7")


def brute_force_reachable(numbers, target, ops="+-*"):
    """Independent oracle: does some ordering/operator choice (no parentheses) hit the target?"""
    for k in range(1, len(numbers) + 1):
        for perm in itertools.permutations(numbers, k):
            for opseq in itertools.product(ops, repeat=k - 1):
                expr = str(perm[0]) + "".join(o + str(x) for o, x in zip(opseq, perm[1:]))
                if oracle_eval(expr) == target:
                    return True
    return False


@pytest.mark.parametrize("num_numbers, max_number", [(2, 9), (3, 9), (4, 20)])
def test_countdown_random(num_numbers, max_number):
    task = CountdownTask(num_numbers=num_numbers, max_number=max_number)
    rng = random.Random(num_numbers)
    for p in task.train_problems(100, seed=1):
        nums_text, target_text = p.prompt[:-1].split(">")
        numbers, target = [int(x) for x in nums_text.split(",")], int(target_text)
        assert len(numbers) == num_numbers and all(1 <= x <= max_number for x in numbers)
        assert target >= 0
        # the reference uses exactly the listed numbers and hits the target (independent oracle)
        assert sorted(int(x) for x in re.findall(r"\d+", p.answer)) == sorted(numbers)
        assert oracle_eval(p.answer) == target
        assert task.reward(p.prompt, p.answer) == 1.0
        # perturb one operator or operand; reward is 1 only if the oracle says it still works
        chars = list(p.answer)
        positions = [i for i, c in enumerate(chars) if c in "+-*"]
        i = rng.choice(positions)
        chars[i] = rng.choice([o for o in "+-*" if o != chars[i]])
        perturbed = "".join(chars)
        assert task.reward(p.prompt, perturbed) == (1.0 if oracle_eval(perturbed) == target else 0.0)
        assert task.reward(p.prompt, p.answer + "+1") < 1.0  # every number is used already
    assert brute_force_reachable([3, 5, 7], 38) and not brute_force_reachable([3, 5, 7], 1000)


# ---------------------------------------------------------------------------- calculator (single-turn)
@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>1781</answer>", 1.0),
        ("<calc>37*48+5</calc><result>1781</result><answer>1781</answer>", 1.0),
        ("<answer>1780</answer><answer>1781</answer>", 1.0),  # the last answer counts
        ("<answer>1781</answer><answer>1780</answer>", 0.0),
        ("<answer> 1781 </answer>", 1.0),
        ("<answer>1780</answer>", 0.0),
        ("<answer>37*48+5</answer>", 0.0),  # an expression is not an answer
        ("1781", 0.0),
        ("<answer>1781", 0.0),
        ("", 0.0),
    ],
)
def test_calculator_single_turn_cases(completion, expected):
    assert CalculatorTask().reward("37*48+5", completion) == expected


def test_calculator_random():
    task = CalculatorTask(digits=3, num_ops=2)
    for p in task.train_problems(200, seed=2):
        truth = oracle_eval(p.prompt)
        assert p.answer == str(truth)
        assert task.reward(p.prompt, f"<answer>{truth}</answer>") == 1.0
        assert task.reward(p.prompt, f"<answer>{truth + 1}</answer>") < 1.0
        assert task.reward(p.prompt, task.target(p)) == 1.0


# ---------------------------------------------------------------------------- common properties
@pytest.mark.parametrize("name", TASKS)
def test_splits_deterministic_disjoint_short(name):
    task = get_task(name)
    train = task.train_problems(500, seed=7)
    assert [p.prompt for p in train] == [p.prompt for p in get_task(name).train_problems(500, seed=7)]
    assert [p.prompt for p in train] != [p.prompt for p in task.train_problems(500, seed=8)]
    held_out = task.eval_problems(100, seed=0)
    assert len({p.prompt for p in held_out}) == 100  # distinct
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert not {p.prompt for p in task.train_problems(2000, seed=1)} & {p.prompt for p in task.eval_problems(100, seed=5)}
    assert [p.prompt for p in task.problems("test", 10)] == [p.prompt for p in task.eval_problems(10)]
    for p in train + held_out:
        assert len(p.prompt) < 20 and len(task.target(p)) <= task.max_new_tokens
        assert task.reward(p.prompt, task.target(p)) == 1.0
        assert isinstance(p, Problem)
    with pytest.raises(ValueError, match="unknown split"):
        task.problems("validation", 3)


@pytest.mark.parametrize("name", TASKS)
def test_rewards_in_unit_interval_on_random_text(name):
    task = get_task(name, format_reward=0.1)
    tok = task.tokenizer()
    rng = random.Random(0)
    chars = [c for c in tok.alphabet]
    for p in task.train_problems(50):
        for _ in range(20):
            junk = "".join(rng.choice(chars) for _ in range(rng.randint(0, 12)))
            assert 0.0 <= task.reward(p.prompt, junk) <= 1.0


def test_small_problem_space_errors_clearly():
    task = AdditionTask(digits=1)
    with pytest.raises(ValueError, match="too small"):
        task.eval_problems(50)
    assert len(task.train_problems(1000)) == 1000  # train draws with replacement


def test_bad_knobs():
    with pytest.raises(ValueError):
        AdditionTask(digits=0)
    with pytest.raises(ValueError):
        SortingTask(min_length=5, max_length=3)
    with pytest.raises(ValueError):
        CountdownTask(ops="+^")
    with pytest.raises(ValueError):
        CalculatorTask(ops="/")


def test_completion_read_up_to_newline_or_special_token():
    task = AdditionTask()
    assert task.reward("12+34=", "46<|eos|>") == 1.0
    assert task.reward("12+34=", "46<|eos|>7") == 1.0
    assert task.reward("12+34=", "4<|eos|>6") == 0.0
    assert CountdownTask().reward("3,5,7>38=", "3+5*7<|eos|><|pad|>") == 1.0
