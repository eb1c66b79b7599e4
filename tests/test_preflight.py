"""Config values that pass the type check but would fail deep inside the run are one
line from `treerl train`, naming the key and the valid choices: task name, task
arguments, a task's required argument, model family, shape, and overrides (a typo'd
or mistyped Hugging Face config field)."""

import pytest

from treerl.cli import main
from treerl.tasks.registry import TaskArgumentError, TaskError, get_task


@pytest.mark.parametrize("override,message", [
    ("task.name=zzz", "task.name: unknown task 'zzz' (valid: addition"),
    ("task.kwargs={digitz: 3}", "task.kwargs: task 'addition': AdditionTask.__init__() got an unexpected keyword argument 'digitz'"),
    ("task.name=math_jsonl", "task 'math_jsonl' needs path=<a JSONL file with 'prompt' and 'answer'> (set task.kwargs.path=FILE)"),
    ("model.family=gpt", "model.family: unknown 'gpt'; choose one of qwen3, qwen2, llama"),
    ("model.shape=huge", "model.shape: unknown 'huge'; choose one of tiny"),
    ("model.overrides.hidden_sise=3", "'hidden_sise' is not a qwen3 config field: did you mean 'model.overrides.hidden_size'?"),
    ("model.overrides={num_hidden_layers: two}", "model.overrides: Validation error for field 'num_hidden_layers'"),
])
def test_bad_task_and_model_settings_are_one_line(override, message, tmp_path, capsys):
    code = main(["train", override, f"train.out_dir={tmp_path}", "train.steps=1", "train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert message in err, err


def test_task_errors_keep_their_builtin_types():
    with pytest.raises(ValueError):
        get_task("zzz")
    with pytest.raises(TypeError):
        get_task("addition", digitz=3)
    assert issubclass(TaskError, ValueError) and issubclass(TaskArgumentError, TypeError)
