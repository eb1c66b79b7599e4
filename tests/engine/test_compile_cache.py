"""The compile cache's directory and artifacts file (issue 24 item 4): a run that compiles
writes the artifacts; a second process loads them (its compiled function then comes from
the cache). No timings: the plumbing only. Each run is a fresh Python process (the
directory is process-wide) compiling a small function on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

RUN = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from treerl.engine import compile_cache

directory, compile = sys.argv[1], sys.argv[2] == "1"
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


def run(directory: str, env: dict, compile: bool = True) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, directory, "1" if compile else "0"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(PYTHONPATH=str(SRC), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    return env


def test_a_second_process_loads_the_artifacts_of_the_first(tmp_path, env):
    cache = tmp_path / "compile"
    first = run(str(cache), env)
    assert first["dir"] == str(cache) and first["cache_dir"] == str(cache / "inductor")
    assert first["saved"] and Path(first["saved"]).parent == cache and first["again"] is None
    assert first["misses"] >= 1 and first["hits"] == 0
    # a fresh machine with only the artifacts file: the compiled graph comes from it
    env_fresh = dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "fresh-inductor"))
    second = run(str(cache), env_fresh)
    assert second["cache_dir"] == str(tmp_path / "fresh-inductor")  # an explicit one is kept
    assert second["hits"] >= 1 and second["misses"] == 0
    assert second["out"] == first["out"]


def test_the_default_directory_is_the_user_cache(tmp_path, env):
    out = run("-", env, compile=False)
    assert out["dir"] == str(tmp_path / "xdg" / "treerl" / "compile")
    assert out["cache_dir"] == str(tmp_path / "xdg" / "treerl" / "compile" / "inductor")


def test_an_empty_directory_leaves_torch_defaults(tmp_path, env):
    out = run("", env, compile=False)
    assert out["dir"] == "None" and out["saved"] is None
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
