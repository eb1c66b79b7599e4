"""The README's table of bad inputs and faults: at least 90 rows, each naming a test that
exists (a `def test_...` in the named file), so every row stays backed by a test."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fault_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Bad input and faults", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]


def test_the_fault_table_has_90_rows_each_backed_by_an_existing_test():
    rows = fault_rows()
    assert len(rows) >= 90
    numbers = [int(row.split("|")[1]) for row in rows]
    assert numbers == list(range(1, len(rows) + 1)), "rows are numbered 1..N in order"
    for row in rows:  # none of them a traceback, a silent acceptance or a loss
        assert "Traceback" not in row and "silently" not in row.split("|")[3], row
    defined: dict[str, set[str]] = {}
    for row in rows:
        refs = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", row)
        assert refs, f"row without a test: {row}"
        for path, name in refs:
            if path not in defined:
                tree = ast.parse((ROOT / path).read_text())
                defined[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined[path], f"{path}::{name} (README fault table) does not exist"
