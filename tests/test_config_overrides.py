"""Dotted overrides reach free-form mappings (task.kwargs.*, model.overrides.*), as the
examples document, and keep the rest of the mapping; misuse is one clear line."""

import json

import pytest

from treerl.cli import main
from treerl.config import Config, ConfigError


def test_dotted_override_into_task_kwargs_keeps_the_other_keys():
    cfg = Config.from_yaml("examples/math_jsonl.yaml", ["task.kwargs.path=my.jsonl"])
    assert cfg.task.kwargs == {"path": "my.jsonl", "max_new_tokens": 24}
    base = Config.from_yaml("examples/math_jsonl.yaml")
    assert base.task.kwargs["path"] == "examples/data/arithmetic.jsonl"  # the file's dict is not mutated


def test_dotted_override_into_model_overrides_is_typed_by_yaml():
    cfg = Config.from_yaml(None, ["model.overrides.num_hidden_layers=3", "model.overrides.rope.theta=10000.0",
                                  "model.overrides.rope.kind=yarn"])
    assert cfg.model.overrides == {"num_hidden_layers": 3, "rope": {"theta": 10000.0, "kind": "yarn"}}


@pytest.mark.parametrize("override,message", [
    ("model.dtype.x=1", "model.dtype is not a mapping, so model.dtype.x cannot be set"),
    ("task.kwargz.path=a", "unknown key 'task.kwargz': did you mean 'task.kwargs'"),
    ("task.kwargs.digits.x=1", "task.kwargs.digits is 2, not a mapping"),
])
def test_misused_dotted_overrides_are_clear(override, message):
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(None, ["task.kwargs={digits: 2}", override])
    assert message in str(err.value)


def test_the_documented_math_jsonl_override_trains_on_my_data(tmp_path, capsys, monkeypatch):
    """examples/math_jsonl.yaml: "point task.kwargs.path at your own data" - through the CLI."""
    data = tmp_path / "my.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(12)))
    code = main(["train", "examples/math_jsonl.yaml", f"task.kwargs.path={data}", "sft.steps=0", "train.steps=1",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_every=0", "train.eval_problems=2",
                 "train.tensorboard=false", "train.progress=false", "model.overrides.num_hidden_layers=1",
                 f"train.out_dir={tmp_path / 'run'}"])
    assert code == 0, capsys.readouterr().err
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert str(data) in saved and "num_hidden_layers: 1" in saved
