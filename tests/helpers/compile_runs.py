"""The child processes of tests/engine/test_compile_cache.py: :data:`RUN`, a fresh Python process
that enables a compile-cache directory, compiles a small function (or not) and prints what it
saw as one JSON line; :func:`start` starts one, :func:`result` waits for it and reads that line;
:func:`child_env`, their environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.processes import kill_leftovers

SRC = Path(__file__).resolve().parents[2] / "src"

RUN = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from treerl.engine import compile_cache

directory, compile = sys.argv[1], sys.argv[2] == "1"
if sys.argv[3:] == ["wait"]:  # started early (imports done meanwhile): enable once told to
    assert sys.stdin.readline() == "go\n"
path = compile_cache.enable(directory if directory != "-" else None)
out = torch.zeros(0)
if compile:
    fn = torch.compile(lambda x: (x.sin() * 2 + x.cos()).sum(-1), dynamic=True)
    out = fn(torch.arange(12.0).reshape(3, 4))
saved = compile_cache.save(force=not compile)
again = compile_cache.save()  # nothing new compiled since: nothing written
print(json.dumps(dict(dir=str(path), saved=str(saved) if saved else None, again=again,
                      cache_dir=__import__("os").environ.get("TORCHINDUCTOR_CACHE_DIR"),
                      hits=int(counters["inductor"]["fxgraph_cache_hit"]),
                      misses=int(counters["inductor"]["fxgraph_cache_miss"]), out=out.tolist())))
"""


def child_env(tmp: Path) -> dict:
    """This process's environment without torch's cache directories, treerl's source first on
    the path, ``XDG_CACHE_HOME`` under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PYTHONPATH=str(SRC), XDG_CACHE_HOME=str(tmp / "xdg"))
    return env


def start(directory: str, env: dict, compile: bool = True, wait: bool = False) -> subprocess.Popen:
    """A fresh process running :data:`RUN`; ``wait``: it imports, then waits for :func:`result`'s ``go``."""
    return subprocess.Popen([sys.executable, "-c", RUN, directory, "1" if compile else "0", *(["wait"] if wait else [])],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, go: bool = False) -> dict:
    """What ``proc`` printed (``go``: first let a waiting one go on)."""
    try:
        out, err = proc.communicate("go\n" if go else None, timeout=600)
    finally:
        kill_leftovers([proc])
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])
