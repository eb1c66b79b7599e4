"""bf16 exactness check (DESIGN.md, "Correctness standard"): per engine mode, the
difference of its bf16 gradient from flat's bf16 gradient must not exceed 1.5 x the
difference of flat bf16 from flat float32 (the same weights, upcast).

    python bench/bf16_check.py --device cuda --shape qwen3-1.7b
"""

import argparse
import copy

import torch

import treerl
from treerl.models import build_model
from treerl.devtools.workloads import WorkloadSpec, make_workload


# "auto-default": TreeEngine(model) as a user gets it; "auto-lean": a 2.5 GB budget, so
# nearly every call recomputes its blocks in the backward
DEFAULTS = {"auto-default": {}, "auto-lean": {"memory_budget": 2.5e9}}


def grads_of(engine, seqs, loss_fn):
    engine.model.zero_grad(set_to_none=True)
    engine.forward_backward(seqs, loss_fn, separable=True)
    # float64 copies on the host: three of them would not fit beside the models on an 80 GB GPU
    return torch.cat([p.grad.detach().to("cpu", torch.float64).flatten() for p in engine.model.parameters()])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen3-1.7b")
    p.add_argument("--modes", default="packed,dfs,auto,auto-default,auto-lean")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=256)
    args = p.parse_args()
    spec = WorkloadSpec(prompts=2, group=4, prompt_len=(512, 512), response_len=(64, 384),
                        agent_groups=1, trajectories=3, turns=4, prefix_len=512,
                        observation_len=(32, 128), action_len=(16, 96))
    model16 = build_model("qwen3", args.shape, dtype=torch.bfloat16, device=args.device, seed=0)
    model32 = copy.deepcopy(model16).float()
    vocab = model16.config.vocab_size
    print(f"{args.shape} bf16 vs float32 on {args.device}")
    print(f"{'workload':8} {'mode':11} {'|g-g32|/|g32|':>14} {'|g-gflat16|/|g32|':>18} {'ratio':>6}  verdict")
    for workload in ("grpo", "agentic"):
        seqs = make_workload(workload, spec, vocab, seed=1)
        tree = treerl.PrefixTree.from_sequences(seqs)
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(tree.num_flat_tokens - tree.num_sequences, generator=gen, dtype=torch.float64)
        w = list(w.split((tree.seq_lengths - 1).tolist()))
        n = float(tree.num_flat_tokens - tree.num_sequences)

        def loss_fn(lps, index=None):
            ids = range(len(lps)) if index is None else index.tolist()
            return -sum((lp * w[i].to(lp)).sum() for lp, i in zip(lps, ids)) / n

        kw = dict(max_tokens=args.max_tokens, chunk_tokens=args.chunk_tokens)
        g32 = grads_of(treerl.TreeEngine(model32, "flat", **kw), tree, loss_fn)
        gflat = grads_of(treerl.TreeEngine(model16, "flat", **kw), tree, loss_fn)
        base = (gflat - g32).norm() / g32.norm()
        print(f"{workload:8} {'flat':11} {base:14.3e} {0.0:18.3e} {'':>6}")
        for mode in args.modes.split(","):  # "packed:sdpa" picks an attention backend too
            name, _, attention = mode.partition(":")
            if name in DEFAULTS:  # the default engine (memory budget, compiled blocks, recompute)
                engine = treerl.TreeEngine(model16, "auto", **DEFAULTS[name])
            else:
                engine = treerl.TreeEngine(model16, name, attention=attention or "auto", **kw)
            g = grads_of(engine, tree, loss_fn)
            to32 = (g - g32).norm() / g32.norm()
            toflat = (g - gflat).norm() / g32.norm()
            ratio = toflat / base
            st = engine.stats
            print(f"{workload:8} {mode:11} {to32:14.3e} {toflat:18.3e} {ratio:6.2f}  {'ok' if ratio <= 1.5 else 'FAIL'}"
                  f"  ({st.model_calls} calls, {st.recomputed_calls} recomputed, {st.kept_attention_layers} attentions kept)")


if __name__ == "__main__":
    main()
