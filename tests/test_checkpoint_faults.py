"""Damaged and interrupted checkpoints: meta.json records every file's size and SHA-256;
`eval` names the damaged file and the problem, `train --resume` skips a damaged newest
checkpoint for the newest intact one and says so, and a save killed (SIGKILL, a real
child process) at any point between its files leaves the previous checkpoint usable."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.configs import run_config, run_overrides
from helpers.processes import kill_leftovers
from treerl import checkpoint as ckpt
from treerl.cli import main
from treerl.run import train


RUN = ("model.dtype=float64", "rollout.prompts_per_step=2", "rollout.group_size=3", "train.eval_problems=4",
       "train.eval_every=0", "train.keep_last=3")  # run_overrides(out, *RUN, ...)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step run with checkpoints step-1 and step-2 (copied per test)."""
    out = tmp_path_factory.mktemp("run")
    train(run_config(out, *RUN, "train.steps=2", "train.save_every=1"))
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-000001", "step-000002"]
    return out


@pytest.fixture
def run(run_dir, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def newest(run):
    return run / "checkpoints" / "step-000002"


def test_meta_records_size_and_checksum_of_every_file(run):
    meta = json.loads((newest(run) / "meta.json").read_text())
    assert "model/model.safetensors" in meta["files"] and "trainer_state.pt" in meta["files"]
    rec = meta["files"]["model/model.safetensors"]
    assert rec["size"] == (newest(run) / "model" / "model.safetensors").stat().st_size and len(rec["sha256"]) == 64
    ckpt.verify(newest(run))


def truncate(f: Path):
    f.write_bytes(f.read_bytes()[:7])


def flip_byte(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": (lambda c: truncate(c / "model" / "model.safetensors"), "model.safetensors has 7 bytes"),
    "flipped byte in weights": (lambda c: flip_byte(c / "model" / "model.safetensors"), "does not match its checksum"),
    "missing trainer state": (lambda c: (c / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    "truncated trainer state": (lambda c: truncate(c / "trainer_state.pt"), "trainer_state.pt has 7 bytes"),
    "missing model config": (lambda c: (c / "model" / "config.json").unlink(), "config.json is missing"),
    "corrupt meta.json": (lambda c: (c / "meta.json").write_text("{not json"), "meta.json is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_eval_of_a_damaged_checkpoint_names_the_file_and_the_problem(run, damage, capsys):
    apply, message = DAMAGE[damage]
    apply(newest(run))
    assert main(["eval", str(run), "-n", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "is damaged" in err and message in err, err
    assert "step-000001 (pass it instead)" in err, err  # the way out


@pytest.mark.parametrize("damage", ["truncated weights", "flipped byte in weights", "missing trainer state"])
def test_resume_skips_a_damaged_newest_checkpoint_and_says_so(run, damage, capsys):
    DAMAGE[damage][0](newest(run))
    cfg = run_config(run, *RUN, "train.steps=3", "train.save_every=1")
    out = train(cfg, resume=run)
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err and "step-000002" in err and "using" in err, err
    assert "resumed from" in err and "step 1," in err, err
    assert Path(out["checkpoint"]).name == "step-000003"
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in l]
    assert steps == sorted(set(steps)), steps  # no step logged twice


def test_resume_with_every_checkpoint_damaged_is_a_clear_error(run, capsys):
    for c in ckpt.list_checkpoints(run / "checkpoints"):
        truncate(c / "model" / "model.safetensors")
    code = main(["train", *run_overrides(run, *RUN, "train.steps=3"), "--resume", str(run)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "every checkpoint under" in err and "is damaged" in err, err


def test_eval_of_an_intact_older_checkpoint_still_works(run, capsys):
    truncate(newest(run) / "model" / "model.safetensors")
    assert main(["eval", str(run / "checkpoints" / "step-000001"), "-n", "2"]) == 0
    assert "accuracy" in capsys.readouterr().out


# -------------------------------------------------- a save killed at any point
CHILD = textwrap.dedent("""
    import os, signal, sys, types
    # treerl/checkpoint.py itself imports only torch and NumPy; `import treerl` would first run the
    # package's __init__, which imports the engine (transformers, torch._dynamo: ~5 s of CPU per
    # child, five children on two cores). A bare package over the same directory (argv[4]) loads
    # the same checkpoint.py (and any treerl module it imports) without that __init__.
    package = types.ModuleType("treerl")
    package.__path__ = [sys.argv[4]]
    sys.modules["treerl"] = package
    import torch
    from safetensors.torch import save_file
    from treerl import checkpoint as ckpt
    assert os.path.dirname(ckpt.__file__) == sys.argv[4], ckpt.__file__

    class Model:  # a stand-in with the HF saving interface (no transformers import: fast)
        def __init__(self, value):
            self.w = torch.full((64,), float(value))
        def save_pretrained(self, path, safe_serialization=True):
            os.makedirs(path, exist_ok=True)
            save_file({"w": self.w}, os.path.join(path, "model.safetensors"))
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write("{}")

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    def after(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            die()
            return out
        return wrapped

    root, point, keep_last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckpt.save_checkpoint(root, 1, Model(1), None, {"step": 1}, keep_last=keep_last)
    model = Model(2)
    if point == "after_weights":
        model.save_pretrained = after(model.save_pretrained)
    elif point == "after_state":
        ckpt.torch.save = after(ckpt.torch.save)
    elif point == "after_meta":
        ckpt._write_synced = after(ckpt._write_synced)
    elif point == "after_rename":
        ckpt.os.replace = after(ckpt.os.replace)
    elif point == "while_pruning":
        real = ckpt._remove_checkpoint
        def half(path):
            (path / ckpt.META).unlink()
            die()
        ckpt._remove_checkpoint = half
    ckpt.save_checkpoint(root, 2, model, None, {"step": 2}, keep_last=keep_last)
    print("not killed")
""")


KILLED_AT = [("after_weights", 1), ("after_state", 1), ("after_meta", 1), ("after_rename", 2), ("while_pruning", 2)]


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """The children of every point of :data:`KILLED_AT`, started together at the first test
    (each is a process importing torch and treerl.checkpoint that mostly waits on a core; they are
    independent, each in its own directory): {point: (Popen, its directory)}. Each test
    waits for its own."""
    env = {**os.environ, "PYTHONPATH": str(Path(ckpt.__file__).parents[1])}
    children = {}
    try:
        for point, _ in KILLED_AT:
            tmp = tmp_path_factory.mktemp(point)
            keep_last = 1 if point == "while_pruning" else 2
            children[point] = (subprocess.Popen([sys.executable, "-c", CHILD, str(tmp / "checkpoints"), point,
                                                 str(keep_last), str(Path(ckpt.__file__).parent)], env=env,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), tmp)
        yield children
    finally:
        kill_leftovers(proc for proc, _ in children.values())


@pytest.mark.parametrize("point,expect", KILLED_AT)
def test_a_save_killed_at_any_point_leaves_an_intact_checkpoint(killed_saves, point, expect):
    proc, tmp_path = killed_saves[point]
    root = tmp_path / "checkpoints"
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stdout, stderr)
    found = ckpt.resolve_checkpoint(tmp_path, skip_damaged=True)
    assert found.name == f"step-{expect:06d}"
    ckpt.verify(found)
    assert ckpt.load_state(found) == {"step": expect}
    from safetensors.torch import load_file

    assert torch.equal(load_file(found / "model" / "model.safetensors")["w"], torch.full((64,), float(expect)))
    # the next save cleans up what the killed one left and prunes as asked
    ckpt.save_checkpoint(root, 3, _Model(3), None, {"step": 3}, keep_last=2)
    assert not list(root.glob(".tmp-*"))
    names = [p.name for p in ckpt.list_checkpoints(root)]
    assert names[-1] == "step-000003" and len(names) <= 2
    for p in ckpt.list_checkpoints(root):
        ckpt.verify(p)


class _Model:
    def __init__(self, value):
        self.w = torch.full((64,), float(value))

    def save_pretrained(self, path, safe_serialization=True):
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        save_file({"w": self.w}, os.path.join(path, "model.safetensors"))


# ------------------------------------------------------ disk full, read-only (issue 26)
@pytest.mark.parametrize("err,message", [
    (OSError(28, "No space left on device"), "the disk is full (no space left on device): free space or set "
                                             "train.out_dir on another disk"),
    (OSError(30, "Read-only file system"), "Read-only file system"),
    (RuntimeError("unexpected pos 64 vs 0"), "RuntimeError: unexpected pos 64 vs 0"),
])
def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, err, message):
    from treerl.trainer import Trainer

    trainer = Trainer(run_config(tmp_path, *RUN))
    first = trainer.save()
    trainer.step_count = 1

    def fail(*args, **kwargs):
        raise err

    monkeypatch.setattr(ckpt.torch, "save", fail)
    with pytest.raises(ckpt.CheckpointError) as caught:
        trainer.save()
    text = str(caught.value)
    assert "\n" not in text and text.startswith("cannot write checkpoint ") and message in text
    assert "the previous checkpoints under" in text and "are kept" in text
    monkeypatch.undo()
    assert ckpt.resolve_checkpoint(tmp_path) == first
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the temporary is removed


def test_disk_full_is_named_whatever_the_writers_message(tmp_path, monkeypatch):
    """safetensors reports a full disk as `unexpected pos 64 vs 0`: the free space names it."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    assert "the disk is full" in ckpt._write_failure(RuntimeError("unexpected pos 64 vs 0"), tmp_path)


def test_a_checkpoint_write_shows_no_progress_bar_and_leaves_the_setting(tmp_path, capfd):
    """Transformers' per-shard "Writing model shards" bar is off while a checkpoint is written (every save of a run
    printed one; an interrupt mid-bar left a line without its end, which the interrupt's message then joined:
    tests/integration/test_signals.py), and the bars' setting is as before afterwards."""
    from transformers.utils import logging as hf_logging

    from treerl.trainer import Trainer

    trainer = Trainer(run_config(tmp_path, *RUN))
    capfd.readouterr()
    hf_logging.enable_progress_bar()
    trainer.save()
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        trainer.step_count = 1
        trainer.save()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
