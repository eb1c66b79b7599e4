"""The run summary and plots: seconds under a minute, SFT and RL steps counted apart (as
checkpoints are named by the RL step), the SFT warm-up span marked on the plots."""

import json

import pytest

from treerl.metrics import format_duration, format_steps, plot_metrics, summary


@pytest.mark.parametrize("seconds,text", [(0.04, "0.0 s"), (7.2, "7.2 s"), (59.9, "59.9 s"), (61, "1.0 min"),
                                          (3599, "60.0 min"), (5400, "1.50 h")])
def test_durations_use_a_readable_unit(seconds, text):
    assert format_duration(seconds) == text


def test_steps_say_sft_plus_rl():
    assert format_steps(120, 80) == "SFT 80 + RL 40  (metrics.jsonl steps 1-120)"
    assert format_steps(40, 0) == "40"
    assert format_steps(30, 80).startswith("SFT 30 + RL 0")  # stopped during the warm-up


def test_summary_of_a_short_run_with_warm_up():
    rows = [{"step": 0, "eval/accuracy": 0.0}, {"step": 80, "eval/accuracy": 0.7},
            {"step": 120, "eval/accuracy": 0.8, "reward/mean": 0.5}]
    text = summary(rows, 7.0, {"checkpoint": "runs/demo/checkpoints/step-000040"}, sft_steps=80)
    assert "wall time" in text and "7.0 s" in text and "0.0 min" not in text
    assert "SFT 80 + RL 40" in text


def test_plots_shade_the_sft_warm_up(tmp_path, monkeypatch):
    import matplotlib.axes

    spans = []
    real = matplotlib.axes.Axes.axvspan
    monkeypatch.setattr(matplotlib.axes.Axes, "axvspan", lambda self, *a, **k: spans.append((a, k)) or real(self, *a, **k))
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.0}, {"step": 80, "eval/accuracy": 0.7, "sft/loss": 1.0}]
    rows += [{"step": 80 + k, "reward/mean": 0.1 * k, "tree/ideal_ratio": 7.5, "perf/train_tokens_per_s": 100.0}
             for k in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot_metrics(path, tmp_path, sft_steps=80)
    assert {p.name for p in written} == {"reward.png", "tree_ratio.png", "throughput.png"}
    assert len(spans) == 3 and all(a[:2] == (0, 80) and "SFT warm-up" in k["label"] for a, k in spans)
    spans.clear()
    plot_metrics(path, tmp_path, sft_steps=0)
    assert not spans
