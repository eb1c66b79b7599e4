"""64 concurrent agents through ``treerl serve`` vs the same agents in process.

Each agent runs ``--turns`` turns: it sends its prompt (token ids: ``--prompt-len`` random
ids for the first turn), gets ``--max-tokens`` sampled tokens (no stop token, so every call
generates exactly that many), appends them and ``--tool-tokens`` random "tool result" ids,
and sends the longer prompt as its next turn (which the prefix cache extends).

- ``in-process``: the agents submit to the :class:`treerl.serve.EngineLoop` directly
  (one continuous batch, no HTTP, no JSON);
- ``served``: the agents call ``/v1/completions`` of ``treerl serve`` on loopback with the
  ``openai`` package (one shared ``AsyncOpenAI`` client), over an engine loop like the one above.

Both use the same engine settings and random weights; each mode runs once untimed (CUDA
graph captures, allocator warm-up), then ``--repeats`` timed runs (best kept). Reported:
generated tokens/s, request latency percentiles, and served / in-process.

GPU:
    python bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --json out.json
CPU smoke run:
    python bench/bench_serve.py --shape tiny --agents 8 --turns 2 --prompt-len 16 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine  # noqa: E402
from treerl.serve import EngineLoop, SamplingKey, ServeOptions, ServerThread, make_state  # noqa: E402


class IdTokenizer:
    """No text: prompts are token ids; ``decode`` writes the ids."""

    eos_token_id = None
    bos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefix-cache-tokens", type=int, default=1 << 16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


async def run_agents(args, vocab: int, call) -> dict:
    """All agents concurrently; ``call(prompt_ids) -> completion ids``. Returns tokens,
    requests, wall time and latency percentiles."""
    latencies: list[float] = []
    tokens = 0

    async def agent(i: int) -> None:
        nonlocal tokens
        rng = random.Random(args.seed * 1000 + i)
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        for _ in range(args.turns):
            t = time.perf_counter()
            ids = await call(prompt)
            latencies.append(time.perf_counter() - t)
            if len(ids) != args.max_tokens:
                raise RuntimeError(f"a call generated {len(ids)} tokens, expected {args.max_tokens}")
            tokens += len(ids)
            prompt = prompt + ids + [rng.randrange(vocab) for _ in range(args.tool_tokens)]

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(args.agents)))
    wall = time.perf_counter() - t0
    p = np.percentile(latencies, [50, 90, 99])
    return {"tokens": tokens, "requests": len(latencies), "wall_s": wall, "tok_s": tokens / wall,
            "latency_p50_s": float(p[0]), "latency_p90_s": float(p[1]), "latency_p99_s": float(p[2])}


def in_process(args, loop: EngineLoop, vocab: int) -> dict:
    key = SamplingKey(temperature=1.0, max_tokens=args.max_tokens)

    async def call(prompt):
        [c] = await asyncio.wrap_future(loop.submit(prompt, key, 1))
        return c.completion_ids.tolist()

    return asyncio.run(run_agents(args, vocab, call))


def served(args, server: ServerThread, vocab: int) -> dict:
    import openai

    from treerl.serve.client import http_module

    async def main():
        http = http_module()
        limits = http.Limits(max_connections=args.agents * 2, max_keepalive_connections=args.agents * 2)
        client = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=3600,
                                    http_client=http.AsyncClient(limits=limits, timeout=3600))

        async def call(prompt):
            r = await client.completions.create(model="treerl", prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=1.0)
            return r.choices[0].model_extra["token_ids"]

        try:
            return await run_agents(args, vocab, call)
        finally:
            await client.close()

    return asyncio.run(main())


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    context = args.prompt_len + args.turns * (args.max_tokens + args.tool_tokens) + 16
    model = build_model(args.family, args.shape, dtype=dtype, device=device, seed=args.seed,
                        max_position_embeddings=context)
    vocab = model.get_input_embeddings().num_embeddings
    engine = RolloutEngine(model, prefix_cache_tokens=args.prefix_cache_tokens)
    state = make_state(engine, IdTokenizer(), ServeOptions(default_max_tokens=args.max_tokens))
    server = ServerThread(state).start()
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                     "shape": args.shape, "dtype": dtype, "torch": torch.__version__,
                     "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        for name, fn in (("in-process", lambda: in_process(args, state.loop, vocab)),
                         ("served", lambda: served(args, server, vocab))):
            fn()  # untimed: graph captures, warm caches
            runs = [fn() for _ in range(args.repeats)]
            results[name] = max(runs, key=lambda r: r["tok_s"])
    finally:
        server.stop()
    results["ratio"] = results["served"]["tok_s"] / results["in-process"]["tok_s"]
    print(f"{args.agents} agents x {args.turns} turns, prompt {args.prompt_len} + {args.tool_tokens}/turn, "
          f"{args.max_tokens} new tokens/call, {args.shape} {dtype} on {results['device']}")
    print(f"{'mode':12} {'tok/s':>10} {'p50 s':>8} {'p99 s':>8}")
    for name in ("in-process", "served"):
        r = results[name]
        print(f"{name:12} {r['tok_s']:10.1f} {r['latency_p50_s']:8.3f} {r['latency_p99_s']:8.3f}")
    print(f"{'ratio':12} {results['ratio']:10.3f}  (served / in-process)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
