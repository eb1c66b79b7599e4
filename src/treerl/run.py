"""A whole training run around :class:`~treerl.trainer.Trainer`: SFT warm-up, RL steps
with a progress bar, periodic evaluation and checkpoints, exact resume, a rollout log
(for ``treerl tree-stats``), PNG plots and a one-screen summary at the end.

The synchronous loop is :func:`train`; with ``async.enabled=true`` it hands the run to
:func:`treerl.async_rl.train_async`. Both drive a :class:`~treerl.runlog.RunLog` (what
every run writes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .async_rl import train_async
from .checkpoint import resolve_checkpoint
from .config import Config
from .preflight import check_run_config
from .runlog import RunLog, prepare_out_dir
from .trainer import Trainer


def train(cfg: Config, resume: str | Path | None = None, trainer: Trainer | None = None,
          overwrite: bool = False) -> dict:
    """Run ``cfg`` to completion; returns the final metrics (and paths).
    With ``async.enabled=true`` the run goes to :func:`treerl.async_rl.train_async`.

    Under torchrun (WORLD_SIZE > 1) every rank runs this: the Trainer joins the process
    group and shards the policy, each rank rolls out its share of the prompts, and rank 0
    alone writes logs, metrics and checkpoints (README, "Multi-GPU").

    A ``train.out_dir`` that already holds a run is refused unless ``resume`` continues it
    or ``overwrite`` starts over, deleting its outputs (:func:`treerl.runlog.prepare_out_dir`)."""
    cfg.validate()
    check_run_config(cfg)  # device, model path / family / shape / overrides: one clear line, never a deep traceback
    if resume:  # a run directory: its newest intact checkpoint (damaged ones are skipped, with a note)
        resume = resolve_checkpoint(resume, skip_damaged=True)
    prepare_out_dir(cfg, resume or None, overwrite, main=os.environ.get("RANK", "0") == "0")
    if cfg.async_.enabled:
        return train_async(cfg, resume=resume, trainer=trainer)
    trainer = trainer or Trainer(cfg)
    if resume:
        path = trainer.load(resolve_checkpoint(resume))
        if trainer.is_main:
            print(f"resumed from {path} (step {trainer.step_count}, version {trainer.sampler.rollout.version})", file=sys.stderr)
    run = RunLog(cfg, trainer, resumed=bool(resume))
    try:
        run.warm_up()
        while trainer.step_count < cfg.train.steps:
            run.rl_step(trainer.step(), trainer.last_samples)
            if cfg.train.save_every and trainer.step_count % cfg.train.save_every == 0:
                trainer.save(cfg.train.out_dir)
    finally:
        run.close()
    return run.finish(trainer.save(cfg.train.out_dir))
