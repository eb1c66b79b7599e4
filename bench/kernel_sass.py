"""The sampling race's inner loop as sm_90 SASS, counted on any machine (no GPU): instructions a loop step and an
element, by opcode. The race is bound by its instructions (session 30), so their count predicts its time.

Compiles ``race_kernel._partial`` as ``race_kernel.race_kernel`` launches it (``tests/helpers/hopper.py``), disassembles
the cubin with Triton's ``nvdisasm`` and counts the instructions between the loop's label and its backward branch.

    python bench/kernel_sass.py [--rows 1024] [--dtype bfloat16] [--sass partial.sass]
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import triton  # noqa: E402

from helpers.hopper import Recorder, compile_launches  # noqa: E402
from treerl.rollout import race_kernel as rk  # noqa: E402

VOCAB = 151_936  # Qwen3's


def sass_of(compiled) -> str:
    """The compiled kernel's SASS (``nvdisasm`` of its cubin, with source lines)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the instructions of the longest loop (label to its backward branch) of ``sass``."""
    lines = sass.splitlines()
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.match(r"(\.L_x_\d+):", line)
        if not m:
            continue
        for j in range(i + 1, len(lines)):
            if f"BRA `({m.group(1)})" in lines[j]:
                if j - i > len(best):
                    best = lines[i:j + 1]
                break
    ops = collections.Counter()
    for line in best:
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--sass", help="write the whole SASS here")
    args = p.parse_args()
    if triton.knobs.runtime.interpret:
        raise SystemExit("kernel_sass.py compiles kernels: run it without TRITON_INTERPRET")
    recorder = Recorder(rk._partial)
    real = rk._partial, rk._combine
    rk._partial, rk._combine = recorder, Recorder(rk._combine)  # (the combine's launch recorded, not compiled)
    try:
        logits = torch.zeros(args.rows, VOCAB, dtype=getattr(torch, args.dtype))
        rk.race_kernel(logits, torch.ones(args.rows), torch.arange(args.rows, dtype=torch.int64))
    finally:
        rk._partial, rk._combine = real
    (compiled,) = compile_launches(recorder)
    sass = sass_of(compiled)
    if args.sass:
        Path(args.sass).write_text(sass)
    ops = loop_opcodes(sass)
    total = sum(ops.values())
    per_step = rk.BLOCK // (32 * rk.NUM_WARPS)  # elements a thread takes a loop step
    print(f"race _partial ({args.rows} rows, {args.dtype} logits, sm_90): {total} instructions a loop step, "
          f"{total / per_step:.1f} an element")
    for op, n in ops.most_common():
        print(f"  {n:5d}  {n / per_step:6.2f}/element  {op}")


if __name__ == "__main__":
    main()
