"""Child processes that tests start together (module or session fixtures) and each test waits on."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable


def kill_leftovers(procs: Iterable[subprocess.Popen]) -> None:
    """Kill every process of ``procs`` still running (a test that failed before stopping its own)
    and reap it, draining its pipes if it has any."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
