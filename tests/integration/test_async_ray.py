"""The Ray launcher: the same rollout workers as Ray actors on a local Ray instance
(2 CPUs), file weight transfer, a killed actor restarted with its work re-queued."""

import os

import pytest

if os.environ.get("CI"):  # CI installs .[dev], which has ray: a missing ray fails there, never skips
    import ray
else:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[dev]' brings it)")

from helpers.configs import run_config  # noqa: E402
from treerl.async_rl import AsyncOptions, FaultPlan, WorkLedger, train_async  # noqa: E402
from treerl.checkpoint import load_state  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    # (address="local": a cluster of its own, never one another process left running on this machine)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_launcher_trains_and_survives_a_dead_actor(tmp_path, local_ray):
    cfg = run_config(tmp_path, "rollout.prompts_per_step=3", "rollout.group_size=4", "train.eval_problems=8",
                     "train.eval_every=0", "train.steps=3", "async.enabled=true", "async.max_staleness=1",
                     "async.worker_timeout_s=60", layers=2)
    out = train_async(cfg, options=AsyncOptions(launcher="ray", faults={0: FaultPlan("exit", after_model_calls=6)},
                                                deadline_s=240))
    assert out["version"] == 3 and out["async/restarts"] == 1
    assert (tmp_path / "weights").is_dir()  # file transfer
    ledger = WorkLedger.from_state(load_state(out["checkpoint"])["async"])
    ledger.check()
    assert len(ledger.trained) == 3 * 3
