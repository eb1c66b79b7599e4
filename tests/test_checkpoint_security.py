"""Checkpoints without code: the trainer state is tensors and plain data, read with
``torch.load(weights_only=True)``. A crafted trainer_state.pt (a pickle whose ``__reduce__``
runs a shell command, meta.json checksums updated to match) is refused with one line and
exit 2 by ``treerl train --resume``, ``treerl eval`` and ``treerl serve --weights``, and the
command never runs. A checkpoint of an older treerl (NumPy arrays in its RNG state) loads
only with ``--trust-checkpoint``."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.configs import run_config, run_overrides
from treerl import checkpoint as ckpt
from treerl.async_rl.ledger import WorkLedger
from treerl.cli import main
from treerl.run import train
from treerl.tasks.base import Problem


RUN = ("model.dtype=float64", "rollout.prompts_per_step=2", "rollout.group_size=3", "train.eval_problems=4",
       "train.eval_every=0", "train.keep_last=3")  # run_overrides(out, *RUN, ...)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 1-step run (copied per test)."""
    out = tmp_path_factory.mktemp("run")
    train(run_config(out, *RUN, "train.steps=1"))
    return out


@pytest.fixture
def run(run_dir, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def newest(run: Path) -> Path:
    return ckpt.list_checkpoints(run / "checkpoints")[-1]


def rewrite_state(checkpoint: Path, write) -> None:
    """Replace trainer_state.pt through ``write(path)`` and update meta.json's record of it,
    as an attacker (or an older treerl) would have it: the checksums match."""
    write(checkpoint / ckpt.STATE)
    meta = json.loads((checkpoint / ckpt.META).read_text())
    meta["files"][ckpt.STATE] = ckpt._file_record(checkpoint / ckpt.STATE)
    (checkpoint / ckpt.META).write_text(json.dumps(meta))
    ckpt._VERIFIED.clear()
    ckpt.verify(checkpoint)


class RunsAShellCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_writers(marker: Path):
    def plain_pickle(path):
        path.write_bytes(pickle.dumps({"step": 1, "x": RunsAShellCommand(marker)}))

    def torch_zip(path):
        torch.save({"step": 1, "x": RunsAShellCommand(marker)}, path)

    return {"pickle": plain_pickle, "torch.save": torch_zip}


def test_trainer_state_is_plain_data(run):
    f = newest(run) / ckpt.STATE
    assert torch.serialization.get_unsafe_globals_in_checkpoint(f) == []
    state = torch.load(f, weights_only=True)
    assert state["step"] == 1 and isinstance(state["rng"]["numpy"][1], list) and state["config"]["train"]["steps"] == 1


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_crafted_checkpoint_runs_no_code_on_resume(run, tmp_path, capsys, form):
    marker = tmp_path / "pwned"
    rewrite_state(newest(run), crafted_writers(marker)[form])
    code = main(["train", *run_overrides(run, *RUN, "train.steps=2"), "--resume", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not marker.exists()
    assert len(err.splitlines()) == 1, err
    assert "refused" in err and "--trust-checkpoint" in err and ckpt.STATE in err
    assert ("posix.system" if form == "torch.save" else "Unsupported operand") in err


def test_crafted_checkpoint_runs_no_code_on_eval_or_serve(run, tmp_path, capsys):
    from treerl.serve.server import load_for_serving

    marker = tmp_path / "pwned"
    rewrite_state(newest(run), crafted_writers(marker)["torch.save"])
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused" in err
    with pytest.raises(ckpt.CheckpointError, match="refused"):
        load_for_serving(None, [], str(run), "cpu", None)
    assert not marker.exists()


def test_trust_checkpoint_is_what_runs_the_code(run, tmp_path, capsys):
    """The option does what it says: with it, the crafted file's command runs (the refusal
    above is the only protection, and it is on by default)."""
    marker = tmp_path / "pwned"
    rewrite_state(newest(run), crafted_writers(marker)["torch.save"])
    with pytest.raises(Exception):  # noqa: B017 - the crafted state is no trainer state
        main(["train", *run_overrides(run, *RUN, "train.steps=2"), "--resume", str(run), "--trust-checkpoint"])
    assert marker.exists()
    assert "full unpickling (--trust-checkpoint)" in capsys.readouterr().err


def test_older_checkpoint_loads_only_when_trusted(run, capsys):
    """An older treerl stored NumPy's RNG state as an array: refused by default, resumed
    with --trust-checkpoint (exactly: the step count goes on)."""
    path = newest(run)

    def older(f):
        state = torch.load(f, weights_only=True)
        state["rng"]["numpy"] = np.random.get_state()
        torch.save(state, f)

    rewrite_state(path, older)
    assert main(["train", *run_overrides(run, *RUN, "train.steps=2"), "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "numpy" in err and "older treerl" in err and "--trust-checkpoint" in err
    assert main(["train", *run_overrides(run, *RUN, "train.steps=2"), "--resume", str(run), "--trust-checkpoint"]) == 0
    assert json.loads((newest(run) / ckpt.META).read_text())["step"] == 2
    assert torch.serialization.get_unsafe_globals_in_checkpoint(newest(run) / ckpt.STATE) == []


def test_async_ledger_state_is_plain_data(tmp_path):
    ledger = WorkLedger()
    ledger.queued.append(ledger.new_unit([Problem("1+2=", "3", {"level": 2}), Problem("2+2=", "4")], 3, b"\x01\x02"))
    ledger.queued.append(ledger.new_unit(["raw"], 2))
    torch.save({"async": ledger.state_dict()}, tmp_path / "s.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "s.pt") == []
    back = WorkLedger.from_state(torch.load(tmp_path / "s.pt", weights_only=True)["async"])
    assert back.queued[0].problems == [Problem("1+2=", "3", {"level": 2}), Problem("2+2=", "4")]
    assert back.queued[0].rng_state == b"\x01\x02" and back.queued[1].problems == ["raw"]


def test_save_refuses_a_state_that_would_not_load(tmp_path):
    from treerl.models import build_model

    model = build_model("qwen3", "tiny", vocab_size=32)
    with pytest.raises(ckpt.CheckpointError, match="numpy"):
        ckpt.save_checkpoint(tmp_path, 1, model, None, {"step": 1, "x": np.zeros(3)})
    assert ckpt.list_checkpoints(tmp_path) == [] and not list(tmp_path.glob(".tmp-*"))
