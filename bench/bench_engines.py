"""Tree-vs-flat benchmark (same as `treerl bench`): see treerl/benchmark.py.

Workloads (treerl/workloads.py): grpo, agentic, none, long (long context: one long prefix
+ several responses per group), tree (tree rollouts: 2-3 way forks at each of 4 turns).
Modes: naive (one sequence per call, the model's own SDPA attention, same loss head and
loss), flat, packed, dfs, auto. Engine settings are the engine's defaults (memory budget)
unless --max-tokens / --memory-budget are given. Per row: seconds, speed-up vs flat and vs
naive, fraction of the ideal ratio, peak memory (CUDA), unique-token TFLOP/s and its % of
--peak-tflops (default 798, the measured H100/H200 bf16 matmul peak).

    python bench/bench_engines.py --scale small                       # CPU
    python bench/bench_engines.py --device cuda --shape qwen3-1.7b --dtype bfloat16 \
        --scale paper --workloads grpo,agentic,long,tree --modes naive,flat,packed,dfs,auto \
        --repeats 2 --json $OUT/bench_engines.json
"""

from treerl.devtools.benchmark import main

if __name__ == "__main__":
    main()
