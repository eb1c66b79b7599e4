"""Diagnose the order-dependent gradient error of the compiled + recomputed CUDA test (H100).

Runs, in ONE process, the CUDA tests that precede ``test_compiled_and_recomputed_blocks_float32``
(the prelude), then that test's compile=True cases under variants that each switch off one
suspect, printing PASS/FAIL per case, the measured memory model, the plan and the dynamo
cache sizes of the block's frames:

  as-is         the failing state (expected FAIL after the prelude)
  sync-copy     prepare_batch's pinned non-blocking index copy followed by a stream sync
  eager-head    the loss head's chunk functions eager (blocks still compiled)
  eager-blocks  the decoder blocks eager (loss head still compiled; the memory model is
                measured again, so the plan may differ: compare the printed plan)
  dynamo-reset  torch._dynamo.reset() before the case (every compiled frame's cache dropped)

A variant that PASSES where as-is FAILS names the suspect it switched off.

``--no-prelude``: the cases alone (expected PASS), to compare the printed memory model and plans.
``--chain``: run tests/cuda/test_chain_attention_cuda.py first, as ``pytest -m cuda tests/cuda``
does (that file sorts before test_cuda.py: bf16 engines on the same ``small`` shape, fused
SDPA kernels on odd shapes, the ones that once crashed the test process).

    PYTHONPATH=src:tests:tests/cuda python3 bench/gradbug_probe.py [--no-prelude] [--chain] [--variants as-is,...]
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import traceback

import torch

sys.path[:0] = ["tests", "tests/cuda", "src"]
import test_cuda  # noqa: E402  (the CUDA tests' bodies)

import treerl  # noqa: E402
from treerl.engine import tree_engine  # noqa: E402
from treerl.engine.batch import prepare_batch  # noqa: E402

LIMIT_HITS: list[str] = []  # dynamo's "hit config.recompile_limit" warnings (the frame then runs eagerly)


class _LimitHits(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "recompile_limit" in text:
            LIMIT_HITS.append(" ".join(line.strip() for line in text.splitlines()[:3]))


def limit_hits() -> str:
    hits, LIMIT_HITS[:] = list(LIMIT_HITS), []
    return "; ".join(hits) if hits else "none"


def cache_sizes() -> str:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    import transformers.models.qwen3.modeling_qwen3 as q3
    from treerl.engine import decoder, loss_head
    import inspect
    from treerl.engine import attention
    codes = {"_run_block": decoder._run_block.__code__,
             "DecoderLayer.forward": inspect.unwrap(q3.Qwen3DecoderLayer.forward).__code__,
             "Attention.forward": inspect.unwrap(q3.Qwen3Attention.forward).__code__,
             "_flex_whole_tiles": attention._flex_whole_tiles.__code__, "_flex_any": attention._flex_any.__code__,
             "_chunk_forward": loss_head._chunk_forward.__code__}
    out = []
    for name, code in codes.items():
        try:
            out.append(f"{name}={len(_debug_get_cache_entry_list(code))}")
        except Exception as err:  # noqa: BLE001
            out.append(f"{name}=? ({type(err).__name__})")
    return " ".join(out)


_orig_fb = treerl.TreeEngine.forward_backward


def logged_forward_backward(self, *args, **kwargs):
    loss = _orig_fb(self, *args, **kwargs)
    if self.stats.recomputed_calls:  # the recompute test's calls (the prelude's never recompute)
        m = self.memory.model
        print(f"    memory model: fixed={m.fixed:.0f} per_token={m.per_token:.0f} "
              f"recompute_per_token={m.recompute_per_token:.0f} budget={self.memory.budget}", flush=True)
        print(f"    plan: {self.stats.plan}", flush=True)
        print(f"    stats: calls={self.stats.model_calls} recomputed={self.stats.recomputed_calls} "
              f"kept={self.stats.kept_attention_layers}", flush=True)
    return loss


def sync_prepare(layout, plan, device):
    b = prepare_batch(layout, plan, device)
    torch.cuda.synchronize(device)
    return b


CASES = [(0, "packed"), (0, "flat"), (6, "packed")]


def cases(variant: str) -> None:
    for keep, mode in CASES:
        if True:
            if variant == "dynamo-reset":
                torch._dynamo.reset()
            gc.collect()
            try:
                test_cuda.test_compiled_and_recomputed_blocks_float32(mode, True, keep)
                verdict = "PASS"
            except AssertionError as err:
                verdict = f"FAIL {err}"
            except Exception:  # noqa: BLE001
                verdict = "ERROR " + traceback.format_exc(limit=3).replace("\n", " | ")
            print(f"[{variant}] keep={keep} mode={mode}: {verdict}", flush=True)
            print(f"    dynamo cache entries: {cache_sizes()}", flush=True)
            print(f"    recompile limits hit: {limit_hits()}", flush=True)


def chain_prelude() -> None:
    import pytest
    import test_chain_attention_cuda as tc
    import treerl.engine.chain_attention as chain

    for name in chain.KERNELS:
        for expand_kv in (False, True):
            for n, prefix in [(1, 1), (77, 0), (77, 1), (200, 333), (256, 1024)]:
                try:
                    tc.test_fused_kernels_against_float64(name, expand_kv, n, prefix)
                except pytest.skip.Exception:
                    pass
    tc.test_probe_picks_a_fused_kernel_for_qwen3_heads()
    for mode, kw in [("flat", {"max_tokens": 256}), ("dfs", {"chunk_tokens": 200}),
                     ("auto", {"max_tokens": 300, "chunk_tokens": 64})]:
        with pytest.MonkeyPatch.context() as mp:
            tc.test_engine_bf16_chain_path_as_accurate_as_the_tree_mask(mode, kw, mp)
    print(f"chain prelude done; dynamo cache entries: {cache_sizes()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-prelude", action="store_true")
    ap.add_argument("--chain", action="store_true")
    ap.add_argument("--variants", default="as-is,sync-copy,eager-head,eager-blocks,dynamo-reset",
                    help="comma-separated, in this order")
    args = ap.parse_args()
    treerl.TreeEngine.forward_backward = logged_forward_backward
    logging.getLogger("torch._dynamo").addHandler(_LimitHits())
    if args.chain:
        chain_prelude()
    if not args.no_prelude:
        for workload in ("grpo", "agentic"):
            for mode, kw in [("flat", {}), ("packed", {}), ("dfs", {"chunk_tokens": 7}),
                             ("auto", {"max_tokens": 40, "chunk_tokens": 16})]:
                test_cuda.test_flex_float32_matches_per_sequence(mode, kw, workload)
        test_cuda.test_no_host_sync_per_segment("packed", "none", (160, 160))
        test_cuda.test_no_host_sync_per_segment("dfs", "grpo", (128, 64))
        print(f"prelude done; dynamo cache entries: {cache_sizes()}", flush=True)
        print(f"prelude's recompile limits hit: {limit_hits()}", flush=True)
    from treerl.engine import decoder, loss_head
    head_kernels, compiled_block = loss_head._kernels, decoder._BLOCK
    for variant in args.variants.split(","):
        tree_engine.prepare_batch = sync_prepare if variant == "sync-copy" else prepare_batch
        # (the head's chunk functions as the engine picks them: eager for "eager-head")
        loss_head._kernels = ((lambda compiled, hidden: head_kernels(False, hidden)) if variant == "eager-head"
                              else head_kernels)
        decoder._BLOCK = decoder._run_block if variant == "eager-blocks" else compiled_block
        cases(variant)


if __name__ == "__main__":
    main()
