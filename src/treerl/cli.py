"""The `treerl` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"bench": "tree-vs-flat engine benchmark"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        p = argparse.ArgumentParser(prog="treerl", description="RL post-training over prefix trees.")
        p.add_argument("command", choices=list(commands), help="; ".join(f"{k}: {v}" for k, v in commands.items()))
        p.parse_args(argv[:1])
        return 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .benchmark import main as bench_main

        bench_main(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
