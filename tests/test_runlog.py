"""A run's directory: runs never mix (an existing run is continued with --resume or started
over with --overwrite, never written over), an unusable out_dir is one line, pruning keeps
the current run's checkpoints, the Ctrl-C hint offers --resume only once a checkpoint
exists, and the plots have labelled axes."""

import errno
import json
import pathlib

import pytest

from helpers.configs import run_config, run_overrides
from treerl import checkpoint as ckpt
from treerl.cli import main
from treerl.config import Config, ConfigError
from treerl.runlog import prepare_out_dir, resume_hint


RUN = ("rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_problems=2",
       "train.eval_every=0")  # run_overrides(out, *RUN, ...)


def steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_again_into_a_run_directory_is_refused_and_loses_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *run_overrides(out, *RUN, "train.steps=2")]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    checkpoints = [p.name for p in ckpt.list_checkpoints(out / "checkpoints")]
    capsys.readouterr()
    assert main(["train", *run_overrides(out, *RUN, "train.steps=1")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds a run (metrics.jsonl, rollouts.jsonl, checkpoints)" in err
    assert f"--resume {out}" in err and "new train.out_dir" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == checkpoints


def test_overwrite_starts_over_and_clears_the_old_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *run_overrides(out, *RUN, "train.steps=3")]) == 0
    (out / "notes.txt").write_text("mine")  # not a run output: kept
    assert main(["train", *run_overrides(out, *RUN, "train.steps=1", "--overwrite")]) == 0
    assert steps(out) == [0, 1]
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-000001"]
    assert (out / "notes.txt").read_text() == "mine"
    assert "--overwrite: removed the outputs of the previous run" in capsys.readouterr().err


def test_resume_and_overwrite_together_and_resume_into_another_run_are_refused(tmp_path):
    cfg = Config.from_yaml(None, [f"train.out_dir={tmp_path / 'a'}"])
    with pytest.raises(ConfigError, match="--overwrite starts over and --resume continues"):
        prepare_out_dir(cfg, tmp_path / "a" / "checkpoints" / "step-000001", overwrite=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="holds another run than the checkpoint resumed"):
        prepare_out_dir(cfg, tmp_path / "b" / "checkpoints" / "step-000001")
    prepare_out_dir(cfg, tmp_path / "a" / "checkpoints" / "step-000001")  # its own run: fine


def test_only_rank_0_looks_at_the_run_directory(tmp_path, monkeypatch):
    """Under torchrun every rank calls prepare_out_dir while rank 0 may be deleting the old
    outputs (--overwrite): a rank reading the directory then raced the deletion (a glob of a
    folder being removed raises). Ranks other than 0 must not read it at all: here any
    look at the directory fails, and rank 1 still passes (rank 0 alone refuses or clears)."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000001").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    cfg = Config.from_yaml(None, [f"train.out_dir={out}"])

    def being_deleted(self, *a, **k):
        raise FileNotFoundError(2, "No such file or directory (removed by rank 0)", str(self))

    with monkeypatch.context() as m:
        for name in ("exists", "is_dir", "is_file", "glob", "iterdir", "mkdir", "write_text"):
            m.setattr(pathlib.Path, name, being_deleted)
        prepare_out_dir(cfg, None, overwrite=True, main=False)
        prepare_out_dir(cfg, None, overwrite=False, main=False)  # rank 0 refuses this one; rank 1 waits for it
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_out_dir(cfg, None, overwrite=False, main=True)
    with pytest.raises(ConfigError, match="--overwrite starts over and --resume continues"):
        prepare_out_dir(cfg, out, overwrite=True, main=False)  # the arguments alone: every rank refuses


def test_an_out_dir_that_is_a_file_or_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    afile = tmp_path / "occupied"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="train.out_dir: .*occupied is a file, not a directory"):
        prepare_out_dir(Config.from_yaml(None, [f"train.out_dir={afile}"]), None)

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", read_only)
    with pytest.raises(ConfigError, match=r"train.out_dir: cannot write to .*ro \(Read-only file system\): choose a "
                                          r"writable train.out_dir"):
        prepare_out_dir(Config.from_yaml(None, [f"train.out_dir={tmp_path / 'ro'}"]), None)


def test_pruning_after_resuming_from_an_earlier_checkpoint_keeps_the_new_one(tmp_path):
    """Resumed from step 1 while step 3 exists: saving step 2 with keep_last=2 must not
    delete step 2 (the current run's newest); only checkpoints older than it are pruned."""
    from treerl.trainer import Trainer

    cfg = run_config(tmp_path, *RUN, "train.keep_last=2")
    trainer = Trainer(cfg)
    for step in (0, 1, 3):
        trainer.step_count = step
        trainer.save()
    trainer.step_count = 2
    saved = trainer.save()
    assert saved.is_dir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-000001", "step-000002",
                                                                                  "step-000003"]


def test_the_interrupt_hint_offers_resume_only_once_a_checkpoint_exists(tmp_path, capsys, monkeypatch):
    import treerl.run

    out = tmp_path / "run"
    assert "nothing to resume" in resume_hint(out, None) and "--resume" not in resume_hint(out, None)

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(treerl.run, "train", interrupted)
    assert main(["train", *run_overrides(out, *RUN)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no checkpoint was written yet" in last and "--overwrite" in last and "--resume" not in last


def test_plots_have_y_axis_labels(tmp_path, monkeypatch):
    import matplotlib.axes

    from treerl.metrics import PLOTS, plot_metrics

    labels = []
    original = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda self, text, *a, **k: (labels.append(text),
                                                                                        original(self, text, *a, **k)))
    row = {"reward/mean": 0.5, "eval/accuracy": 0.4, "tree/ideal_ratio": 3.0, "perf/train_tokens_per_s": 10.0,
           "perf/rollout_tokens_per_s": 5.0}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **row}) + "\n" for s in range(3)))
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    assert len(written) == len(PLOTS) and len(labels) == len(PLOTS) and all(labels)
