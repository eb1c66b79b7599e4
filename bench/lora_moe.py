"""LoRA and mixture-of-experts on the GPU: one call, JSON out (issue 28).

Parts (``--parts``, default all; each writes its results to ``--out`` as soon as it ends,
and an error in one part is recorded and the next part runs):

- ``lora``: Qwen3-1.7B shape, bf16: full fine-tuning vs LoRA r=64 (every projection),
  ``flat`` vs ``auto`` on a GRPO batch: seconds per step (forward+backward + AdamW step)
  and peak GiB; trainable parameters.
- ``moe``: a Qwen3-30B-A3B-shaped model with ``--moe-layers`` layers (128 experts, top-8,
  hidden 2048, moe_intermediate 768), bf16: ``flat`` vs ``auto`` forward+backward on a
  GRPO batch: seconds, speedup, peak GiB and % of the warm bf16 matmul peak on the
  *active* parameters (6 x (non-embedding params with only top-k experts per layer) per
  unique token + LM head + attention, DESIGN.md's formula).
- ``rollout``: the same MoE model through the RolloutEngine (compiled own decode blocks,
  CUDA graphs), prompts x G rows: tok/s beside the bandwidth floor (per decode step: the
  non-expert weights, the experts the step's rows select — expected distinct experts per
  layer under uniform routing, ``E (1 - (1 - k/E)^B)`` — each prompt's K/V once, each row's
  own K/V; over the measured copy bandwidth).
- ``lora_rollout`` (last): the 1.7B-shape rollout with LoRA r=64 (merged weights in the
  decode blocks' fused copies) against the base model: tok/s of a warm ``generate``, split
  into the refresh of the (merged) copies (at each stream's start, and after an optimizer
  step: ``update_weights``), the prompts' prefill (a forward of the prompts) and the decode
  steps (ms per step: what is left, over the steps); whether CUDA graphs and compiled
  decode blocks ran.
- ``stability``: on a GRPO batch of the MoE model, max/mean |logprob| difference of bf16
  ``auto`` (tree) vs bf16 ``flat``, against bf16 ``flat`` vs float32 ``flat`` (DESIGN: the
  first must be <= 1.5 x the second), and routing agreement between rollout and trainer:
  greedy completions from the rollout engine (eager decode blocks, no CUDA graphs: the
  router's choices are recorded per step), the same sequences through the trainer's tree
  forward (eager blocks); the share of (token, layer) whose top-k expert sets match, and of
  tokens matching in every layer.

GPU (one H100, ~6-8 min):
    python bench/lora_moe.py --device cuda --out $OUT/lora_moe.json
the LoRA parts only (~3.5 min):
    python bench/lora_moe.py --device cuda --parts lora,lora_rollout --out $OUT/lora_moe_lora.json
CPU smoke run (tiny shapes, seconds):
    python bench/lora_moe.py --smoke --out /tmp/lora_moe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl import PrefixTree, TreeEngine, moe  # noqa: E402
from treerl.devtools.benchmark import attention_flops_per_pair, matmul_params, weighted_logprob_loss  # noqa: E402
from treerl.lora import apply_lora  # noqa: E402
from treerl.engine.memory import expert_weight_bytes  # noqa: E402
from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from treerl.devtools.workloads import WorkloadSpec, make_workload  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matmul_peak_tflops(device, seconds: float = 3.0) -> float | None:
    """Warm bf16 8192^3 product (DESIGN.md: measured in the same run)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * 8192**3 / best / 1e12


def copy_bandwidth(device) -> float | None:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 29, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 2 * 10 / (time.perf_counter() - t0)


def time_step(engine, tree, loss_fn, optimizer, repeats: int, warmup: int = 1) -> tuple[float, float | None]:
    """Median seconds of forward_backward + optimizer step, and peak GiB."""
    device = engine.device
    for _ in range(warmup):
        engine.forward_backward(tree, loss_fn, separable=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    peak_reset(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        engine.forward_backward(tree, loss_fn, separable=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], peak_gib(device)


# ------------------------------------------------------------------------ parts
def part_lora(a, device, results):
    spec = WorkloadSpec(prompts=a.prompts, group=a.group, prompt_len=(a.prompt_len, a.prompt_len),
                        response_len=(a.response_len // 2, a.response_len))
    rows = []
    for kind in ("full", "lora"):
        model = build_model("qwen3", a.lora_shape, dtype=a.dtype, device=device, seed=0)
        if kind == "lora":
            model = apply_lora(model, {"rank": a.rank, "alpha": 2 * a.rank})
            with torch.no_grad():  # B = 0 at init: give the adapters a value so the step is the general case
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 1e-3)
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(trainable, lr=1e-6)
        seqs = make_workload("grpo", spec, model.get_input_embeddings().num_embeddings)
        tree = PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree)
        for mode in ("flat", "auto"):
            engine = TreeEngine(model, mode)
            seconds, peak = time_step(engine, tree, loss_fn, optimizer, a.repeats)
            rows.append(dict(kind=kind, mode=mode, seconds=seconds, peak_gib=peak, plan=engine.stats.plan,
                             trainable_params=sum(p.numel() for p in trainable), flat_tokens=tree.num_flat_tokens,
                             tree_tokens=tree.num_tree_tokens, trainable_dtype=str(trainable[0].dtype)))
            print(f"lora part: {kind:>4} {mode:>4}: {seconds:.3f} s/step, peak {peak} GiB", flush=True)
        del model, optimizer, engine, trainable
        free()
    by = {(r["kind"], r["mode"]): r for r in rows}
    results["lora"] = dict(shape=a.lora_shape, rank=a.rank, rows=rows, summary={
        "lora_vs_full_step_time_flat": by["lora", "flat"]["seconds"] / by["full", "flat"]["seconds"],
        "lora_vs_full_step_time_auto": by["lora", "auto"]["seconds"] / by["full", "auto"]["seconds"],
        "tree_speedup_full": by["full", "flat"]["seconds"] / by["full", "auto"]["seconds"],
        "tree_speedup_lora": by["lora", "flat"]["seconds"] / by["lora", "auto"]["seconds"],
    })


def part_lora_rollout(a, device, results):
    """Rollout of the LoRA model (merged weights in the decode blocks' copies) against the
    base model: tok/s of a warm ``generate`` (best of ``--repeats``), split into its parts:
    the stream-start refresh of the (merged) copies (also the cost of ``update_weights``
    after an optimizer step), the prompts' prefill (one Hugging Face forward of all prompts:
    the LoRA model's runs PEFT's layers) and the rest, the decode steps (per step)."""
    out = {}
    for kind in ("base", "lora"):
        model = build_model("qwen3", a.lora_shape, dtype=a.dtype, device=device, seed=0)
        if kind == "lora":
            model = apply_lora(model, {"rank": a.rank, "alpha": 2 * a.rank})
        vocab = model.get_input_embeddings().num_embeddings
        engine = RolloutEngine(model, keep_stream_buffers=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (a.rollout_prompt_len,), generator=g).tolist()
                   for _ in range(a.rollout_prompts)]
        params = SamplingParams(n=a.rollout_group, temperature=1.0, max_new_tokens=a.rollout_new_tokens // 2, seed=0)
        engine.generate(prompts, params)  # compile + capture
        seconds = float("inf")
        for _ in range(a.repeats):
            sync(device)
            t0 = time.perf_counter()
            groups = engine.generate(prompts, params)
            sync(device)
            seconds = min(seconds, time.perf_counter() - t0)
        stats = engine.stats
        tokens = sum(len(c.completion_ids) for grp in groups for c in grp.completions)
        refresh = best_of(a.repeats, device, lambda: engine.update_weights(model))  # refresh the (merged) copies
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            prefill = best_of(a.repeats, device, lambda: model(input_ids=ids, logits_to_keep=1))
        decode = seconds - refresh - prefill
        out[kind] = dict(tok_per_s=tokens / seconds, seconds=seconds, refresh_seconds=refresh, prefill_seconds=prefill,
                         decode_ms_per_step=1e3 * decode / max(1, stats.decode_steps), decode_steps=stats.decode_steps,
                         step_builds=stats.step_builds, cuda_graphs=engine.cuda_graphs,
                         decode_compiled=engine.decode_blocks.compiled if engine.decode_blocks else None,
                         adapter_dtype=str(next((p.dtype for n, p in model.named_parameters() if "lora_" in n), None)))
        print(f"lora_rollout part: {kind}: {out[kind]}", flush=True)
        del model, engine
        free()
    out["lora_vs_base_tok_per_s"] = out["lora"]["tok_per_s"] / out["base"]["tok_per_s"]
    out["lora_vs_base_decode_step"] = out["lora"]["decode_ms_per_step"] / out["base"]["decode_ms_per_step"]
    results["lora_rollout"] = out


def best_of(repeats: int, device, fn) -> float:
    """Fewest seconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def moe_model(a, device, dtype=None):
    overrides = dict(num_hidden_layers=a.moe_layers)
    if a.smoke:
        overrides.update(vocab_size=512)
    model = build_model("qwen3_moe", a.moe_shape, dtype=dtype or a.dtype, device=device, seed=0, **overrides)
    with torch.no_grad():  # HF initialises the router to zero (uniform routing); a trained router is sharper
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02)
    return model


def active_flops(model, tree) -> float:
    """DESIGN.md's useful FLOPs with only the top-k experts of each layer counted."""
    body, head = matmul_params(model)
    total, active = expert_weight_bytes(model.config, torch.float32)
    body_active = body - (total - active) // 4
    predicted = tree.num_tree_tokens - tree.num_roots
    return 6 * body_active * tree.num_tree_tokens + 6 * head * predicted + attention_flops_per_pair(model) * tree.attention_pairs


def part_moe(a, device, results, peak_tflops):
    model = moe_model(a, device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    spec = WorkloadSpec(prompts=a.prompts, group=a.group, prompt_len=(a.prompt_len, a.prompt_len),
                        response_len=(a.response_len // 2, a.response_len))
    seqs = make_workload("grpo", spec, model.get_input_embeddings().num_embeddings)
    tree = PrefixTree.from_sequences(seqs)
    loss_fn = weighted_logprob_loss(tree)
    rows = []
    for mode in ("flat", "auto"):
        engine = TreeEngine(model, mode)
        for _ in range(1):
            engine.forward_backward(tree, loss_fn, separable=True)
        peak_reset(device)
        times = []
        for _ in range(a.repeats):
            sync(device)
            t0 = time.perf_counter()
            engine.forward_backward(tree, loss_fn, separable=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        seconds = sorted(times)[len(times) // 2]
        tflops = active_flops(model, tree) / seconds / 1e12
        rows.append(dict(mode=mode, seconds=seconds, peak_gib=peak_gib(device), plan=engine.stats.plan,
                         active_tflops=tflops, pct_of_peak_active=None if not peak_tflops else 100 * tflops / peak_tflops))
        print(f"moe part: {mode:>4}: {seconds:.3f} s, {tflops:.1f} TFLOP/s on active params", flush=True)
    total, active = expert_weight_bytes(model.config, torch.float32)
    results["moe"] = dict(shape=a.moe_shape, layers=a.moe_layers, rows=rows, flat_tokens=tree.num_flat_tokens,
                          tree_tokens=tree.num_tree_tokens, ideal_ratio=tree.ideal_ratio,
                          expert_params=total // 4, active_expert_params=active // 4,
                          params=sum(p.numel() for p in model.parameters()),
                          speedup=rows[0]["seconds"] / rows[1]["seconds"])
    del model, engine
    free()


def part_rollout(a, device, results, bandwidth):
    model = moe_model(a, device)
    vocab = model.get_input_embeddings().num_embeddings
    engine = RolloutEngine(model, keep_stream_buffers=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (a.rollout_prompt_len,), generator=g).tolist() for _ in range(a.rollout_prompts)]
    params = SamplingParams(n=a.rollout_group, temperature=1.0, max_new_tokens=a.rollout_new_tokens, seed=0)
    engine.generate(prompts, params)  # compile + capture
    best = float("inf")
    for _ in range(a.repeats):
        sync(device)
        t0 = time.perf_counter()
        groups = engine.generate(prompts, params)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    tokens = sum(len(c.completion_ids) for grp in groups for c in grp.completions)
    cfg = model.config
    size = torch.finfo(a.dtype).bits // 8
    total_w = sum(p.numel() for p in model.parameters()) * size
    experts_total, _ = expert_weight_bytes(cfg, a.dtype)
    rows = a.rollout_prompts * a.rollout_group
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = E * (1 - (1 - k / E) ** rows)  # expected experts hit per layer by one step's rows
    weights_step = total_w - experts_total + experts_total * distinct / E
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * size
    T, P = a.rollout_new_tokens, a.rollout_prompt_len
    kv_bytes = sum(a.rollout_prompts * P * kv_token + rows * t * kv_token for t in range(T))
    floor_s = (T * weights_step + kv_bytes) / bandwidth if bandwidth else None
    results["rollout"] = dict(rows=rows, new_tokens=T, prompt_len=P, seconds=best, tokens=tokens,
                              tok_per_s=tokens / best, bandwidth_Bps=bandwidth,
                              floor_tok_per_s=None if not floor_s else rows * T / floor_s,
                              fraction_of_floor=None if not floor_s else (tokens / best) / (rows * T / floor_s),
                              expected_experts_per_layer=distinct, weight_bytes_per_step=weights_step,
                              decode_compiled=engine.decode_blocks.compiled if engine.decode_blocks else None)
    print(f"rollout part: {tokens / best:.0f} tok/s, floor {results['rollout']['floor_tok_per_s']}", flush=True)
    del model, engine
    free()


def part_stability(a, device, results):
    model = moe_model(a, device)
    vocab = model.get_input_embeddings().num_embeddings
    spec = WorkloadSpec(prompts=max(1, a.prompts // 2), group=a.group, prompt_len=(a.prompt_len, a.prompt_len),
                        response_len=(a.response_len // 2, a.response_len))
    seqs = make_workload("grpo", spec, vocab)
    tree = PrefixTree.from_sequences(seqs)
    with torch.no_grad():
        flat16 = torch.cat(TreeEngine(model, "flat").logprobs(tree)).double()
        tree16 = torch.cat(TreeEngine(model, "auto").logprobs(tree)).double()
        model32 = moe_model(a, device, torch.float32)
        model32.load_state_dict(model.state_dict())
        flat32 = torch.cat(TreeEngine(model32, "flat").logprobs(tree)).double()
    del model32
    free()
    tree_vs_flat = (tree16 - flat16).abs()
    bf16_vs_fp32 = (flat16 - flat32).abs()
    out = dict(tokens=len(flat16), tree_vs_flat_bf16_max=float(tree_vs_flat.max()),
               tree_vs_flat_bf16_mean=float(tree_vs_flat.mean()), flat_bf16_vs_fp32_max=float(bf16_vs_fp32.max()),
               flat_bf16_vs_fp32_mean=float(bf16_vs_fp32.mean()))
    out["within_design_standard"] = out["tree_vs_flat_bf16_mean"] <= 1.5 * out["flat_bf16_vs_fp32_mean"]
    out["routing"] = routing_agreement(a, model, device)
    results["stability"] = out
    print(f"stability part: {json.dumps(out)}", flush=True)
    del model
    free()


def routing_agreement(a, model, device) -> dict:
    """Greedy completions, one prompt at a time (one row: the decode steps' router calls
    are that row's tokens in order), eager decode blocks without CUDA graphs so the router
    hook runs every step; then the same sequences through the trainer's tree forward
    (eager blocks, one sequence per call so rows are positions)."""
    vocab = model.get_input_embeddings().num_embeddings
    engine = RolloutEngine(model, cuda_graphs=False, compile_decode=False)
    trainer = TreeEngine(model, "flat", compile=False)
    trainer.max_tokens  # noqa: B018 - the memory model's probe forwards (CUDA) run now, before any router is recorded
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(1)
    same_pairs = pairs = same_tokens = tokens = 0
    for _ in range(a.routing_prompts):
        prompt = torch.randint(0, vocab, (a.routing_prompt_len,), generator=g).tolist()
        calls: list[torch.Tensor] = []
        hook = moe.router_hook(lambda probs, top_i: (calls.append(top_i.detach().clone()), probs)[1])
        with hook, torch.no_grad():
            group = engine.generate([prompt], SamplingParams(n=1, temperature=0, max_new_tokens=a.routing_new_tokens))[0]
        completion = group.completions[0].completion_ids.tolist()
        # calls: per layer the prefill's [P, k], then per decode step per layer [1, k]
        prefill, decode = calls[:layers], calls[layers:]
        rollout = [torch.cat([prefill[i]] + decode[i::layers]) for i in range(layers)]  # per layer [P + T - 1, k]
        seq = prompt + completion
        calls.clear()
        with hook, torch.no_grad():
            trainer.logprobs([seq])
        train = [c[: len(seq) - 1] for c in calls]  # rows 0..L-2 (the last token routes nothing the rollout saw)
        n = len(seq) - 1
        match = torch.stack([(torch.sort(r[:n], -1)[0] == torch.sort(t[:n], -1)[0]).all(-1)
                             for r, t in zip(rollout, train)])  # [layers, n]
        same_pairs += int(match.sum())
        pairs += match.numel()
        same_tokens += int(match.all(0).sum())
        tokens += n
    return dict(token_layer_match=same_pairs / pairs, token_all_layers_match=same_tokens / tokens, tokens=tokens,
                note="eager decode blocks (no CUDA graphs) vs eager trainer blocks, bf16")


PARTS = ("lora", "moe", "rollout", "stability", "lora_rollout")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated parts to run, in this order (e.g. lora,lora_rollout: the LoRA ones only)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check that the script runs)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.smoke:
        a.lora_shape, a.moe_shape, a.dtype = "tiny", "tiny-moe", torch.float32
        a.prompts, a.group, a.prompt_len, a.response_len = 2, 3, 24, 12
        a.rollout_prompts, a.rollout_group, a.rollout_prompt_len, a.rollout_new_tokens = 2, 2, 16, 8
        a.routing_prompts, a.routing_prompt_len, a.routing_new_tokens = 2, 12, 8
        a.rank, a.moe_layers, a.repeats = 4, 2, 1
    else:
        a.lora_shape, a.moe_shape, a.dtype = "qwen3-1.7b", "qwen3-30b-a3b", torch.bfloat16
        a.prompts, a.group, a.prompt_len, a.response_len = 4, 8, 1024, 512
        a.rollout_prompts, a.rollout_group, a.rollout_prompt_len, a.rollout_new_tokens = 8, 8, 512, 256
        a.routing_prompts, a.routing_prompt_len, a.routing_new_tokens = 4, 256, 64
    device = torch.device(a.device)
    results: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                         torch=torch.__version__, date=time.strftime("%Y-%m-%d"), smoke=a.smoke, errors={})
    names = a.parts.split(",")
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        p.error(f"--parts: unknown part {unknown[0]!r}; the parts are {','.join(PARTS)}")
    # measured only when a part uses them (a short call of --parts lora,lora_rollout skips both)
    results["matmul_peak_tflops"] = matmul_peak_tflops(device) if "moe" in names else None
    results["copy_bandwidth_Bps"] = copy_bandwidth(device) if "rollout" in names else None

    def save():
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(results, indent=1))

    parts = dict(lora=lambda: part_lora(a, device, results),
                 moe=lambda: part_moe(a, device, results, results["matmul_peak_tflops"]),
                 rollout=lambda: part_rollout(a, device, results, results["copy_bandwidth_Bps"]),
                 stability=lambda: part_stability(a, device, results),
                 lora_rollout=lambda: part_lora_rollout(a, device, results))
    for name in names:
        t0 = time.perf_counter()
        try:
            parts[name]()
        except Exception as err:  # noqa: BLE001 - record, go on with the next part
            results["errors"][name] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            free()
        results.setdefault("part_seconds", {})[name] = time.perf_counter() - t0
        save()
    print(json.dumps(results, indent=1))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
