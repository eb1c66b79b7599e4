"""cProfile of the serving engine loop's thread during ``bench_serve.py``'s in-process run (CPU
or CUDA): where the engine thread's host time goes, tottime and cumulative. Profiling starts
at the engine thread's first decode step after the untimed warm-up run (compilation and
graph captures excluded) and covers the alone probes and the timed run.

    PYTHONPATH=src python bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
        --mixed --probe --modes in-process --repeats 1
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs  # noqa: E402

from treerl.rollout.stream import RunningBatch  # noqa: E402

PROFILE = cProfile.Profile()
STATE = {"runs": 0, "on": False}
_decode, _run_agents = RunningBatch._decode, bs.run_agents


def decode(self):  # runs in the engine thread: the profiler is enabled there
    if STATE["runs"] >= 1 and not STATE["on"]:
        STATE["on"] = True
        PROFILE.enable()
    return _decode(self)


async def run_agents(*args, **kwargs):
    out = await _run_agents(*args, **kwargs)
    STATE["runs"] += 1
    return out


RunningBatch._decode, bs.run_agents = decode, run_agents

if __name__ == "__main__":
    bs.main(sys.argv[1:])
    PROFILE.disable()  # (the engine thread has ended with the loop; its profile is complete)
    for key, n in (("tottime", 40), ("cumtime", 50)):
        s = io.StringIO()
        pstats.Stats(PROFILE, stream=s).sort_stats(key).print_stats(n)
        print(s.getvalue()[:10000])
