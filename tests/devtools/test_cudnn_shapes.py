"""bench/cudnn_shapes_sim.py (the cuDNN shapes the engine meets when every step's trees are new: its planner,
``kernel_plans.planned`` and the allowance, on the meta device) and bench/cudnn_plans.py's CPU smoke run.
No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from treerl.engine import kernel_plans as plans

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    if name not in sys.modules:  # bench/ is not a package
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_shapes_sim_episodes_meets_the_h100s_new_shapes_and_each_policy_holds_its_bound(tmp_path):
    sim = _load("cudnn_shapes_sim")
    out = tmp_path / "sim.json"
    shapes_before = {k: set(v) for k, v in plans.SHAPES.items()}
    bounds_before = plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES
    results = sim.main(["--workloads", "episodes", "--steps", "3", "--out", str(out)])
    runs = results["workloads"]["episodes"]
    # session 10's H100 vary run of episodes met 9, 5, 2 new kernel shapes in its first three steps
    assert [s["new_shapes"] for s in runs["unbounded"]["steps"]] == [9, 5, 2]
    assert [s["plans"] for s in runs["call8"]["steps"]][0] == 8  # step 0: one shape waits (for its next meeting)
    assert sum(s["plans"] for s in runs["call8"]["steps"]) <= runs["unbounded"]["distinct_shapes"]
    assert runs["cap64"]["cudnn_shapes"] <= 64
    assert json.loads(out.read_text())["workloads"]["episodes"]["defaults"]["summary"]
    assert plans.SHAPES == shapes_before and (plans.CUDNN_NEW_SHAPES_PER_CALL, plans.CUDNN_MAX_SHAPES) == bounds_before


def test_cudnn_plans_smoke(tmp_path, monkeypatch, capsys):
    plans = _load("cudnn_plans")
    out = tmp_path / "plans.json"
    monkeypatch.setattr(sys, "argv", ["cudnn_plans.py", "--smoke", "--out", str(out)])
    plans.main()
    data = json.loads(out.read_text())
    assert data["summary"]["shapes"] == 3 and data["summary"]["kernel"] == "math"
    assert all(r["first_ms"] > 0 and r["second_ms"] > 0 for r in data["rows"])
    assert "summary" in capsys.readouterr().out
