"""Asynchronous training with a data-parallel trainer: ``treerl train ... async.enabled=true``
under torchrun (2 gloo ranks, FSDP2) with one rollout worker. At eta = 0 with one unit per
step the worker generates the same samples as a one-process asynchronous run, and the two
sharded ranks train on them with the synchronous path's global normalisers: the same
samples, metrics and (float64) final weights, every unit trained exactly once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.configs import run_config, run_overrides
from helpers.processes import kill_leftovers
from treerl.async_rl import WorkLedger, train_async
from treerl.checkpoint import load_state, resolve_checkpoint


ROOT = Path(__file__).parents[2]
RUN = ("model.dtype=float64", "rollout.prompts_per_step=3", "rollout.group_size=4", "algorithm.minibatches=2",
       "optim.lr=1e-2", "sft.steps=1", "sft.batch_size=4", "train.steps=3", "train.eval_problems=4",
       "train.eval_every=2", "train.save_every=2", "async.enabled=true", "async.max_staleness=0",
       "async.prompts_per_unit=3", "async.worker_timeout_s=60")  # run_overrides(out, *RUN, layers=2)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(resolve_checkpoint(run) / "model" / "model.safetensors"))


@pytest.mark.slow
def test_async_under_torchrun_matches_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "treerl.cli", "train", *run_overrides(two, *RUN, layers=2)]
    # the two runs are independent: the torchrun one starts first and runs while this process
    # runs the one-process one (its output goes to a file: a pipe read only at the end could fill)
    with open(tmp_path / "torchrun.err", "w+") as err:
        done = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            train_async(run_config(one, *RUN, layers=2))
            done.wait(timeout=600)
        finally:
            kill_leftovers([done])
        err.seek(0)
        assert done.returncode == 0, err.read()[-4000:]

    key = lambda r: (r["step"], r["group"], r["episode"], r["reward"], r["token_ids"])  # noqa: E731
    assert [key(r) for r in rows(two / "rollouts.jsonl")] == [key(r) for r in rows(one / "rollouts.jsonl")]
    m1, m2 = rows(one / "metrics.jsonl"), rows(two / "metrics.jsonl")
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [0, 1, 2, 3, 4]  # eval, SFT, 3 RL steps
    for k in ("version", "staleness/max", "reward/mean", "loss/loss", "tree/sequences", "eval/accuracy", "sft/loss"):
        a, b = [r.get(k) for r in m1], [r.get(k) for r in m2]
        assert all((x is None) == (y is None) and (x is None or abs(x - y) <= 1e-9 * (1 + abs(x))) for x, y in zip(a, b)), k
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:  # 4 Adam steps amplify float64 rounding where gradients are ~0; an update is ~1e-1 of a weight
        assert (w1[k] - w2[k]).norm() <= 1e-6 * w1[k].norm(), (k, float((w1[k] - w2[k]).norm() / w1[k].norm()))
    ledger = WorkLedger.from_state(load_state(resolve_checkpoint(two))["async"])
    ledger.check()
    assert len(ledger.trained) == 3  # 3 steps x 1 unit, each trained once
    assert (two / "checkpoints" / "step-000002").is_dir()  # save_every: a collective checkpoint mid-run
