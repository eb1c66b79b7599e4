"""The compile cache's directory and artifacts file (issue 24 item 4): a run that compiles
writes the artifacts; a second process loads them (its compiled function then comes from
the cache). No timings: the plumbing only. Each run that compiles is a fresh Python process
(the directory is process-wide) compiling a small function on the CPU; the choice of the
directory alone is checked in this process, as a fresh one would make it (nothing is
compiled while it is enabled, and everything it changes is restored)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def run(directory: str, env: dict, compile: bool = True) -> dict:
    return result(start(directory, env, compile))


@pytest.fixture
def env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PYTHONPATH=str(SRC), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    return env


def enable_here(monkeypatch, tmp_path, directory: str | None) -> dict:
    """``compile_cache.enable(directory)`` in this process as in a fresh one: no directory
    enabled yet, no ``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME`` under ``tmp_path`` (all
    restored by ``monkeypatch``); what :data:`RUN` reports without compiling."""
    from treerl.engine import compile_cache

    for key in ("dir", "graphs", "device"):
        monkeypatch.setitem(compile_cache._state, key, None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = compile_cache.enable(directory)
    return dict(dir=str(path), saved=compile_cache.save(force=True) if path is None else "(not saved here)",
                cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def test_a_second_process_loads_the_artifacts_of_the_first(tmp_path, env):
    cache = tmp_path / "compile"
    # a fresh machine with only the artifacts file: the compiled graph comes from it. The
    # second process imports while the first runs; it enables the directory (and loads the
    # file) only after the first has exited.
    env_fresh = dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "fresh-inductor"))
    waiting = start(str(cache), env_fresh, wait=True)
    try:
        first = run(str(cache), env)
        assert first["dir"] == str(cache) and first["cache_dir"] == str(cache / "inductor")
        assert first["saved"] and Path(first["saved"]).parent == cache and first["again"] is None
        assert first["misses"] >= 1 and first["hits"] == 0
    except BaseException:
        kill_leftovers([waiting])
        raise
    second = result(waiting, go=True)
    assert second["cache_dir"] == str(tmp_path / "fresh-inductor")  # an explicit one is kept
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["out"] == first["out"]


def test_the_default_directory_is_the_user_cache(tmp_path, monkeypatch):
    out = enable_here(monkeypatch, tmp_path, None)
    assert out["dir"] == str(tmp_path / "xdg" / "treerl" / "compile")
    assert out["cache_dir"] == str(tmp_path / "xdg" / "treerl" / "compile" / "inductor")


def test_an_empty_directory_leaves_torch_defaults(tmp_path, monkeypatch):
    out = enable_here(monkeypatch, tmp_path, "")
    assert out["dir"] == "None" and out["saved"] is None and out["cache_dir"] is None
    assert not (tmp_path / "xdg").exists()


def test_the_config_key_reaches_the_engine(monkeypatch, tmp_path):
    """``engine.compile_cache_dir`` is handed to the compile cache by every compiled engine
    (in-process: the directory is recorded, not enabled)."""
    import torch

    from treerl.build import build_engines
    from treerl.config import Config
    from treerl.engine import tree_engine
    from treerl.models import build_model

    seen = []
    monkeypatch.setattr(tree_engine, "enable_compile_cache", lambda directory, device=None: seen.append(directory))
    cfg = Config.from_yaml(None, ["engine.compile=true", f"engine.compile_cache_dir={tmp_path}"])
    build_engines(cfg.engine, build_model("qwen3", "tiny", dtype=torch.float32, seed=0), torch.device("cpu"),
                  temperature=1.0)
    assert seen == [str(tmp_path)]


def test_a_cache_dir_that_is_a_file_is_one_config_error(tmp_path, monkeypatch):
    """``engine.compile_cache_dir`` naming a file: one line naming the key, not a traceback."""
    import pytest

    from treerl.config import ConfigError
    from treerl.engine import compile_cache

    monkeypatch.setitem(compile_cache._state, "dir", None)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^engine\.compile_cache_dir: cannot use .*a_file"):
        compile_cache.enable(blocker / "cache")
