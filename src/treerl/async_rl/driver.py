"""``train_async(cfg)``: a whole asynchronous run, with the same outputs as
:func:`treerl.run.train` (metrics.jsonl, rollouts.jsonl, checkpoints, plots, summary).

SFT warm-up (if any) runs in the trainer process first; then rollout workers start and
:class:`~treerl.async_rl.runner.AsyncRunner` takes RL steps. Checkpoints hold the
trainer's state plus the ledger's units not yet trained on (``state["async"]``), so a
resumed run regenerates exactly those prompts: none is lost or trained twice.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..checkpoint import load_state, resolve_checkpoint, save_checkpoint
from ..config import Config
from ..metrics import MetricsLogger, plot_metrics, read_metrics, summary
from ..run import _bar, _truncate_jsonl
from ..trainer import Sample, Trainer
from .ledger import WorkLedger
from .runner import AsyncOptions, AsyncRunner


def save_async_checkpoint(trainer: Trainer, out_dir: str | Path, ledger: WorkLedger) -> Path:
    """``Trainer.save`` plus the ledger (atomically, in the same trainer_state.pt)."""
    root = Path(out_dir) / "checkpoints"
    state = {**trainer.state_dict(), "async": ledger.state_dict()}
    return save_checkpoint(root, trainer.step_count, trainer.model, trainer.tokenizer, state,
                           keep_last=trainer.cfg.train.keep_last)


def train_async(cfg: Config, resume: str | Path | None = None, options: AsyncOptions | None = None,
                trainer: Trainer | None = None) -> dict:
    """Run ``cfg`` to completion with asynchronous rollout workers; returns the final
    metrics (and ``checkpoint``, ``wall_s``) like ``treerl.run.train``."""
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    trainer = trainer or Trainer(cfg)
    ledger = WorkLedger()
    if resume:
        path = trainer.load(resolve_checkpoint(resume))
        saved = load_state(path).get("async")
        if saved is not None:
            ledger = WorkLedger.from_state(saved)
        print(f"resumed from {path} (step {trainer.step_count}, version {trainer.rollout.version}, "
              f"{len(ledger.queued)} pending unit(s))", file=sys.stderr)
        done_steps = cfg.sft.steps + trainer.step_count if trainer.step_count else trainer.sft_count
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            _truncate_jsonl(out / name, done_steps)
    log = MetricsLogger(out, tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb,
                        config=cfg.to_dict(), resume=bool(resume))
    rollouts = (out / "rollouts.jsonl").open("a" if resume else "w")
    t_start = time.perf_counter()
    total = cfg.sft.steps + cfg.train.steps
    bar = _bar(total, trainer.sft_count + trainer.step_count, cfg.train.progress)

    def on_step(metrics: dict, samples: list[Sample]) -> None:
        step = cfg.sft.steps + trainer.step_count
        if cfg.train.eval_every and trainer.step_count % cfg.train.eval_every == 0 or trainer.step_count == cfg.train.steps:
            metrics.update(trainer.evaluate())
        log.log(step, metrics)
        for s in samples:
            rollouts.write(json.dumps({"step": step, "group": s.group, "episode": s.episode,
                                       "reward": s.reward, "token_ids": s.token_ids}) + "\n")
        rollouts.flush()
        bar.update(1)
        bar.set_postfix(step=trainer.step_count, reward=f"{metrics['reward/mean']:.3f}",
                        stale=f"{metrics['staleness/max']:.0f}", buf=metrics["async/buffered"])
        if cfg.train.save_every and trainer.step_count % cfg.train.save_every == 0:
            save_async_checkpoint(trainer, out, runner.ledger)

    runner = None
    try:
        if trainer.step_count == 0 and trainer.sft_count == 0:
            log.log(0, trainer.evaluate())
        while trainer.sft_count < cfg.sft.steps:
            metrics = trainer.sft_step()
            bar.update(1)
            if trainer.sft_count == cfg.sft.steps:
                metrics.update(trainer.evaluate())
            log.log(trainer.sft_count, metrics)
        if trainer.step_count < cfg.train.steps:
            runner = AsyncRunner(cfg, trainer, options or AsyncOptions.from_config(cfg), ledger, out_dir=out)
            try:
                runner.run(cfg.train.steps, on_step)
            finally:
                runner.close()
            ledger = runner.ledger
    finally:
        bar.close()
        rollouts.close()
        log.close()
    checkpoint = save_async_checkpoint(trainer, out, ledger)
    plots = plot_metrics(log.path, out)
    rows = read_metrics(log.path)
    wall = time.perf_counter() - t_start
    print(summary(rows, wall, {"checkpoint": str(checkpoint), "plots": ", ".join(p.name for p in plots),
                               "metrics": str(log.path)}))
    final = rows[-1] if rows else {}
    return {**final, "checkpoint": str(checkpoint), "wall_s": wall}
