"""`treerl train` under signals, as a real child process: SIGKILL mid-run then --resume
continues from the newest checkpoint with every metrics step exactly once (a line torn
by the kill is dropped); SIGINT and SIGTERM stop cleanly with a resume hint (exit 130)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.configs import run_overrides
from helpers.processes import kill_leftovers
from treerl import checkpoint as ckpt
from treerl.cli import main
from treerl.runlog import _truncate_jsonl


ROOT = Path(__file__).resolve().parents[2]
RUN = ("rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_problems=2", "train.eval_every=0",
       "train.save_every=1", "train.keep_last=2")  # run_overrides(out, *RUN, f"train.steps={steps}")


def start(out, steps=1_000_000, sigint_ignored=False):  # never ends on its own: the test stops it
    """The child writes its output to files, never to pipes: a pipe nobody reads while the
    test waits fills up under load and blocks the child mid-write (seen in CI: no
    checkpoint in 240 s, and an interrupt lost inside a blocked progress-bar write)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "child.out", "w") as stdout, open(out.parent / "child.err", "w") as stderr:
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        cmd = [sys.executable, "-m", "treerl.cli", "train", *run_overrides(out, *RUN, f"train.steps={steps}")]
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True, preexec_fn=ignore)


def child_err(out) -> str:
    return (out.parent / "child.err").read_text()


def wait_for_checkpoint(proc, out, step=2, timeout=240):
    """Until the child has written a checkpoint of at least ``step`` (a condition on its
    files; not one named checkpoint: with keep_last=2 a fast child prunes step 2 before a
    slow poll sees it)."""
    deadline = time.monotonic() + timeout

    def written() -> bool:
        return any(p.name >= f"step-{step:06d}" and (p / ckpt.META).is_file()
                   for p in (out / "checkpoints").glob("step-*"))

    while not written():
        assert proc.poll() is None, child_err(out)[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)


def metric_steps(out):
    return [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]


def test_sigkill_mid_run_then_resume_loses_and_repeats_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    proc = start(out)
    try:
        wait_for_checkpoint(proc, out)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with (out / "metrics.jsonl").open("a") as f:  # as if the kill had torn the row being written
        f.write('{"step": 99, "reward/me')
    last = ckpt.resolve_checkpoint(out, skip_damaged=True)
    done = ckpt.load_state(last)["step"]
    assert done >= 2
    assert main(["train", *run_overrides(out, *RUN, f"train.steps={done + 2}"), "--resume", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"resumed from {last}" in err and "dropping a torn line" in err, err
    assert metric_steps(out) == list(range(0, done + 3))  # the first eval, then every step once


# (SIGINT, started with SIGINT ignored): a background job of a non-interactive shell, or a
# child of a test process that an earlier test left ignoring it; treerl installs its own handler
SIGNALLED = [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)]


@pytest.fixture(scope="module")
def signalled_runs(tmp_path_factory):
    """The children of every case of :data:`SIGNALLED`, started together at the first such
    test (each spends its first seconds importing, on one core; they are independent, each
    in its own directory): {(sig, ignored): (Popen, out)}. Each test signals its own."""
    runs = {}
    try:
        for sig, ignored in SIGNALLED:
            out = tmp_path_factory.mktemp(f"{sig.name}-{ignored}") / "run"
            runs[sig, ignored] = (start(out, sigint_ignored=ignored), out)
        yield runs
    finally:
        kill_leftovers(proc for proc, _ in runs.values())


@pytest.mark.parametrize("sig,ignored", SIGNALLED)
def test_sigint_and_sigterm_stop_cleanly_with_a_resume_hint(signalled_runs, sig, ignored):
    proc, out = signalled_runs[sig, ignored]
    try:
        wait_for_checkpoint(proc, out)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = child_err(out)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("treerl train: interrupted;") and f"--resume {out}" in last, err[-3000:]
    assert "Traceback" not in err
    ckpt.verify(ckpt.resolve_checkpoint(out))


def test_truncating_the_log_keeps_rows_up_to_the_checkpoint(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "x')
    _truncate_jsonl(path, 1)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert "torn line" in capsys.readouterr().err


def test_an_interrupt_landing_in_a_finalizer_still_stops_the_run(tmp_path, capsys, monkeypatch):
    """Python drops an exception raised inside a finalizer ("Exception ignored in ..."), so
    a SIGINT whose handler runs while a ``__del__`` executes loses its KeyboardInterrupt;
    under load a signal lands there now and then, and the run went on (the SIGINT test then
    waited for a run of 10^6 steps). Here the signal is sent from inside a ``__del__`` at
    RL step 2, deterministically: the run still stops at its next step, exit 130."""
    import treerl.trainer

    class SignalInFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__

    original = treerl.trainer.Trainer.step

    def step(self):
        metrics = original(self)
        if self.step_count == 2:
            SignalInFinalizer()  # dropped at once: its __del__ runs now
        return metrics

    dropped = []
    monkeypatch.setattr(treerl.trainer.Trainer, "step", step)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    out = tmp_path / "run"
    assert main(["train", *run_overrides(out, *RUN, "train.steps=50")]) == 130
    assert dropped == [KeyboardInterrupt]  # the KeyboardInterrupt raised in __del__ was dropped ...
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("treerl train: interrupted;")  # ... and the run stopped anyway
    assert max(metric_steps(out)) == 2
    from treerl.runlog import stop_requested

    assert not stop_requested.is_set()  # cleared for whatever runs next in this process
