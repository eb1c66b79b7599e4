"""Non-finite training: a non-finite loss or gradient skips that update (weights and
optimizer state untouched) with a warning and a counter in the metrics;
``optim.max_nonfinite_updates`` in a row stop the run with one line; a checkpoint never
holds a non-finite weight."""

import pytest
import torch

from helpers.configs import run_overrides
from treerl import checkpoint as ckpt
from treerl.cli import main
from treerl.config import Config
from treerl.learner import NonFiniteError
from treerl.trainer import Trainer

BASE = run_overrides(None, "rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_problems=2",
                     "train.eval_every=0", "sft.batch_size=2")


def params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def poison(model, when):
    """NaN gradients while ``when()`` is true (a loss that returns NaN writes NaN into .grad)."""
    p = next(model.parameters())
    return p.register_hook(lambda g: g * float("nan") if when() else g)


def test_a_non_finite_gradient_skips_the_update_with_a_warning_and_a_counter(tmp_path, capsys):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}", "optim.max_nonfinite_updates=2"]))
    bad = [True]
    poison(trainer.model, lambda: bad[0])
    before, adam = params(trainer.model), dict(trainer.learner.optimizer.state)
    metrics = trainer.step()
    assert metrics["train/skipped_updates"] == 1.0
    assert torch.equal(params(trainer.model), before) and dict(trainer.learner.optimizer.state) == adam
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "skipping an update with a non-finite loss or gradient at RL step 1" in capsys.readouterr().err
    bad[0] = False
    metrics = trainer.step()  # a good update resets the count and steps the optimizer
    assert metrics["train/skipped_updates"] == 0.0 and len(trainer.learner.optimizer.state) > 0
    assert trainer.learner.nonfinite_in_a_row == 0 and trainer.learner.nonfinite_total == 1


def test_k_non_finite_updates_in_a_row_stop_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    import treerl.trainer

    original = treerl.trainer.Trainer.__init__

    def poisoned_init(self, *a, **k):
        original(self, *a, **k)
        poison(self.model, lambda: True)

    monkeypatch.setattr(treerl.trainer.Trainer, "__init__", poisoned_init)
    code = main(["train", *BASE, "train.steps=5", "optim.max_nonfinite_updates=2", f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("treerl train: error: training stopped: 2 updates in a row had a non-finite loss or "
                              "gradient (optim.max_nonfinite_updates=2")


def test_sft_skips_non_finite_updates_too(tmp_path):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}", "optim.max_nonfinite_updates=1"]))
    poison(trainer.model, lambda: True)
    with pytest.raises(NonFiniteError, match="at an SFT step"):
        trainer.sft_step()


def test_a_checkpoint_never_holds_a_non_finite_weight(tmp_path):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}"]))
    first = trainer.save()
    trainer.step_count = 1
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("inf")
    with pytest.raises(ckpt.CheckpointError, match="refusing to save step 1: the weight .* holds NaN or inf; the "
                                                   "previous checkpoint .* is kept"):
        trainer.save()
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == [first]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
