"""bench_grpo_step.py with every timed step printed (not only the best) and, after each, the attention kernels'
shapes so far (treerl.engine.kernel_plans.SHAPES, or chain_attention's before session 35) and whether the last
engine call deferred a cuDNN plan: session 38's look at the GRPO step's forwards (0.23 -> 0.39 s) and update
(0.65 -> 0.75 s) after session 35's per-call cuDNN allowance. Settings as NAME=VALUE in TREERL_PLANS (module
constants of kernel_plans, e.g. CUDNN_NEW_SHAPES_PER_CALL=None). Arguments: bench_grpo_step.py's.

    PYTHONPATH=src python3 bench/device/grpo_diag.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --modes auto --repeats 4
"""
import ast
import os
import sys
from pathlib import Path

here = Path.cwd() / "bench"
sys.path.insert(0, str(here))
import bench_grpo_step as b  # noqa: E402

try:
    from treerl.engine import kernel_plans as plans
except ImportError:  # before session 35: the shapes lived in chain_attention
    from treerl.engine import chain_attention as plans
for kv in filter(None, os.environ.get("TREERL_PLANS", "").split()):
    name, value = kv.split("=")
    assert hasattr(plans, name), name
    setattr(plans, name, ast.literal_eval(value))
print("plans settings:", {k: v for k, v in vars(plans).items() if k.isupper() and type(v) in (int, float, bool, str, type(None))})

inner = b.one_step
count = [0]


def one_step(*a, **k):
    m = inner(*a, **k)
    count[0] += 1
    shapes = {label: len(s) for label, s in getattr(plans, "SHAPES", {}).items()}
    deferred = plans.call_deferred() if hasattr(plans, "call_deferred") else None
    print(f"step {count[0]}: rollout {m['time/rollout_s']:.3f} forward {m['time/forward_s']:.3f} update "
          f"{m['time/update_s']:.3f} s; shapes {shapes}; last call deferred {deferred}", flush=True)
    return m


b.one_step = one_step
sys.argv = ["bench_grpo_step.py"] + sys.argv[1:]
b.main()
