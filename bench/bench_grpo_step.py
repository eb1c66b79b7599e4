"""One GRPO step of a random-weight model on a `grpo`-shaped batch, timed per phase:
rollout (RolloutEngine, shared-prefix prefill), forward passes (proximal + reference
logprobs through the tree engine), update (policy loss forward+backward + AdamW), for
the tree engine (`auto`) and `flat` in the same run.

The batch: P prompts of random tokens x G samples of exactly N new tokens (a random model
never stops, so lengths are fixed by max_new_tokens), random rewards. KL to a reference
model (one reference forward) and 2 minibatches (so the proximal forward is needed).

    python bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16
    python bench/bench_grpo_step.py                    # CPU, tiny shape, seconds
"""

import argparse
import json
import time
from pathlib import Path

import torch

from treerl.config import Config
from treerl.models import build_model
from treerl.rollout import SamplingParams
from treerl.tasks.base import Problem, Task
from treerl.trainer import Sample, Trainer


class RandomTokens:
    """Stands in for a tokenizer: the benchmark works on token ids only."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eos_token_id, self.pad_token_id = vocab_size, vocab_size - 1, 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def encode(self, text, add_special_tokens=False):
        return []


class RandomTask(Task):
    name = "random-tokens"

    def problems(self, split="train", n=None, seed=0):
        return [Problem(str(i)) for i in range(n or 64)]

    def reward(self, prompt, completion, **fields):
        return 0.0


def run(args, mode: str, model) -> dict:
    cfg = Config.from_yaml(None, [
        f"engine.mode={mode}", f"engine.max_tokens={args.max_tokens}", f"train.device={args.device}",
        "algorithm.kl_coef=0.001", "algorithm.minibatches=2", "rollout.temperature=1.0",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        "train.tensorboard=false", "optim.lr=1e-6", *args.set,
    ])
    trainer = Trainer(cfg, model=model, tokenizer=RandomTokens(model.config.vocab_size), task=RandomTask())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size - 1, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(n=args.group, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    results = []
    for rep in range(args.repeats + 1):  # the first is a warm-up (compilation)
        sync(args.device)
        t0 = time.perf_counter()
        groups = trainer.sampler.rollout.generate(prompts, params)
        sync(args.device)
        rollout_s = time.perf_counter() - t0
        samples = []
        for g in groups:
            for c in g.completions:
                p, t = len(c.prompt_ids), len(c.completion_ids)
                samples.append(Sample(c.token_ids.tolist(), [False] * (p - 1) + [True] * t,
                                      [0.0] * (p - 1) + c.logprobs.tolist(),
                                      [trainer.sampler.rollout.version] * (p - 1 + t),
                                      float(torch.rand((), generator=gen)), g.prompt_index, len(samples)))
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        m = trainer.train_on(samples, rollout_seconds=rollout_s)
        sync(args.device)
        m["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
        m["generated_tokens"] = sum(len(c.completion_ids) for g in groups for c in g.completions)
        if rep:
            results.append(m)
    best = min(results, key=lambda r: r["time/rollout_s"] + r["time/forward_s"] + r["time/update_s"])
    return best


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--modes", default="auto,flat")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. rollout.keep_stream_buffers=false")
    args = p.parse_args()
    if args.device == "cpu" and args.shape == "tiny":
        args.prompt_len, args.new_tokens, args.prompts, args.group = min(args.prompt_len, 64), min(args.new_tokens, 32), 4, 4
    model = build_model("qwen3", args.shape, dtype=args.dtype, device=args.device)
    rows = {}
    for mode in args.modes.split(","):
        rows[mode] = run(args, mode, model)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\nGRPO step: qwen3 {args.shape} {args.dtype} on {name}; {args.prompts} prompts x {args.group} samples, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens; KL reference + 2 minibatches")
    print(f"{'engine':6} {'rollout s':>9} {'rollout tok/s':>13} {'forward s':>9} {'update s':>9} {'total s':>8} "
          f"{'tree ratio':>10} {'peak GiB':>8}")
    for mode, m in rows.items():
        total = m["time/rollout_s"] + m["time/forward_s"] + m["time/update_s"]
        peak = "-" if m["peak_gib"] is None else f"{m['peak_gib']:.1f}"
        print(f"{mode:6} {m['time/rollout_s']:9.2f} {m['generated_tokens'] / m['time/rollout_s']:13.0f} "
              f"{m['time/forward_s']:9.2f} {m['time/update_s']:9.2f} {total:8.2f} {m['tree/ideal_ratio']:10.2f} {peak:>8}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
