"""Math answer checker and JSONL datasets."""

import json
from fractions import Fraction

import pytest

from treerl.tasks import (
    DatasetError,
    JsonlTask,
    check_answer,
    extract_answer,
    extract_boxed,
    get_task,
    last_number,
    load_jsonl,
    math_reward,
    parse_number,
    reference_answer,
    score_problems,
)


# ---------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ {a}+{b} }", "{a}+{b}"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{x^{2}} and \fbox{7}", "7"),
        (r"\boxed {3}", "3"),
        (r"\boxed 5 apples", "5"),
        (r"\boxed{unclosed", None),
        ("no box 12", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 72.", "72"),
        ("1, 2, and 3", "3"),
        ("total 1,234,567 apples", "1,234,567"),
        ("x = -3", "-3"),
        ("5-3=2", "2"),
        ("10-3", "3"),
        ("it is 0.75 or .5", ".5"),
        ("ratio 3/4 of them", "3/4"),
        (r"half is \frac{1}{2}", "1/2"),
        ("1.5e3 meters", "1.5e3"),
        ("(-4)", "-4"),
        ("version 1,23", "23"),
        ("\u22125 degrees", "-5"),
        ("nothing here", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_extract_answer_prefers_boxed():
    assert extract_answer(r"\boxed{5} but then 7") == "5"
    assert extract_answer("then 7") == "7"
    assert extract_answer("none") is None


@pytest.mark.parametrize(
    "text, value, exact",
    [
        ("42", Fraction(42), True),
        ("+42", Fraction(42), True),
        ("-42", Fraction(-42), True),
        ("1,234", Fraction(1234), True),
        ("-1,234.5", Fraction(-24690, 20), False),
        ("3/4", Fraction(3, 4), True),
        ("-3/4", Fraction(-3, 4), True),
        (r"\frac{3}{4}", Fraction(3, 4), True),
        (r"-\dfrac{3}{4}", Fraction(-3, 4), True),
        (r"\frac{-3}{4}", Fraction(-3, 4), True),
        ("0.75", Fraction(3, 4), False),
        (".5", Fraction(1, 2), False),
        ("5.", Fraction(5), True),
        ("$5$", Fraction(5), True),
        (r"5\%", Fraction(5), True),
        (r"30^\circ", Fraction(30), True),
        (r"12 \text{ cm}", Fraction(12), True),
        ("x = 5", Fraction(5), True),
        ("(7)", Fraction(7), True),
        ("2e3", Fraction(2000), False),
    ],
)
def test_parse_number(text, value, exact):
    assert parse_number(text) == (value, exact)


@pytest.mark.parametrize("text", ["", "abc", "1,2", "3/0", "1/2/3", "x+1", "1.2.3", "12,34", r"\sqrt{2}", "--3"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"... so \boxed{42}", "42", True),
        (r"\boxed{42}", "43", False),
        ("The answer is 42.", "42", True),
        ("The answer is 42.", "42.0", True),
        ("it's 0.5", "1/2", True),
        (r"\boxed{\frac{1}{2}}", "0.5", True),
        (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", True),
        ("3/4", "0.75", True),
        ("1,234 dollars", "1234", True),
        ("1234", "1,234", True),
        ("-7", "-7", True),
        ("+7", "7", True),
        ("-7", "7", False),
        ("0.3333333", "1/3", True),  # within rel_tol
        ("0.333", "1/3", False),
        ("1000001", "1000000", False),  # integers compare exactly, no tolerance
        ("100.0000001", "100", True),
        (r"\boxed{x+1}", "x + 1", True),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),
        (r"\boxed{\text{yes}}", "Yes", True),
        (r"\boxed{no}", "yes", False),
        ("I think 5 then 6", "5", False),  # the last number counts
        ("no number", "5", False),
        ("", "5", False),
        (r"\boxed{}", "", False),
        ("Step 1: 3+4=7. #### 7", "7", True),
        ("so 72", "Natalia sold 48/2 = 24 clips in May. ... #### 72", True),
        ("so 24", "Natalia sold 48/2 = 24 clips in May. ... #### 72", False),
        ("= 5", r"the value is \boxed{5}", True),
        (r"\boxed{12 \text{ cm}}", "12", True),
        (r"\boxed{50\%}", "50", True),
    ],
)
def test_check_answer(completion, answer, expected):
    assert check_answer(completion, answer) is expected


def test_reference_answer_and_reward():
    assert reference_answer("lots of work #### 1,000") == "1,000"
    assert reference_answer(r"so \boxed{3}") == "3"
    assert reference_answer(" x+1 ") == "x+1"
    assert math_reward("q", r"\boxed{3}", answer="3") == 1.0
    assert math_reward("q", r"\boxed{4}", answer="3") == 0.0
    with pytest.raises(ValueError, match="answer"):
        math_reward("q", "3")


# ---------------------------------------------------------------------------- JSONL
def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_valid(tmp_path):
    f = write(tmp_path / "d.jsonl", [
        json.dumps({"prompt": "1+1?", "answer": "2", "level": 1}),
        "",
        "   ",
        json.dumps({"prompt": "2+2?", "answer": 4, "meta": {"src": "x"}}),
        json.dumps({"prompt": "no answer"}),
    ])
    problems = load_jsonl(f)
    assert [p.prompt for p in problems] == ["1+1?", "2+2?", "no answer"]
    assert [p.answer for p in problems] == ["2", "4", ""]
    assert problems[0].fields == {"level": 1} and problems[1].fields == {"meta": {"src": "x"}}
    assert problems[0].reward_fields() == {"answer": "2", "level": 1}
    g = write(tmp_path / "keys.jsonl", [json.dumps({"question": "q", "solution": "#### 3"})])
    (p,) = load_jsonl(g, prompt_key="question", answer_key="solution")
    assert (p.prompt, p.answer, dict(p.fields)) == ("q", "#### 3", {})


@pytest.mark.parametrize(
    "lines, kwargs, pattern",
    [
        ([], {}, r"d\.jsonl: dataset is empty"),
        (["", "  "], {}, r"d\.jsonl: dataset is empty"),
        ([json.dumps({"prompt": "a", "answer": "1"}), "{bad json"], {}, r"d\.jsonl:2: not valid JSON"),
        ([json.dumps({"answer": "1"})], {}, r"d\.jsonl:1: missing 'prompt'"),
        (["", json.dumps({"prompt": 3, "answer": "1"})], {}, r"d\.jsonl:2: 'prompt' must be a string"),
        (["[1, 2]"], {}, r"d\.jsonl:1: expected a JSON object"),
        ([json.dumps({"prompt": "a"})], {"require_answer": True}, r"d\.jsonl:1: missing 'answer'"),
        ([json.dumps({"prompt": "a", "answer": [1]})], {}, r"d\.jsonl:1: 'answer' must be a string or a number"),
        ([json.dumps({"prompt": "a", "answer": "1", "completion": "x"})], {}, r"d\.jsonl:1: field 'completion' is reserved"),
    ],
)
def test_load_jsonl_errors(tmp_path, lines, kwargs, pattern):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(DatasetError, match=pattern) as info:
        load_jsonl(f, **kwargs)
    assert "\n" not in str(info.value)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: cannot open"):
        load_jsonl(tmp_path / "nope.jsonl")


def make_dataset(tmp_path, n=20):
    lines = [json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "id": i}) for i in range(n)]
    return write(tmp_path / "math.jsonl", lines)


def test_jsonl_task_splits_and_reward(tmp_path):
    f = make_dataset(tmp_path)
    task = JsonlTask(str(f), eval_fraction=0.25, split_seed=3)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(train) == 15 and len(held_out) == 5
    assert {p.fields["id"] for p in train} | {p.fields["id"] for p in held_out} == set(range(20))
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert [p.prompt for p in JsonlTask(str(f), eval_fraction=0.25, split_seed=3).eval_problems()] == [
        p.prompt for p in held_out]
    assert [p.prompt for p in task.train_problems(4, seed=1)] == [p.prompt for p in task.train_problems(4, seed=1)]
    assert len(task.train_problems(40)) == 40  # repeats past an epoch
    with pytest.raises(ValueError, match="eval"):
        task.eval_problems(6)
    p = train[0]
    good, bad = rf"\boxed{{{p.answer}}}", rf"\boxed{{{int(p.answer) + 1}}}"
    assert score_problems(task.reward, [p, p], [good, bad]) == [1.0, 0.0]
    assert task.is_correct(p.prompt, good, **p.reward_fields())
    assert JsonlTask(str(f), format_reward=0.1).reward(p.prompt, bad, **p.reward_fields()) == 0.1


def test_jsonl_task_eval_path_custom_reward_and_registry(tmp_path):
    f = make_dataset(tmp_path)
    e = write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "held", "answer": "1"})])
    task = get_task("math_jsonl", path=str(f), eval_path=str(e))
    assert len(task.train_problems()) == 20 and [p.prompt for p in task.eval_problems()] == ["held"]
    custom = JsonlTask(str(f), reward_fn=lambda prompt, completion, **kw: float(len(completion) == kw["id"]))
    assert custom.reward("x", "abc", answer="", id=3) == 1.0
    nofrac = JsonlTask(str(f), eval_fraction=0.0)
    with pytest.raises(ValueError, match="eval split .* is empty"):
        nofrac.eval_problems()
    with pytest.raises(DatasetError, match="missing 'answer'"):
        JsonlTask(str(write(tmp_path / "na.jsonl", [json.dumps({"prompt": "p"})])))


# ------------------------------------------------------------ data errors (issue 26)
def test_non_utf8_bytes_are_named_by_file_line_and_column(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8"):
        load_jsonl(f)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')
    assert [p.prompt for p in load_jsonl(bom)] == ["1+1="]  # a leading byte-order mark is fine


def test_a_dataset_too_small_for_its_eval_split_is_one_line(tmp_path):
    one = write(tmp_path / "one.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})])
    with pytest.raises(DatasetError, match=r"one.jsonl: 1 problem\(s\) are too few for a held-out split of "
                                           r"eval_fraction=0.1 .* task.kwargs.eval_path"):
        JsonlTask(str(one))
    two = write(tmp_path / "two.jsonl", [json.dumps({"prompt": f"{i}", "answer": "1"}) for i in range(2)])
    with pytest.raises(DatasetError, match=r"\(0 train, 2 held out\)"):
        JsonlTask(str(two), eval_fraction=0.9)


def test_eval_fraction_of_one_or_more_is_a_one_line_config_error(tmp_path):
    from treerl.tasks.registry import TaskArgumentError

    data = write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"{i}", "answer": "1"}) for i in range(10)])
    with pytest.raises(TaskArgumentError, match=r"task.kwargs: task 'math_jsonl': eval_fraction: 1.0 is not "
                                                r"allowed; allowed: in \[0, 1\)"):
        get_task("math_jsonl", path=str(data), eval_fraction=1.0)


def test_more_held_out_problems_than_the_split_holds_is_refused_at_build_time(tmp_path, capsys):
    from treerl.cli import main

    data = write(tmp_path / "d.jsonl", [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(20)])
    code = main(["train", "task.name=math_jsonl", f"task.kwargs.path={data}", "train.eval_problems=50",
                 "model.overrides={num_hidden_layers: 1}", f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "asked for 50 held-out problems (train.eval_problems, or eval -n), the held-out split of" in err
    assert "has 2: ask for at most 2" in err
