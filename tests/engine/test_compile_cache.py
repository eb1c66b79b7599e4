"""The compile cache's directory and artifacts file (issue 24 item 4): a run that compiles
writes the artifacts; a second process loads them (its compiled function then comes from
the cache). No timings: the plumbing only. Each run that compiles is a fresh Python process
(the directory is process-wide) compiling a small function on the CPU; the choice of the
directory alone is checked in this process, as a fresh one would make it (nothing is
compiled while it is enabled, and everything it changes is restored)."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.compile_runs import result


def enable_here(monkeypatch, tmp_path, directory: str | None) -> dict:
    """``compile_cache.enable(directory)`` in this process as in a fresh one: no directory
    enabled yet, no ``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME`` under ``tmp_path`` (all
    restored by ``monkeypatch``); what :data:`helpers.compile_runs.RUN` reports without compiling."""
    from treerl.engine import compile_cache

    for key in ("dir", "graphs", "device"):
        monkeypatch.setitem(compile_cache._state, key, None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = compile_cache.enable(directory)
    return dict(dir=str(path), saved=compile_cache.save(force=True) if path is None else "(not saved here)",
                cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def test_a_second_process_loads_the_artifacts_of_the_first(compile_cache_runs):
    # a fresh machine with only the artifacts file: the compiled graph comes from it. Both
    # processes were started with the first engine test (tests/engine/conftest.py): the second
    # imported while the first ran; it enables the directory (and loads the file) only now,
    # after the first has exited.
    tmp_path, first, waiting = compile_cache_runs
    cache = tmp_path / "compile"
    first = result(first)
    assert first["dir"] == str(cache) and first["cache_dir"] == str(cache / "inductor")
    assert first["saved"] and Path(first["saved"]).parent == cache and first["again"] is None
    assert first["misses"] >= 1 and first["hits"] == 0
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
