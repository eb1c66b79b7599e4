"""bench/dta_compare.py on CPU with the tiny model: the treerl rows end to end, a missing
``.dta/`` as one clear error, and (when ``scripts/get_dta.sh`` has been run) the DTA authors'
engine giving treerl's gradients on the same loss. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--model-shape", "tiny", "--dtype", "float32", "--scale", "tiny",
        "--repeats", "1", "--row-seconds", "0"]


def _load():
    if "dta_compare" not in sys.modules:  # bench/ is not a package
        spec = importlib.util.spec_from_file_location("dta_compare", ROOT / "bench" / "dta_compare.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dta_compare"] = module
        spec.loader.exec_module(module)
    return sys.modules["dta_compare"]


def test_treerl_rows_on_cpu(tmp_path, capsys):
    dc = _load()
    out = tmp_path / "dta.json"
    dc.main(TINY + ["--shapes", "grpo", "--engines", "auto,dfs", "--no-grad-check", "--memory-budget", "0.5",
                    "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["engine"]) for r in rows] == [("grpo", "auto"), ("grpo", "dfs")]
    for r in rows:
        assert "error" not in r and r["seconds"] > 0 and len(r["times"]) == 1 and r["tflops"] > 0
        assert r["peak_bytes"] is None  # CPU: no allocator statistics
        assert r["settings"]["memory_budget"] == 0.5 and "compile" in r and "attention_shapes" in r
    same = {(r["shape"], r["engine"]): r["loss"] for r in rows}
    assert same[("grpo", "auto")] == pytest.approx(same[("grpo", "dfs")], rel=1e-5)
    table = capsys.readouterr().out
    assert "| grpo | 6 | 96 / 48 | 18 | auto |" in table


def test_unknown_shape_and_missing_dta_are_one_line_errors(tmp_path, monkeypatch, capsys):
    dc = _load()
    with pytest.raises(SystemExit):
        dc.main(TINY + ["--shapes", "grpo,wide"])
    assert "unknown shape wide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.main(TINY + ["--shapes", "grpo", "--memory-budget", "1.5"])
    assert "--memory-budget is a fraction of the device in (0, 1], got 1.5" in capsys.readouterr().err
    monkeypatch.setattr(dc, "DTA_DIR", tmp_path / "absent")
    with pytest.raises(SystemExit):
        dc.main(TINY + ["--shapes", "grpo", "--engines", "auto,dta"])
    err = capsys.readouterr().err
    assert "run scripts/get_dta.sh" in err and "absent" in err


@pytest.mark.skipif(not (ROOT / ".dta" / "tree_training_engine.py").is_file(),
                    reason=".dta/ missing: run scripts/get_dta.sh for the DTA engine's tests")
def test_dta_engine_gives_treerl_gradients(tmp_path):
    """The same loss and weights reach both engines: with blocks of 8 tokens (paths pop in
    blocks, fork logits carried) DTA's gradients equal treerl's to float32 rounding."""
    dc = _load()
    out = tmp_path / "dta.json"
    dc.main(TINY + ["--shapes", "long_prefix", "--engines", "auto,dta", "--dta-block-size", "8", "--out", str(out)])
    results = json.loads(out.read_text())
    for check in results["grad_check"]:
        assert "error" not in check
        assert check["loss_dta"] == pytest.approx(check["loss_treerl"], rel=1e-5)
        assert check["dta_vs_treerl"]["global_rel"] < 1e-5  # float32 model, both engines
        assert check["dta_ref_dtype_vs_ref"]["global_rel"] < 1e-6  # float64 model; DTA's float32 log-prob buffers
    rows = {r["engine"]: r for r in results["rows"]}
    assert "error" not in rows["dta"] and rows["dta"]["loss"] == pytest.approx(rows["auto"]["loss"], rel=1e-5)
    assert rows["auto"]["speedup_vs_dta"] > 0
