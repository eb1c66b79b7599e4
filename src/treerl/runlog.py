"""What every run writes (:class:`RunLog`), under ``cfg.train.out_dir``: config.yaml,
metrics.jsonl (and TensorBoard / wandb), rollouts.jsonl, the progress bar, and at the end
PNG plots and a one-screen summary. Driven by the synchronous loop
(:func:`treerl.run.train`) and the asynchronous one (:func:`treerl.async_rl.train_async`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint import list_checkpoints
from .config import Config, ConfigError
from .metrics import PLOTS, MetricsLogger, plot_metrics, read_metrics, summary
from .samples import Sample

if TYPE_CHECKING:
    from .trainer import Trainer


# Set by `treerl train`'s SIGINT/SIGTERM handler, which also raises KeyboardInterrupt at once.
# Python drops an exception raised inside a finalizer (a ``__del__``, a generator closed by
# the garbage collector: "Exception ignored in ..."), so a signal that lands there would be
# lost and the run would go on; every step checks this flag too (:meth:`RunLog.check_stop`).
stop_requested = threading.Event()


class RunLog:
    """A run's outputs under ``cfg.train.out_dir``: config.yaml, metrics.jsonl (and
    TensorBoard), rollouts.jsonl, the progress bar; at the end plots and a summary."""

    def __init__(self, cfg: Config, trainer: Trainer, resumed: bool):
        self.cfg, self.trainer = cfg, trainer
        self.out = Path(cfg.train.out_dir)
        # Data parallel: every rank drives the same loop (evaluation and checkpoints are
        # collectives), only rank 0 writes.
        self.main = getattr(trainer, "is_main", True)
        self.t_start = time.perf_counter()
        self.bar = _bar(cfg.sft.steps + cfg.train.steps, trainer.sft_count + trainer.step_count,
                        cfg.train.progress and self.main)
        self.log = self.rollouts = None
        if not self.main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(cfg.to_yaml())
        if resumed:  # rows logged after the checkpoint (before a crash) will be produced again
            done = cfg.sft.steps + trainer.step_count if trainer.step_count else trainer.sft_count
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                _truncate_jsonl(self.out / name, done)
        self.log = MetricsLogger(self.out, tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb,
                                 config=cfg.to_dict(), resume=resumed)
        self.rollouts = (self.out / "rollouts.jsonl").open("a" if resumed else "w")

    def warm_up(self) -> None:
        """The first evaluation (fresh runs) and the SFT steps not yet done."""
        trainer, cfg = self.trainer, self.cfg
        if trainer.step_count == 0 and trainer.sft_count == 0:
            self._log(0, trainer.evaluate())
        while trainer.sft_count < cfg.sft.steps:
            self.check_stop()
            metrics = trainer.sft_step()
            self.bar.update(1)
            self.bar.set_postfix(phase="sft", loss=f"{metrics['sft/loss']:.3f}")
            if trainer.sft_count == cfg.sft.steps:
                metrics.update(trainer.evaluate())
            self._log(trainer.sft_count, metrics)

    @staticmethod
    def check_stop() -> None:
        """Raise KeyboardInterrupt if a signal asked the run to stop (:data:`stop_requested`)."""
        if stop_requested.is_set():
            raise KeyboardInterrupt("stop requested by a signal")

    def rl_step(self, metrics: dict, samples: list[Sample], **postfix) -> None:
        """Log one RL step (evaluating when due) and its rollouts; then stop if a signal asked to."""
        trainer, cfg = self.trainer, self.cfg
        step = cfg.sft.steps + trainer.step_count
        if cfg.train.eval_every and trainer.step_count % cfg.train.eval_every == 0 or trainer.step_count == cfg.train.steps:
            metrics.update(trainer.evaluate())
        self._log(step, metrics)
        if self.rollouts is not None:
            for s in samples:
                self.rollouts.write(json.dumps({"step": step, "group": s.group, "episode": s.episode,
                                                "reward": s.reward, "token_ids": s.token_ids}) + "\n")
            self.rollouts.flush()
        self.bar.update(1)
        self.bar.set_postfix(step=trainer.step_count, reward=f"{metrics['reward/mean']:.3f}",
                             acc=f"{metrics.get('eval/accuracy', float('nan')):.2f}",
                             tok_s=f"{metrics['perf/train_tokens_per_s']:.0f}",
                             tree=f"{metrics['tree/ideal_ratio']:.2f}x", **postfix)
        self.check_stop()

    def _log(self, step: int, metrics: dict) -> None:
        if self.log is not None:
            self.log.log(step, metrics)

    def close(self) -> None:
        self.bar.close()
        if self.rollouts is not None:
            self.rollouts.close()
        if self.log is not None:
            self.log.close()

    def finish(self, checkpoint: Path) -> dict:
        """Plots and the summary; returns the final metrics with ``checkpoint`` and ``wall_s``
        (ranks other than 0 return only those two)."""
        if not self.main:
            return {"checkpoint": str(checkpoint), "wall_s": time.perf_counter() - self.t_start}
        plots = plot_metrics(self.log.path, self.out, sft_steps=self.cfg.sft.steps)
        rows = read_metrics(self.log.path)
        wall = time.perf_counter() - self.t_start
        extra = {}
        after_sft = [r["eval/accuracy"] for r in rows if r["step"] == self.cfg.sft.steps and "eval/accuracy" in r]
        if self.cfg.sft.steps and after_sft:
            extra["accuracy after SFT warm-up"] = f"{after_sft[-1]:.4f}  (the rest is RL's)"
        extra.update({"checkpoint": str(checkpoint), "plots": ", ".join(p.name for p in plots),
                      "metrics": str(self.log.path)})
        print(summary(rows, wall, extra, sft_steps=self.cfg.sft.steps))
        return {**(rows[-1] if rows else {}), "checkpoint": str(checkpoint), "wall_s": wall}


# What a run writes under train.out_dir (--overwrite removes these, nothing else).
RUN_OUTPUTS = ("config.yaml", "metrics.jsonl", "rollouts.jsonl", "tensorboard", "checkpoints", "weights",
               "weights_for_server", "wandb", *PLOTS)
HOLDS_A_RUN = ("metrics.jsonl", "rollouts.jsonl", "checkpoints")


def prepare_out_dir(cfg: Config, resume: Path | None, overwrite: bool = False, main: bool = True) -> None:
    """Refuse to mix runs (before anything is built): ``train.out_dir`` holding a run
    (metrics, rollouts or checkpoints) is continued only with ``resume`` (a checkpoint of
    that run) or started over with ``overwrite`` (its run outputs deleted). Also refuses
    an ``out_dir`` that is a file or cannot be written. Each problem is one
    :class:`ConfigError` line saying what to do. ``main``: the process that writes (rank 0).

    Under torchrun only rank 0 looks at the directory: it may be deleting the old outputs
    (``overwrite``) while the other ranks start, and a rank reading a directory that is being
    removed fails or decides differently (a race whose window is the deletion of the old
    checkpoints). Rank 0's refusal stops the job; the other ranks wait for it in the
    process group until torchrun ends them."""
    out = Path(cfg.train.out_dir)
    if resume is not None and overwrite:
        raise ConfigError("--overwrite starts over and --resume continues: pass one of them")
    if not main:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir: {out} is a file, not a directory: choose another train.out_dir")
    held = [name for name in HOLDS_A_RUN if (out / name).is_file() or any((out / name).glob("*"))]
    if held and resume is None:
        if not overwrite:
            raise ConfigError(f"train.out_dir: {out} already holds a run ({', '.join(held)}): continue it with "
                              f"--resume {out}, choose a new train.out_dir, or pass --overwrite to start over "
                              f"(deleting its outputs)")
        for name in RUN_OUTPUTS:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
        print(f"treerl: --overwrite: removed the outputs of the previous run in {out}", file=sys.stderr)
    if held and resume is not None and out.resolve() not in Path(resume).resolve().parents:
        raise ConfigError(f"train.out_dir: {out} holds another run than the checkpoint resumed ({resume}): resume "
                          f"with train.out_dir set to that checkpoint's run directory, or choose a new train.out_dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".treerl-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"train.out_dir: cannot write to {out} ({err.strerror or err}): choose a writable "
                          f"train.out_dir") from None


def resume_hint(out_dir: str | Path, config: str | None) -> str:
    """What an interrupted run's message offers: ``--resume`` only once a checkpoint exists."""
    out = Path(out_dir)
    if list_checkpoints(out / "checkpoints"):
        where = f" {config}" if config else ""
        return (f"the checkpoints under {out} are intact: continue with `treerl train{where} ... --resume {out}`")
    return (f"no checkpoint was written yet, so there is nothing to resume: start again with --overwrite "
            f"(or a new train.out_dir)")


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep the rows up to ``max_step`` (the checkpoint's); a line torn by a kill mid-write
    is dropped. Written to a temporary and renamed: a kill here loses nothing."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            print(f"treerl: dropping a torn line of {path} (written when the run was killed)", file=sys.stderr)
            continue
        if isinstance(row, dict) and row.get("step", max_step + 1) <= max_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _bar(total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="treerl", unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)
