"""The synchronous RL trainer: one readable loop over three parts that each own their state.

    Sampler  (treerl.sampler)  problems -> rollout (groups or episodes) -> scored samples
    Learner  (treerl.learner)  samples -> tree forwards -> advantages -> minibatch updates
    Sampler.sync_weights       the new weights go to the rollout engine (version += 1)
    trainer_state              checkpoint state and exact resume

Also supervised fine-tuning (SFT: the sampler builds the batch, the learner updates) and
held-out evaluation. ``Trainer(config, model=None, tokenizer=None, task=None).train()``
is :func:`treerl.run.train`; :meth:`Trainer.step` is one RL step.

Under torchrun (WORLD_SIZE > 1) the same loop is data parallel (README, "Multi-GPU";
:mod:`treerl.distributed.ranks`): the policy is FSDP2-sharded, each rank rolls out its
share of the prompts with a whole copy of the weights, the samples are all-gathered
(advantages on the global batch), and forwards and minibatch updates run on tree-aware
shares with globally normalised losses, so an update equals the one-process update of
the same batch.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import trainer_state
from .build import build_engines, build_policy, default_tokenizer
from .config import Config
from .distributed import ranks
from .learner import Learner, check_proximal, step_metrics
from .overlap import GroupForwards
from .preflight import check_tokenizer_fits
from .rollout import SamplingParams
from .sampler import Sampler
from .samples import Sample
from .tasks import get_task
from .tasks.base import Problem, Task

__all__ = ["Trainer", "Sample"]  # Sample: its home is treerl.samples


class Trainer:
    """Owns the models and engines (policy ``model``/``engine``, ``reference``, ``critic``),
    the task and tokenizer, the step counters and the last step's samples; the
    :class:`~treerl.sampler.Sampler` (``sampler``) owns rollout and data order, the
    :class:`~treerl.learner.Learner` (``learner``) the optimizers and schedule."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 task: Task | None = None):
        self.cfg = config
        validate(config)
        torch.manual_seed(config.train.seed)
        random.seed(config.train.seed)
        np.random.seed(config.train.seed)
        self.task = task if task is not None else get_task(config.task.name, **config.task.kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer(config, self.task)
        self.dist = ranks.setup(config)
        self.device = self.dist.device if self.dist else torch.device(config.train.device)
        self.model = (model if model is not None else build_policy(config, self.tokenizer)).to(self.device)
        check_tokenizer_fits(self.tokenizer, self.model, "model.path" if config.model.path else "model")
        engines = build_engines(config, self.model, self.device)
        self.engine, self.reference, self.critic = engines.policy, engines.reference, engines.critic
        self.sampler = Sampler(config, self.task, self.tokenizer, self.model, self.dist)  # before sharding
        if self.dist:
            ranks.shard([e for e in (self.engine, self.critic) if e is not None], self.device,
                        config.train.autocast_bf16)
        self.learner = Learner(config, engines, self.device, self.dist)
        self.step_count = 0
        self.sft_count = 0
        self.last_samples: list[Sample] = []
        if self.dist and self.dist.rank:  # ranks sample their own prompts with their own streams
            torch.manual_seed(config.train.seed + 7919 * self.dist.rank)

    # --------------------------------------------------------------- the parts
    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that writes logs and checkpoints."""
        return self.dist is None or self.dist.is_main

    @property
    def rollout(self):
        """The rollout engine (:class:`~treerl.rollout.RolloutEngine`; its ``version``)."""
        return self.sampler.rollout

    @property
    def agents(self):
        """Agent episodes / a served or remote rollout backend (treerl.agents), or None."""
        return self.sampler.agents

    @property
    def format(self):
        return self.sampler.format

    @property
    def multi_turn(self) -> bool:
        return self.sampler.multi_turn

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    @property
    def scheduler(self):
        return self.learner.scheduler

    @property
    def critic_opt(self) -> torch.optim.Optimizer | None:
        return self.learner.critic_opt

    def _share(self, seqs: list) -> list[int]:
        """This rank's sequences of a batch every rank holds (:func:`ranks.share`)."""
        return ranks.share(self.dist, seqs)

    # ---------------------------------------------------------------- rollout
    def next_problems(self, n: int) -> list[Problem]:
        return self.sampler.next_problems(n)

    def sampling_params(self, n: int, greedy: bool = False) -> SamplingParams:
        return self.sampler.sampling_params(n, greedy)

    def generate_samples(self, problems: list[Problem], n: int, greedy: bool = False) -> list[Sample]:
        """Roll out ``n`` samples (episodes) per problem and score them."""
        return self.sampler.generate(problems, n, greedy)

    # ------------------------------------------------------------------- steps
    def step(self) -> dict[str, float]:
        """One synchronous RL step (rollout, then training on it); returns its metrics."""
        t0 = time.perf_counter()
        # rollout.overlap_forwards: the forwards of each finished group run during the rollout
        # (the embedded engine's groups; agent rollouts hand over none)
        ready = self.learner.group_forwards() if self.agents is None else None
        samples = self.sampler.step_samples(self.next_problems(self.cfg.rollout.prompts_per_step),
                                            self.cfg.rollout.group_size, ready)
        metrics = self.train_on(samples, rollout_seconds=time.perf_counter() - t0, ready=ready)
        if self.agents is not None:
            metrics.update(self.agents.pop_metrics())
        return metrics

    def train_on(self, samples: list[Sample], rollout_seconds: float = 0.0,
                 proximal: str = "recompute", ready: GroupForwards | None = None) -> dict[str, float]:
        """Train on a batch of scored samples (from this trainer's rollout or from
        asynchronous workers: behaviour logprobs and versions come with the samples), then
        give the rollout engine the new weights. ``proximal``: see
        :meth:`treerl.learner.Learner.train_on`. Data parallel: every rank passes the same
        global batch. ``ready``: forwards run during the rollout (:mod:`treerl.overlap`)."""
        check_proximal(proximal, self.cfg.algorithm.advantage)
        self.last_samples = samples
        update = self.learner.train_on(samples, self.rollout.version, self.step_count, proximal, ready)
        t = time.perf_counter()
        self.sampler.sync_weights(self.model)
        update.timings["update"] += time.perf_counter() - t
        timings = {"rollout": rollout_seconds, **update.timings}
        if self.dist:  # the slowest rank's times
            timings = {k: max(t[k] for t in ranks.gather_list([timings])) for k in timings}
        update.timings = {k: v for k, v in timings.items() if k != "rollout"}
        self.step_count += 1
        return step_metrics(samples, update, self.rollout.version, self.learner.scheduler.get_last_lr()[0],
                            timings["rollout"])

    def sft_step(self, problems: list[Problem] | None = None) -> dict[str, float]:
        """One supervised step on prompt + target (+ eos), token-mean NLL of the target."""
        seqs, masks = self.sampler.sft_batch(problems or self.next_problems(self.cfg.sft.batch_size))
        metrics = self.learner.sft_update(seqs, masks)
        self.sft_count += 1
        self.sampler.sync_weights(self.model)
        return metrics

    def evaluate(self, n: int | None = None) -> dict[str, float]:
        """Greedy accuracy and mean reward on the task's held-out problems."""
        return self.sampler.evaluate(n)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The trainer state of a checkpoint (:func:`treerl.trainer_state.state_dict`)."""
        return trainer_state.state_dict(self)

    def save(self, out_dir: str | Path | None = None) -> Path:
        """Write a checkpoint (:func:`treerl.trainer_state.save`)."""
        return trainer_state.save(self, out_dir)

    def load(self, checkpoint: str | Path) -> Path:
        """Restore from a checkpoint (:func:`treerl.trainer_state.load`)."""
        return trainer_state.load(self, checkpoint)


def validate(cfg: Config) -> None:
    """Refuse settings the trainer cannot run, with one line naming the key
    (:meth:`treerl.config.Config.validate`: every key's declared type and range)."""
    cfg.validate()
