"""Tree-vs-flat benchmark (same as `treerl bench`): see treerl/benchmark.py.

    python bench/bench_engines.py --scale small                       # CPU, seconds
    python bench/bench_engines.py --device cuda --shape qwen3-1.7b --dtype bfloat16 \
        --scale paper --modes flat,packed,dfs,auto --max-tokens 16384
"""

from treerl.benchmark import main

if __name__ == "__main__":
    main()
