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


# ---------------------------------------------------------------- environment (issue 26)
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_without_cuda_is_one_line_with_the_fix(tmp_path, capsys):
    assert main(["train", "train.device=cuda", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.device=cuda but CUDA is not available" in err
    assert "use train.device=cpu" in err
    assert main(["eval", str(tmp_path), "--device", "cuda:0"]) == 2
    assert "--device=cuda:0 but CUDA is not available" in capsys.readouterr().err
    assert main(["train", "train.device=tpu", f"train.out_dir={tmp_path}"]) == 2
    assert "train.device: 'tpu' is not a device; use cpu, cuda or cuda:N" in capsys.readouterr().err


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_reported_as_that_mismatch(tmp_path, capsys):
    code = main(["train", "model.overrides={num_hidden_layers: 1, vocab_size: 8}", f"train.out_dir={tmp_path}",
                 "train.steps=1", "train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "the tokenizer has 18 token ids but the model's vocabulary has 8 (embedding rows)" in err
    assert "prompt" not in err


def test_resume_with_a_config_of_another_shape_names_the_differing_keys(tmp_path, capsys):
    base = ["task.kwargs={digits: 2}", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_problems=2",
            "train.tensorboard=false", "train.progress=false", f"train.out_dir={tmp_path}"]
    assert main(["train", *base, "model.overrides={num_hidden_layers: 1}", "train.steps=1"]) == 0
    capsys.readouterr()
    code = main(["train", *base, "model.overrides={num_hidden_layers: 2}", "train.steps=2", "--resume", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert "holds a model of another shape (num_hidden_layers 1 vs 2" in err[-1]
    assert "model.overrides.num_hidden_layers=1 vs 2" in err[-1] and "config.yaml" in err[-1]
