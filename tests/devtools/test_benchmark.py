"""Benchmark plumbing: the workloads' shapes (deterministic by seed), the naive baseline
(the same loss and gradients as the engine, float64), `treerl bench` rows and options,
and a smoke run of bench/bench_sweeps.py on tiny sizes. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.models import get_model
from helpers.reference import assert_grads_close, grads_of, zero_grads
from treerl import PrefixTree, TreeEngine
from treerl.devtools.benchmark import BenchConfig, NaiveLoop, main as bench_main, run, useful_flops, weighted_logprob_loss
from treerl.models import build_model
from treerl.devtools.workloads import SCALES, WORKLOADS, make_workload

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------ workloads
@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("scale", ["tiny", "small", "paper"])
def test_workloads_are_deterministic_by_seed(name, scale):
    vocab = 151936 if scale == "paper" else 512
    a = make_workload(name, SCALES[scale], vocab, seed=3)
    b = make_workload(name, SCALES[scale], vocab, seed=3)
    c = make_workload(name, SCALES[scale], vocab, seed=4)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert len(a) != len(c) or any(not np.array_equal(x, y) for x, y in zip(a, c))
    assert all(x.min() >= 0 and x.max() < vocab for x in a)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", ["tiny", "paper"])
def test_long_context_shape(scale, seed):
    spec = SCALES[scale]
    seqs = make_workload("long", spec, 151936 if scale == "paper" else 512, seed=seed)
    assert len(seqs) == spec.long_groups * spec.long_responses
    lo, hi = spec.long_response_len
    for g in range(spec.long_groups):
        group = seqs[g * spec.long_responses:(g + 1) * spec.long_responses]
        prefix = group[0][: spec.long_prefix_len]
        for s in group:
            assert np.array_equal(s[: spec.long_prefix_len], prefix)
            assert lo <= len(s) - spec.long_prefix_len <= hi
        # the responses diverge right after the prefix
        assert len({int(s[spec.long_prefix_len]) for s in group}) == spec.long_responses
    tree = PrefixTree.from_sequences(seqs)
    assert tree.num_roots == spec.long_groups
    assert tree.num_tree_tokens == spec.long_groups * spec.long_prefix_len + sum(len(s) - spec.long_prefix_len for s in seqs)
    if scale == "paper":
        assert 4.5 < tree.ideal_ratio < 5.5  # the long-context batch: ideal ratio ~4.9


def _turn_structure(seqs):
    """Per sequence: how many other sequences are strict prefixes of it (its turn index)."""
    as_tuples = [tuple(s.tolist()) for s in seqs]
    present = set(as_tuples)
    depth = []
    for s in as_tuples:
        depth.append(sum(1 for n in range(1, len(s)) if s[:n] in present))
    return depth


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tree_rollout_shape(seed):
    spec = SCALES["tiny"]
    seqs = make_workload("tree", spec, 512, seed=seed)
    tree = PrefixTree.from_sequences(seqs)
    assert tree.num_roots == spec.tree_groups
    depth = _turn_structure(seqs)
    assert max(depth) == spec.tree_turns - 1 and min(depth) == 0
    # every intermediate context is a training sequence: each sequence of turn k > 0
    # extends exactly one of turn k - 1 (its parent context), and every context of turn
    # k < last is extended by 2-3 of turn k + 1 (the fork)
    as_tuples = [tuple(s.tolist()) for s in seqs]
    lo, hi = spec.tree_branching
    for i, s in enumerate(as_tuples):
        children = [t for j, t in enumerate(as_tuples) if depth[j] == depth[i] + 1 and t[: len(s)] == s]
        if depth[i] < spec.tree_turns - 1:
            assert lo <= len(children) <= hi
            # each child = this context + an observation + an action
            extra = [len(t) - len(s) for t in children]
            assert all(spec.observation_len[0] + spec.action_len[0] <= e <= spec.observation_len[1] + spec.action_len[1] for e in extra)
            # the children share this context's observation, then diverge at their first action token
            shared = len(s)
            while all(len(t) > shared and t[shared] == children[0][shared] for t in children):
                shared += 1
            assert spec.observation_len[0] <= shared - len(s) <= spec.observation_len[1]
            assert len({t[shared] for t in children}) == len(children)
        else:
            assert not children  # a leaf: a root-to-leaf path
    roots = [s for s, d in zip(as_tuples, depth) if d == 0]
    assert lo * spec.tree_groups <= len(roots) <= hi * spec.tree_groups
    for r in roots:  # turn 0: prompt + observation + an action
        extra = len(r) - spec.tree_prompt_len
        assert spec.observation_len[0] + spec.action_len[0] <= extra <= spec.observation_len[1] + spec.action_len[1]
    assert tree.num_leaves == sum(1 for d in depth if d == spec.tree_turns - 1)


def test_tree_rollout_paper_scale():
    spec = SCALES["paper"]
    seqs = make_workload("tree", spec, 151936, seed=0)
    depth = _turn_structure(seqs)
    assert spec.tree_turns == 4 and spec.tree_branching == (2, 3) and max(depth) == 3
    leaves = sum(1 for d in depth if d == 3)
    assert 2 * 2**4 <= leaves <= 2 * 3**4
    assert PrefixTree.from_sequences(seqs).ideal_ratio > 5


# ------------------------------------------------------------------ naive baseline
def test_naive_loop_equals_engine_float64(gen):
    """The naive baseline (HF attention, one sequence per call) computes the loss and
    gradients the engine computes: it measures the same work."""
    model = get_model("qwen3")
    seqs = make_workload("grpo", SCALES["tiny"], 64, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    seqs.append(np.array([5]))  # a 1-token sequence: nothing to predict, no call
    tree = PrefixTree.from_sequences(seqs)
    loss_fn = weighted_logprob_loss(tree, seed=1)
    out = {}
    for name, runner in (("naive", NaiveLoop(model)), ("flat", TreeEngine(model, "flat", max_tokens=40))):
        zero_grads(model)
        value = runner.forward_backward(tree, loss_fn, separable=True)
        out[name] = value, grads_of(model), runner.stats.model_calls
    assert out["naive"][0] == pytest.approx(out["flat"][0], rel=1e-9)
    assert_grads_close(out["naive"][1], out["flat"][1], 1e-9, 1e-3)
    assert out["naive"][2] == len(seqs) - 1
    zero_grads(model)
    with pytest.raises(ValueError, match="separable"):
        NaiveLoop(model).forward_backward(tree, loss_fn, separable=False)


# ------------------------------------------------------------------ treerl bench
def test_bench_rows_every_mode_and_new_workloads():
    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    cfg = BenchConfig(shape="tiny", scale="tiny", workloads=("long", "tree"), modes=("naive", "flat", "packed", "dfs", "auto"),
                      max_tokens=24, chunk_tokens=8, repeats=1, warmup=0, peak_tflops=100.0)
    rows = run(cfg, model=model, progress=False)
    assert [(r.workload, r.mode) for r in rows] == [(w, m) for w in cfg.workloads for m in cfg.modes]
    long_seqs = make_workload("long", SCALES["tiny"], 512)
    assert max(map(len, long_seqs)) > 24  # flat runs sequences over max_tokens (chained), packed refuses the trees
    for r in rows:
        if r.mode == "packed":  # every tree is over 24 tokens: a refusal is a row, not a crash
            assert r.error.startswith("refused") and "max_tokens=24" in r.error, r
            continue
        assert r.error is None, r
        assert r.seconds > 0 and r.tflops > 0 and r.pct_of_peak == pytest.approx(100 * r.tflops / 100.0)
        assert r.vs_naive > 0 and r.speedup > 0
        assert r.tflops == pytest.approx(useful_flops(model, PrefixTree.from_sequences(make_workload(r.workload, SCALES["tiny"], 512))) / r.seconds / 1e12)
    flat_long = next(r for r in rows if r.workload == "long" and r.mode == "flat")
    assert "chains" in flat_long.plan and " 0 chains" not in flat_long.plan
    naive = next(r for r in rows if r.workload == "tree" and r.mode == "naive")
    assert naive.calls == naive.sequences and naive.vs_naive == 1.0


def test_bench_cli_options(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_main(["--shape", "tiny", "--scale", "tiny", "--workloads", "long", "--modes", "naive,auto",
                "--repeats", "1", "--warmup", "0", "--peak-tflops", "50", "--json", str(out)])
    text = capsys.readouterr().out
    assert "% peak" in text and "vs naive" in text and "% of 50 TFLOP/s" in text
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["rows"]] == ["flat", "naive", "auto"]  # flat always measured
    assert data["config"]["max_tokens"] is None and all(r["max_tokens"] for r in data["rows"] if r["mode"] != "naive")
    for bad, name in ((["--workloads", "grpo,nope"], "nope"), (["--modes", "flat,fast"], "fast")):
        with pytest.raises(SystemExit) as exit_:
            bench_main(["--shape", "tiny", "--scale", "tiny", *bad])
        assert exit_.value.code == 2
        assert f"unknown {'workload' if name == 'nope' else 'mode'} {name}" in capsys.readouterr().err


# ------------------------------------------------------------------ sweeps (smoke)
def _load_sweeps():
    if "bench_sweeps" not in sys.modules:  # bench/ is not a package (dataclasses need the module registered)
        spec = importlib.util.spec_from_file_location("bench_sweeps", ROOT / "bench" / "bench_sweeps.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_sweeps"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_sweeps"]


def test_sharing_sequences_hit_the_target_ratio():
    sweeps = _load_sweeps()
    for ratio in (1, 2, 4, 8, 16):
        seqs, prompt = sweeps.sharing_sequences(ratio, 2, 32, 256, 151936, seed=0)
        tree = PrefixTree.from_sequences(seqs)
        assert len(seqs) == 64 and all(len(s) == 256 for s in seqs)
        assert tree.ideal_ratio == pytest.approx(ratio, rel=0.02)
        assert tree.num_tree_tokens == (2 * prompt + 64 * (256 - prompt) if prompt else 64 * 256)
    with pytest.raises(ValueError):
        sweeps.sharing_sequences(40, 1, 32, 256, 1000)


def test_sweeps_smoke(tmp_path):
    sweeps = _load_sweeps()
    out = tmp_path / "sweeps"
    result = sweeps.main(["--shape", "tiny", "--scale", "tiny", "--out", str(out), "--ratios", "1,4,16",
                          "--chunks", "4,16", "--repeats", "1", "--warmup", "0"])
    data = json.loads((out / "sweeps.json").read_text())
    assert (out / "sharing.png").stat().st_size > 0 and (out / "chunks.png").stat().st_size > 0
    rows = data["rows"]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    share = [r for r in rows if r["sweep"] == "sharing"]
    assert {(r["target_ratio"], r["mode"]) for r in share} == {(t, m) for t in (1, 4, 16) for m in ("flat", "dfs", "auto")}
    for r in share:
        assert r["ideal_ratio"] == pytest.approx(r["target_ratio"], rel=0.1)
        assert r["speedup"] > 0 and r["tflops"] > 0
        assert r["flat_tokens"] == 24 * 48  # the same flat work at every point
    chunk = [r for r in rows if r["sweep"] == "chunks"]
    assert {(r["workload"], r["mode"], r["chunk_tokens"]) for r in chunk} == {
        (w, m, c) for w in ("agentic", "long") for m in ("dfs", "auto", "auto-fixed") for c in (4, 16)}
    for w in ("agentic", "long"):
        dfs = {r["chunk_tokens"]: r for r in chunk if r["workload"] == w and r["mode"] == "dfs"}
        assert dfs[4]["calls"] > dfs[16]["calls"]  # smaller chunks, more calls
        assert dfs[4]["peak_live_tokens"] <= 4 and dfs[16]["peak_live_tokens"] <= 16
        assert dfs[4]["recomputed_tflop"] >= dfs[16]["recomputed_tflop"] > 0  # dfs runs a no-grad pass first
        fixed = {r["chunk_tokens"]: r for r in chunk if r["workload"] == w and r["mode"] == "auto-fixed"}
        assert all(r["max_tokens"] == 16 and r["peak_live_tokens"] <= 16 for r in fixed.values())
        assert fixed[4]["calls"] > fixed[16]["calls"] and " 0 chains" not in fixed[4]["plan"]
    assert result.rows and "sharing:" in result.tables() and "chunks:" in result.tables()


def test_sweeps_time_limit_skips_points(tmp_path, capsys):
    sweeps = _load_sweeps()
    out = tmp_path / "late"
    sweeps.main(["--shape", "tiny", "--scale", "tiny", "--out", str(out), "--ratios", "2", "--chunks", "4",
                 "--chunk-workloads", "long", "--max-seconds", "0"])
    rows = json.loads((out / "sweeps.json").read_text())["rows"]
    assert len(rows) == 3 + 3 and all(r["error"].startswith("skipped") for r in rows)
    assert not (out / "sharing.png").exists()
    assert "skipped" in capsys.readouterr().out
