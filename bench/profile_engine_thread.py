"""cProfile of the serving engine loop thread during bench_serve.py's in-process run (CPU or CUDA): where the
engine thread's host time goes (tottime and cumulative).

    PYTHONPATH=src python bench/profile_engine_thread.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed \
        --probe --modes in-process --repeats 1
"""
import cProfile, pstats, sys, io
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import bench_serve as bs
from treerl.serve import loop as L
orig = L.EngineLoop._run
profs = []
def run(self):
    p = cProfile.Profile(); profs.append(p); p.enable()
    try:
        orig(self)
    finally:
        p.disable()
L.EngineLoop._run = run
bs.main(sys.argv[1:])
s = io.StringIO()
st = pstats.Stats(profs[0], stream=s); st.sort_stats("tottime").print_stats(35)
print(s.getvalue()[:9000])
s = io.StringIO()
st = pstats.Stats(profs[0], stream=s); st.sort_stats("cumtime").print_stats(45)
print(s.getvalue()[:9000])
