"""A whole training run around :class:`~treerl.trainer.Trainer`: SFT warm-up, RL steps
with a progress bar, periodic evaluation and checkpoints, exact resume, a rollout log
(for ``treerl tree-stats``), PNG plots and a one-screen summary at the end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .checkpoint import resolve_checkpoint
from .config import Config
from .metrics import MetricsLogger, plot_metrics, read_metrics, summary
from .trainer import Trainer


def train(cfg: Config, resume: str | Path | None = None, trainer: Trainer | None = None) -> dict:
    """Run ``cfg`` to completion; returns the final metrics (and paths).
    With ``async.enabled=true`` the run goes to :func:`treerl.async_rl.train_async`."""
    if cfg.async_.enabled:
        from .async_rl import train_async

        return train_async(cfg, resume=resume, trainer=trainer)
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    trainer = trainer or Trainer(cfg)
    if resume:
        path = trainer.load(resolve_checkpoint(resume))
        print(f"resumed from {path} (step {trainer.step_count}, version {trainer.rollout.version})", file=sys.stderr)
        # Rows logged after the checkpoint (before a crash) will be produced again.
        done_steps = cfg.sft.steps + trainer.step_count if trainer.step_count else trainer.sft_count
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            _truncate_jsonl(out / name, done_steps)
    log = MetricsLogger(out, tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb,
                        config=cfg.to_dict(), resume=bool(resume))
    rollouts = (out / "rollouts.jsonl").open("a" if resume else "w")
    t_start = time.perf_counter()
    total = cfg.sft.steps + cfg.train.steps
    done = trainer.sft_count + trainer.step_count
    bar = _bar(total, done, cfg.train.progress)
    try:
        if trainer.step_count == 0 and trainer.sft_count == 0:
            log.log(0, trainer.evaluate())
        while trainer.sft_count < cfg.sft.steps:
            metrics = trainer.sft_step()
            bar.update(1)
            bar.set_postfix(phase="sft", loss=f"{metrics['sft/loss']:.3f}")
            if trainer.sft_count == cfg.sft.steps:
                metrics.update(trainer.evaluate())
            log.log(trainer.sft_count, metrics)
        while trainer.step_count < cfg.train.steps:
            metrics = trainer.step()
            step = cfg.sft.steps + trainer.step_count
            if cfg.train.eval_every and trainer.step_count % cfg.train.eval_every == 0 or trainer.step_count == cfg.train.steps:
                metrics.update(trainer.evaluate())
            log.log(step, metrics)
            for s in trainer.last_samples:
                rollouts.write(json.dumps({"step": step, "group": s.group, "episode": s.episode,
                                           "reward": s.reward, "token_ids": s.token_ids}) + "\n")
            rollouts.flush()
            bar.update(1)
            bar.set_postfix(step=trainer.step_count, reward=f"{metrics['reward/mean']:.3f}",
                            acc=f"{metrics.get('eval/accuracy', float('nan')):.2f}",
                            tok_s=f"{metrics['perf/train_tokens_per_s']:.0f}",
                            tree=f"{metrics['tree/ideal_ratio']:.2f}x")
            if cfg.train.save_every and trainer.step_count % cfg.train.save_every == 0:
                trainer.save(out)
    finally:
        bar.close()
        rollouts.close()
        log.close()
    checkpoint = trainer.save(out)
    plots = plot_metrics(log.path, out)
    rows = read_metrics(log.path)
    wall = time.perf_counter() - t_start
    extra = {}
    after_sft = [r["eval/accuracy"] for r in rows if r["step"] == cfg.sft.steps and "eval/accuracy" in r]
    if cfg.sft.steps and after_sft:
        extra["accuracy after SFT warm-up"] = f"{after_sft[-1]:.4f}  (the rest is GRPO's)"
    extra.update({"checkpoint": str(checkpoint), "plots": ", ".join(p.name for p in plots), "metrics": str(log.path)})
    print(summary(rows, wall, extra))
    final = rows[-1] if rows else {}
    return {**final, "checkpoint": str(checkpoint), "wall_s": wall}


def _truncate_jsonl(path: Path, max_step: int) -> None:
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= max_step]
        path.write_text("".join(line + "\n" for line in keep))


def _bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="treerl", unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)
