"""The Triton kernels' CPU checks under Triton's interpreter, in every CI run.

The split-key decode attention, its merges, the prefill window kernel, the K/V copy kernel and
the sampling race, the rope kernel, the small-row products, the SiLU gate and the loss head's chunk kernels are checked against float64 / indexing references by tests that run on a GPU, or on
the CPU with ``TRITON_INTERPRET=1`` (set before Triton is imported: hence a process of its
own). This runs a quick selection of them that way (~30 s on 2 cores), so a change to a
kernel, or an environment whose interpreter breaks (numpy 2.4 with Triton 3.6: session 21),
fails CI instead of waiting for a GPU session.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
PAGING = "tests/rollout/test_rollout_paging.py::"
SELECTION = [
    "tests/rollout/test_rollout_kv_copy.py",
    PAGING + "test_split_kernel_reads_own_keys_through_the_block_table[torch.float32-64]",  # a tile per block
    PAGING + "test_split_kernel_reads_own_keys_through_the_block_table[torch.float32-48]",  # a lookup per key
    PAGING + "test_split_kernel_reads_no_key_past_a_rows_last_visible_key",
    PAGING + "test_merge_ranges_equals_merge_parts",
    PAGING + "test_merged_kernel_in_wide_key_tiles",
    PAGING + "test_prompt_part_programs_set_its_key_ranges",
    "tests/rollout/test_rollout_window_attention.py::test_window_attention_equals_float64_under_the_prefill_mask"
    "[16-90-4-2-528]",
    "tests/rollout/test_rollout_window_attention.py::test_window_attention_equals_float64_under_the_prefill_mask"
    "[1-300-4-2-8]",  # (one query a row: its own tensor from either branch)
    "tests/rollout/test_rollout_window_attention.py::test_window_attention_equals_float64_under_the_prefill_mask"
    "[1-300-4-2-528]",
    "tests/engine/test_head_kernel.py",  # (the training loss head's chunk kernels, and both heads through them)
    "tests/rollout/test_race_kernel.py",  # (the decode step's sampling race)
    "tests/rollout/test_rope_kernel.py",  # (the decode step's Q/K norm + RoPE + K/V write)
    "tests/rollout/test_small_products.py",  # (the decode step's small-row products and the tail through them)
    "tests/rollout/test_silu_gate.py",  # (the larger batches' SiLU gate and the tail through it)
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this run interprets the kernels' tests itself")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels' tests run compiled")
def test_the_decode_kernels_agree_with_their_references_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *SELECTION],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20, tail  # (the selection's tests ran: none skipped for want of triton)
