"""One GRPO step of a random-weight model on a `grpo`-shaped batch, timed per phase:
rollout (RolloutEngine, shared-prefix prefill), forward passes (proximal + reference
logprobs through the tree engine), update (policy loss forward+backward + AdamW), for
the tree engine (`auto`) and `flat` in the same run.

The batch: P prompts of random tokens x G samples of exactly N new tokens (a random model
never stops, so lengths are fixed by max_new_tokens), random rewards. KL to a reference
model (one reference forward) and 2 minibatches (so the proximal forward is needed).

``--overlap after,stream,inline`` compares ``rollout.overlap_forwards`` (issue 25 item 2: the
forwards of finished groups during the rollout; :mod:`treerl.overlap`), step by step on one
trainer, and prints the forwards' seconds hidden under the rollout. With fixed lengths every
group ends at the same decode step and there is nothing to hide; ``--stop-every K`` makes
every K-th token id a stop token, so rows end after ~K tokens (geometric) and groups at
different steps (a long tail, as RL rollouts have).

    python bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16
    python bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b,qwen3-1.7b --dtype bfloat16 --modes auto \
        --overlap after,stream,stream-nopriority,inline --stop-every 0,128 --repeats 2
    python bench/bench_grpo_step.py --overlap after,stream --stop-every 0,8   # CPU, tiny shape, seconds
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
from treerl import overlap as overlap_module
from treerl.overlap import stream_groups
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
    """Timed steps of one trainer: per workload (``--stop-every``) a warm-up step, then
    ``--repeats`` rounds of one step per ``--overlap`` setting, interleaved (the same warm
    engines and arena; a fair A/B). Returns the best step (least total) per (workload, overlap)."""
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
    best = {}
    for w, every in enumerate(args.stop_every):
        # every-th token id stops a row: lengths ~ geometric with mean `every` (capped), so groups
        # finish at different steps (a long tail); 0: no stops, every row runs to --new-tokens
        stops = list(range(0, model.config.vocab_size, every)) if every else []
        params = SamplingParams(n=args.group, max_new_tokens=args.new_tokens, temperature=1.0, seed=0,
                                stop_token_ids=stops)
        for how in args.overlap if w == 0 else args.overlap[:1]:  # warm-up: compilation, arena, streams' memory
            one_step(trainer, prompts, params, how, gen, args.device)
        for _ in range(args.repeats):
            for how in args.overlap:
                m = one_step(trainer, prompts, params, how, gen, args.device)
                key = (every, how)
                total = m["time/rollout_s"] + m["time/forward_s"] + m["time/update_s"]
                if key not in best or total < best[key]["total_s"]:
                    best[key] = {**m, "total_s": total}
    return best


def one_step(trainer, prompts, params, overlap: str, gen, device) -> dict:
    """One GRPO step as :meth:`Trainer.step` runs it (rollout through the stream, the forwards of
    finished groups during it per ``rollout.overlap_forwards``, then the update), timed."""
    overlap_module.DECODE_PRIORITY = overlap != "stream-nopriority"  # the rollout on a high-priority stream
    trainer.cfg.rollout.overlap_forwards = "stream" if overlap == "stream-nopriority" else overlap
    sync(device)
    t0 = time.perf_counter()
    ready = trainer.learner.group_forwards(trainer.cfg.rollout.overlap_forwards)
    groups = stream_groups(trainer.sampler.rollout, prompts, params, ready)
    sync(device)
    rollout_s = time.perf_counter() - t0
    samples = []
    for g in groups:
        for c in g.completions:
            p, t = len(c.prompt_ids), len(c.completion_ids)
            samples.append(Sample(c.token_ids.tolist(), [False] * (p - 1) + [True] * t,
                                  [0.0] * (p - 1) + c.logprobs.tolist(), [trainer.sampler.rollout.version] * (p - 1 + t),
                                  float(torch.rand((), generator=gen)), g.prompt_index, len(samples)))
    peak_rollout = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    UPDATE_SPLIT.clear()
    m = trainer.train_on(samples, rollout_seconds=rollout_s, ready=ready)
    sync(device)
    m.update(UPDATE_SPLIT)
    m["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    m["peak_rollout_gib"] = peak_rollout  # the rollout's (with the forwards run during it)
    m["reserved_gib"] = torch.cuda.memory_reserved() / 2**30 if device.startswith("cuda") else None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    lengths = [len(c.completion_ids) for g in groups for c in g.completions]
    m["generated_tokens"] = sum(lengths)
    m["group_lengths"] = sorted(max(len(c.completion_ids) for c in g.completions) for g in groups)
    return m


UPDATE_SPLIT: dict[str, float] = {}


def split_update(device: str) -> None:
    """Time ``TreeEngine.forward_backward`` and ``Learner.optimizer_step`` (each between device
    syncs), summed into UPDATE_SPLIT, which :func:`one_step` reports per step."""
    from treerl.engine.tree_engine import TreeEngine
    from treerl.learner import Learner

    def timed(name, fn):
        def wrapper(*a, **k):
            sync(device)
            t = time.perf_counter()
            out = fn(*a, **k)
            sync(device)
            UPDATE_SPLIT[name] = UPDATE_SPLIT.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    TreeEngine.forward_backward = timed("time/update_forward_backward_s", TreeEngine.forward_backward)
    Learner.optimizer_step = timed("time/update_optimizer_s", Learner.optimizer_step)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny", help="model shape(s), comma-separated (each measured in turn)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--modes", default="auto,flat")
    p.add_argument("--overlap", default="after", help="rollout.overlap_forwards settings to compare "
                   "(comma-separated: after, stream, inline; stream-nopriority: stream with the rollout on the "
                   "caller's stream, not a high-priority one), interleaved step by step")
    p.add_argument("--stop-every", default="0", help="workloads (comma-separated): 0 = no stops (every row "
                   "runs to --new-tokens, the issue's); K = every K-th token id stops a row (a long tail)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--set", nargs="*", default=[], help="more config overrides, e.g. rollout.keep_stream_buffers=false")
    p.add_argument("--split-update", action="store_true", help="time the update's engine calls and optimizer "
                   "steps apart (a device sync around each: the total grows by the syncs)")
    args = p.parse_args()
    if args.split_update:
        split_update(args.device)
    args.overlap = args.overlap.split(",")
    args.stop_every = [int(k) for k in args.stop_every.split(",")]
    rows = {}
    for shape in args.shape.split(","):
        if args.device == "cpu" and shape == "tiny":
            args.prompt_len, args.new_tokens, args.prompts, args.group = (min(args.prompt_len, 64),
                                                                          min(args.new_tokens, 32), 4, 4)
        model = build_model("qwen3", shape, dtype=args.dtype, device=args.device)
        for mode in args.modes.split(","):
            for (every, how), m in run(args, mode, model).items():
                rows[f"{shape}/{mode}/stop-every={every}/{how}"] = m
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    report(args, rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def report(args, rows: dict) -> None:
    """The per-phase table; with overlap, the forwards' seconds hidden under the rollout:
    ``hidden = (rollout + forward)[after] - (rollout + forward)[this]``, and its share of the
    sequential forwards."""
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\nGRPO step: qwen3 {args.shape} {args.dtype} on {name}; {args.prompts} prompts x {args.group} samples, "
          f"prompt {args.prompt_len}, up to {args.new_tokens} new tokens; KL reference + 2 minibatches; "
          f"best of {args.repeats}")
    print(f"{'shape/engine/workload/overlap':44} {'rollout s':>9} {'tok/s':>7} {'forward s':>9} {'update s':>8} "
          f"{'total s':>7} {'fwd launch s':>12} {'fwd GPU s':>9} {'hidden s':>8} {'share':>6} {'peak GiB':>8} "
          f"{'rollout peak':>12} {'reserved':>8}")
    for key, m in rows.items():
        base = rows.get(key.rsplit("/", 1)[0] + "/after")
        launch = m.get("time/forward_in_rollout_s")
        gpu = m.get("time/forward_in_rollout_gpu_s")
        hidden = share = None
        if base is not None and launch is not None:
            hidden = (base["time/rollout_s"] + base["time/forward_s"]) - (m["time/rollout_s"] + m["time/forward_s"])
            share = hidden / max(base["time/forward_s"], 1e-9)
        peak = "-" if m["peak_gib"] is None else f"{m['peak_gib']:.1f}"
        fmt = lambda x, w, f: ("-" if x is None else format(x, f)).rjust(w)  # noqa: E731
        print(f"{key:44} {m['time/rollout_s']:9.2f} {m['generated_tokens'] / m['time/rollout_s']:7.0f} "
              f"{m['time/forward_s']:9.2f} {m['time/update_s']:8.2f} {m['total_s']:7.2f} {fmt(launch, 12, '.2f')} "
              f"{fmt(gpu, 9, '.2f')} {fmt(hidden, 8, '.2f')} {fmt(share, 6, '.0%')} {peak:>8} "
              f"{fmt(m['peak_rollout_gib'], 12, '.1f')} {fmt(m['reserved_gib'], 8, '.1f')}")
    for key, m in rows.items():
        if key.endswith("/after"):
            lengths = m["group_lengths"]
            print(f"  {key.rsplit('/', 1)[0]}: groups end after {lengths[0]}..{lengths[-1]} tokens "
                  f"(median {lengths[len(lengths) // 2]}), {m['generated_tokens']} generated")


if __name__ == "__main__":
    main()
