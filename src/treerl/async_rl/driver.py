"""``train_async(cfg)``: a whole asynchronous run, with the same outputs as
:func:`treerl.run.train` (metrics.jsonl, rollouts.jsonl, checkpoints, plots, summary).

SFT warm-up (if any) runs in the trainer process first; then rollout workers start and
:class:`~treerl.async_rl.runner.AsyncRunner` takes RL steps. Checkpoints hold the
trainer's state plus the ledger's units not yet trained on (``state["async"]``), so a
resumed run regenerates exactly those prompts: none is lost or trained twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import load_state, resolve_checkpoint, save_checkpoint
from ..config import Config
from ..runlog import RunLog
from ..samples import Sample
from ..trainer import Trainer
from .ledger import WorkLedger
from .lockstep import Leader, follow
from .runner import AsyncOptions, AsyncRunner


def save_async_checkpoint(trainer: Trainer, out_dir: str | Path, ledger: WorkLedger) -> Path:
    """``Trainer.save`` plus the ledger (atomically, in the same trainer_state.pt). Data
    parallel: rank 0 calls it (through its :class:`~.lockstep.Leader`, so the state is
    gathered on every rank) and writes the whole weights of its rollout copy."""
    root = Path(out_dir) / "checkpoints"
    state = {**trainer.state_dict(), "async": ledger.state_dict()}
    weights = trainer.sampler.rollout.model if trainer.dist else trainer.model
    return save_checkpoint(root, trainer.step_count, weights, trainer.tokenizer, state,
                           keep_last=trainer.cfg.train.keep_last)


def train_async(cfg: Config, resume: str | Path | None = None, options: AsyncOptions | None = None,
                trainer: Trainer | None = None) -> dict:
    """Run ``cfg`` to completion with asynchronous rollout workers; returns the final
    metrics (and ``checkpoint``, ``wall_s``) like ``treerl.run.train``."""
    out = Path(cfg.train.out_dir)
    trainer = trainer or Trainer(cfg)
    path = trainer.load(resolve_checkpoint(resume)) if resume else None  # every rank
    if trainer.dist is not None:  # data parallel: rank 0 leads, the others repeat its collectives
        if not trainer.is_main:
            follow(trainer)
            return {"checkpoint": str(path or out), "wall_s": 0.0}
        leader = Leader(trainer)
        try:
            return _train_async(cfg, leader, path, options, out)
        finally:
            leader.stop()
    return _train_async(cfg, trainer, path, options, out)


def _train_async(cfg: Config, trainer: Trainer, path: Path | None, options: AsyncOptions | None, out: Path) -> dict:
    ledger = WorkLedger()
    resume = path is not None
    if resume:
        saved = load_state(path, trust=cfg.train.trust_checkpoint).get("async")
        if saved is not None:
            ledger = WorkLedger.from_state(saved)
        print(f"resumed from {path} (step {trainer.step_count}, version {trainer.sampler.rollout.version}, "
              f"{len(ledger.queued)} pending unit(s))", file=sys.stderr)
    run = RunLog(cfg, trainer, resumed=bool(resume))
    runner = None

    def on_step(metrics: dict, samples: list[Sample]) -> None:
        run.rl_step(metrics, samples, stale=f"{metrics['staleness/max']:.0f}", buf=metrics["async/buffered"])
        if cfg.train.save_every and trainer.step_count % cfg.train.save_every == 0:
            save_async_checkpoint(trainer, out, runner.ledger)

    try:
        run.warm_up()
        if trainer.step_count < cfg.train.steps:
            runner = AsyncRunner(cfg, trainer, options or AsyncOptions.from_config(cfg), ledger, out_dir=out)
            try:
                runner.run(cfg.train.steps, on_step)
            finally:
                runner.close()
            ledger = runner.ledger
    finally:
        run.close()
    return run.finish(save_async_checkpoint(trainer, out, ledger))
