"""The two processes of tests/engine/test_compile_cache.py's artifacts test, started when the
first test of tests/engine/ starts: the first imports torch and treerl and compiles with an
empty cache (~20 s on one core), the second imports and waits; they overlap the engine tests
before it, which run on one core (and time nothing). Started only when that test was
collected; it waits for them and checks what they printed. Whatever still runs at the end is
killed."""

from __future__ import annotations

import pytest

from helpers.compile_runs import child_env, start
from helpers.processes import kill_leftovers

ARTIFACTS_TEST = "test_a_second_process_loads_the_artifacts_of_the_first"


@pytest.fixture(scope="session", autouse=True)
def compile_cache_runs(request, tmp_path_factory):
    """For :data:`ARTIFACTS_TEST`: ``(tmp, first, second)``, ``first`` compiling with the cache
    directory ``tmp / "compile"`` (``XDG_CACHE_HOME`` under ``tmp``), ``second`` (the same
    directory, ``TORCHINDUCTOR_CACHE_DIR`` an empty ``tmp / "fresh-inductor"``) waiting for
    its ``go``; None when that test was not collected."""
    if ARTIFACTS_TEST not in {item.name for item in request.session.items}:
        yield None
        return
    tmp = tmp_path_factory.mktemp("compile-cache")
    env = child_env(tmp)
    procs = []
    try:
        # a fresh machine with only the artifacts file: the second process imports while the
        # first runs, and enables the directory (loading the file) only after the first has exited
        procs.append(start(str(tmp / "compile"), dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp / "fresh-inductor")),
                           wait=True))
        procs.append(start(str(tmp / "compile"), env))
        yield tmp, procs[1], procs[0]
    finally:
        kill_leftovers(procs)
