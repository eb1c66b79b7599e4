"""Per-step metrics: a JSONL file always, TensorBoard and Weights & Biases when installed
and enabled, PNG plots and a one-screen summary at the end of a run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

PLOTS = {
    "reward.png": [("reward/mean", "train reward"), ("eval/accuracy", "held-out accuracy")],
    "tree_ratio.png": [("tree/ideal_ratio", "flat / tree tokens")],
    "throughput.png": [("perf/train_tokens_per_s", "train flat tokens/s"), ("perf/rollout_tokens_per_s", "rollout tokens/s")],
}
Y_LABELS = {  # each plot's y axis
    "reward.png": "mean reward / accuracy (0-1)",
    "tree_ratio.png": "flat tokens / tree tokens",
    "throughput.png": "tokens per second",
}


class MetricsLogger:
    def __init__(self, out_dir: str | Path, tensorboard: bool = True, wandb: bool = False, config: dict | None = None,
                 resume: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None
        self._wandb = None
        if wandb:
            try:
                import wandb as wb

                self._wandb = wb.init(project="treerl", dir=str(self.out_dir), config=config or {})
            except Exception:
                self._wandb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key, value in row.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            if self._tb is not None:
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: str | Path, out_dir: str | Path, sft_steps: int = 0) -> list[Path]:
    """PNG plots of reward/accuracy, tree ratio and throughput over steps; steps
    1..``sft_steps`` (the SFT warm-up, no rollouts) are shaded and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    written = []
    for name, series in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        drawn = False
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if sft_steps > 0:
            ax.axvspan(0, sft_steps, color="0.85", zorder=0, label=f"SFT warm-up ({sft_steps} steps, no rollouts)")
        ax.set_xlabel("step (SFT, then RL)" if sft_steps > 0 else "step")
        ax.set_ylabel(Y_LABELS[name])
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def format_duration(seconds: float) -> str:
    """Seconds under a minute, minutes under an hour, else hours: '7.2 s', '3.4 min', '1.25 h'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_steps(last_step: int, sft_steps: int = 0) -> str:
    """The steps of a run whose metrics number SFT and RL steps together (RL step k is
    metrics step ``sft_steps + k``; checkpoints are named by the RL step)."""
    if sft_steps <= 0:
        return str(last_step)
    sft = min(last_step, sft_steps)
    return f"SFT {sft} + RL {last_step - sft}  (metrics.jsonl steps 1-{last_step})"


def summary(rows: list[dict], wall_s: float, extra: dict | None = None, sft_steps: int = 0) -> str:
    """A one-screen run summary."""

    def first_last(key, window):
        """Means of the first and last ``window`` values (noisy per-step series)."""
        vals = [r[key] for r in rows if r.get(key) is not None]
        if not vals:
            return None, None
        w = max(1, min(window, len(vals) // 2))
        return sum(vals[:w]) / w, sum(vals[-w:]) / w

    lines = ["", "=" * 64, "treerl run summary", "=" * 64]
    for key, label, window in [("eval/accuracy", "held-out accuracy", 1), ("reward/mean", "train reward (5-step mean)", 5),
                               ("tree/ideal_ratio", "tree ratio (flat/unique)", 5),
                               ("perf/train_tokens_per_s", "train tokens/s (5-step mean)", 5)]:
        a, b = first_last(key, window)
        if a is not None:
            lines.append(f"{label:30} start {a:10.4g}   end {b:10.4g}")
    flat = sum(r.get("tree/flat_tokens", 0) for r in rows)
    unique = sum(r.get("tree/tree_tokens", 0) for r in rows)
    if flat and unique:
        lines.append(f"{'tree tokens (all RL steps)':30} flat {flat:,.0f}   unique {unique:,.0f}   ({flat / unique:.2f}x)")
    episodes = sum(r.get("agent/episodes", 0) for r in rows)
    if episodes:
        failed = sum(r.get("agent/failed_episodes", 0) for r in rows)
        lines.append(f"{'agent episodes (training)':30} {episodes:,.0f}, failed {failed:,.0f}")
    lines.append(f"{'steps':30} {format_steps(rows[-1]['step'] if rows else 0, sft_steps)}")
    lines.append(f"{'wall time':30} {format_duration(wall_s)}")
    for k, v in (extra or {}).items():
        lines.append(f"{k:30} {v}")
    lines.append("=" * 64)
    return "\n".join(lines)
