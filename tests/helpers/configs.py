"""The one config builder of the tests' training runs: :func:`run_overrides` (the command-line
overrides of a small, quiet run of the tiny training model) and :func:`run_config` (its
:class:`~treerl.config.Config`). Each test file passes what it varies as extra overrides."""

from __future__ import annotations

from pathlib import Path

from treerl.config import Config


def tiny_model_overrides(layers: int = 1, context: int = 64) -> str:
    """The ``model.overrides`` value of the tiny training model: hidden 32, MLP 64, 4 query and
    2 KV heads of 8 dimensions, ``layers`` layers, ``context`` positions."""
    return (f"{{hidden_size: 32, intermediate_size: 64, num_hidden_layers: {layers}, num_attention_heads: 4, "
            f"num_key_value_heads: 2, head_dim: 8, max_position_embeddings: {context}}}")


def run_overrides(out: str | Path | None = None, *extra: str, task: str | None = "addition", layers: int | None = 1,
                  context: int = 64) -> list[str]:
    """Overrides of a small training run without progress bar or TensorBoard: ``task``
    (``addition``: 2-digit sums; None: the default task), the tiny training model
    (:func:`tiny_model_overrides`; ``layers=None``: the model shape as configured), outputs in
    ``out`` (None: the default), then ``extra`` (a later key wins)."""
    base = [] if task is None else ["task.name=addition", "task.kwargs={digits: 2}"] if task == "addition" \
        else [f"task.name={task}"]
    if layers is not None:
        base.append(f"model.overrides={tiny_model_overrides(layers, context)}")
    base += ["train.tensorboard=false", "train.progress=false"]
    if out is not None:
        base.append(f"train.out_dir={out}")
    return [*base, *extra]


def run_config(out: str | Path | None = None, *extra: str, **kw) -> Config:
    """:func:`run_overrides` as a :class:`Config`."""
    return Config.from_yaml(None, run_overrides(out, *extra, **kw))


# The agent tests' runs: the default task and the `tiny` model shape (64 positions), 2 prompts x 2
# samples of up to 4 tokens: run_overrides(out, *AGENT_RUN, ..., task=None, layers=None).
AGENT_RUN = ("model.overrides.max_position_embeddings=64", "rollout.prompts_per_step=2", "rollout.group_size=2",
             "rollout.max_new_tokens=4")


def make_trainer(tmp_path: Path, *overrides: str):
    """A :class:`~treerl.trainer.Trainer` of an agent test's run (:data:`AGENT_RUN`) writing to
    ``tmp_path / "run"``; ``overrides`` come last."""
    from treerl.trainer import Trainer

    return Trainer(run_config(tmp_path / "run", *AGENT_RUN, *overrides, task=None, layers=None))
