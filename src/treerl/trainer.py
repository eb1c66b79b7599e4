"""The synchronous RL trainer: one readable loop over three parts that each own their state.

    Sampler  (treerl.sampler)  problems -> rollout (groups or episodes) -> scored samples
    Learner  (treerl.learner)  samples -> tree forwards -> advantages -> minibatch updates
    Sampler.sync_weights       the new weights go to the rollout engine (version += 1)

Also supervised fine-tuning (SFT: the sampler builds the batch, the learner updates) and
held-out evaluation. ``Trainer(config, model=None, tokenizer=None, task=None).train()``
is :func:`treerl.run.train`; :meth:`Trainer.step` is one RL step. The parts are used
directly: ``trainer.sampler`` (``rollout`` engine, ``next_problems``, ``generate``, ...)
and ``trainer.learner`` (``optimizer``, ``scheduler``, ...).

Checkpoints (:meth:`Trainer.save` / :meth:`Trainer.load`): the policy's weights, and the
trainer state of :meth:`Trainer.state_dict`: the step counters, the RNG states and the
config, with the learner's and the sampler's own ``state_dict`` (one flat mapping, the
file format of :mod:`treerl.checkpoint`), so a resumed run continues exactly.

Under torchrun (WORLD_SIZE > 1) the same loop is data parallel (README, "Multi-GPU";
:mod:`treerl.distributed.ranks`): the policy is FSDP2-sharded, each rank rolls out its
share of the prompts with a whole copy of the weights, the samples are all-gathered
(advantages on the global batch), and forwards and minibatch updates run on tree-aware
shares with globally normalised losses, so an update equals the one-process update of
the same batch. :meth:`Trainer.state_dict` and :meth:`Trainer.save` are then collectives
(every rank calls them): sharded optimizer and critic state are gathered whole, so a
checkpoint has the layout of a one-process one (either can resume the other), plus every
rank's RNG state (``rng_ranks``); rank 0 writes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .build import build_engines, build_task_policy, seed_all
from .checkpoint import load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import Config, ConfigError
from .distributed import ranks
from .distributed.data_parallel import all_gather_objects, load_full_state_dict
from .learner import Learner, check_proximal, step_metrics
from .lora import is_adapter_dir, is_peft
from .overlap import GroupForwards
from .preflight import check_resume_shape
from .sampler import Sampler
from .samples import Sample
from .tasks.base import Problem, Task

__all__ = ["Trainer", "Sample"]  # Sample: its home is treerl.samples


class Trainer:
    """Owns the models and engines (policy ``model``/``engine``, ``reference``, ``critic``),
    the task and tokenizer, the step counters, the RNG and the last step's samples; the
    :class:`~treerl.sampler.Sampler` (``sampler``) owns rollout and data order, the
    :class:`~treerl.learner.Learner` (``learner``) the optimizers and schedule."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 task: Task | None = None):
        self.cfg = config
        validate(config)
        t, a = config.train, config.algorithm
        seed_all(t.seed)
        self.dist = ranks.setup(t.device)
        self.device = self.dist.device if self.dist else torch.device(t.device)
        self.task, self.tokenizer, self.model = build_task_policy(config.model, config.task, t.seed, self.device,
                                                                  task=task, tokenizer=tokenizer, model=model)
        engines = build_engines(config.engine, self.model, self.device, temperature=config.rollout.temperature,
                                reference=a.kl_coef > 0, critic=a.advantage == "gae")
        self.engine, self.reference, self.critic = engines.policy, engines.reference, engines.critic
        self.sampler = Sampler(config.rollout, config.task, self.task, self.tokenizer, self.model, self.dist,
                               seed=t.seed, eval_problems=t.eval_problems,
                               weights_root=Path(t.out_dir) / "weights_for_server")  # before sharding
        if self.dist:
            ranks.shard([e for e in (self.engine, self.critic) if e is not None], self.device, t.autocast_bf16)
        self.learner = Learner(a, config.optim, engines, self.device, self.dist, total_steps=t.steps, seed=t.seed,
                               sft_lr=config.sft.lr, autocast_bf16=t.autocast_bf16)
        self.step_count = 0
        self.sft_count = 0
        self.last_samples: list[Sample] = []
        if self.dist and self.dist.rank:  # ranks sample their own prompts with their own streams
            torch.manual_seed(t.seed + 7919 * self.dist.rank)

    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that writes logs and checkpoints."""
        return self.dist is None or self.dist.is_main

    # ------------------------------------------------------------------- steps
    def step(self) -> dict[str, float]:
        """One synchronous RL step (rollout, then training on it); returns its metrics."""
        t0 = time.perf_counter()
        r = self.cfg.rollout
        # rollout.overlap_forwards: the forwards of each finished group run during the rollout
        # (the embedded engine's groups; agent rollouts hand over none)
        ready = self.learner.group_forwards(r.overlap_forwards) if self.sampler.agents is None else None
        samples = self.sampler.step_samples(self.sampler.next_problems(r.prompts_per_step), r.group_size, ready)
        metrics = self.train_on(samples, rollout_seconds=time.perf_counter() - t0, ready=ready)
        if self.sampler.agents is not None:
            metrics.update(self.sampler.agents.pop_metrics())
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
        rollout = self.sampler.rollout
        update = self.learner.train_on(samples, rollout.version, self.step_count, proximal, ready)
        t = time.perf_counter()
        self.sampler.sync_weights(self.model)
        update.timings["update"] += time.perf_counter() - t
        timings = {"rollout": rollout_seconds, **update.timings}
        if self.dist:  # the slowest rank's times
            timings = {k: max(t[k] for t in ranks.gather_list([timings])) for k in timings}
        update.timings = {k: v for k, v in timings.items() if k != "rollout"}
        self.step_count += 1
        return step_metrics(samples, update, rollout.version, self.learner.scheduler.get_last_lr()[0],
                            timings["rollout"])

    def sft_step(self, problems: list[Problem] | None = None) -> dict[str, float]:
        """One supervised step on prompt + target (+ eos), token-mean NLL of the target."""
        seqs, masks = self.sampler.sft_batch(problems or self.sampler.next_problems(self.cfg.sft.batch_size))
        metrics = self.learner.sft_update(seqs, masks)
        self.sft_count += 1
        self.sampler.sync_weights(self.model)
        return metrics

    def evaluate(self, n: int | None = None) -> dict[str, float]:
        """Greedy accuracy and mean reward on the task's held-out problems
        (:meth:`Sampler.evaluate <treerl.sampler.Sampler.evaluate>`). A step of the run like
        :meth:`sft_step`: data parallel, a collective that the asynchronous leader announces
        (:mod:`treerl.async_rl.lockstep`)."""
        return self.sampler.evaluate(n)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The trainer state of a checkpoint (everything but the policy's weights): the step
        counters (``step``, ``sft_steps``), the RNG states (``rng``; data parallel also
        ``rng_ranks``), the ``config``, and the learner's and the sampler's ``state_dict``
        (:meth:`Learner.state_dict <treerl.learner.Learner.state_dict>`,
        :meth:`Sampler.state_dict <treerl.sampler.Sampler.state_dict>`) as keys of the same
        mapping. Data parallel: a collective."""
        state = {"step": self.step_count, "sft_steps": self.sft_count, "rng": rng_state(), "config": self.cfg.to_dict()}
        for part in (self.learner.state_dict(), self.sampler.state_dict()):
            clash = state.keys() & part.keys()
            if clash:
                raise RuntimeError(f"checkpoint state keys {sorted(clash)} are written twice")
            state.update(part)
        if self.dist:
            rngs = all_gather_objects(state["rng"])
            state["rng"], state["rng_ranks"] = rngs[0], rngs
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the policy's weights already loaded): the learner's
        and the sampler's parts, the counters and this rank's RNG state (saved with another
        number of processes: rank 0's, the other ranks reseeded from the step)."""
        self.learner.load_state_dict(state)
        self.sampler.load_state_dict(state)
        self.step_count, self.sft_count = state["step"], state["sft_steps"]
        rngs = state.get("rng_ranks")
        rank, world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        if rngs is not None and len(rngs) == world:
            set_rng_state(rngs[rank])
        else:  # saved with another number of processes
            set_rng_state(state["rng"])
            if rank:
                torch.manual_seed(self.cfg.train.seed + 7919 * rank + 104729 * self.step_count)

    def save(self, out_dir: str | Path | None = None) -> Path:
        """Write a checkpoint under ``out_dir/checkpoints`` (default ``train.out_dir``;
        :func:`treerl.checkpoint.save_checkpoint`: atomic, plain data). Data parallel: every
        rank calls it, rank 0 writes the rollout engine's whole copy of the weights (which is
        the policy's)."""
        root = Path(out_dir or self.cfg.train.out_dir) / "checkpoints"
        keep = self.cfg.train.keep_last
        if self.dist is None:
            return save_checkpoint(root, self.step_count, self.model, self.tokenizer, self.state_dict(), keep_last=keep)
        import torch.distributed as dist

        state = self.state_dict()
        path = root / f"step-{self.step_count:06d}"
        if self.is_main:
            path = save_checkpoint(root, self.step_count, self.sampler.rollout.model, self.tokenizer, state,
                                   keep_last=keep)
        dist.barrier()
        return path

    def load(self, checkpoint: str | Path) -> Path:
        """Restore from a checkpoint: the policy's weights, then :meth:`load_state_dict`
        (optimizers, schedule, RNG, data order, counters and version)."""
        path = resolve_checkpoint(checkpoint)
        state = load_state(path, trust=self.cfg.train.trust_checkpoint)
        # data parallel: the whole weights go to the rollout copy, each rank's shards to the policy
        whole = self.sampler.rollout.model if self.dist else self.model
        check_resume_shape(path, state.get("config"), self.cfg, whole)
        load_policy_weights(path, whole)
        if self.dist:
            load_full_state_dict(self.model, whole.state_dict())
        self.load_state_dict(state)
        return path


def load_policy_weights(path: Path, model: torch.nn.Module) -> None:
    """The weights of checkpoint ``path`` (``model/*.safetensors``) into ``model``: a LoRA
    run's adapter into a PEFT model, else the whole model's; a checkpoint of the other kind
    or of other tensors is one :class:`ConfigError` line."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(f))
    if is_peft(model):  # a LoRA run: the checkpoint holds the adapter (the base is rebuilt from the config)
        from peft import set_peft_model_state_dict

        if not is_adapter_dir(path / "model"):
            raise ConfigError(f"checkpoint {path} holds a full model, but this run trains LoRA adapters (model.lora)")
        unexpected = set_peft_model_state_dict(model, weights).unexpected_keys
        if unexpected:
            raise ConfigError(f"checkpoint {path}'s adapter does not match the model's (unexpected {unexpected[:3]})")
        return
    if is_adapter_dir(path / "model"):
        raise ConfigError(f"checkpoint {path} holds a LoRA adapter: resume it with the run's model.lora settings")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ConfigError(f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if model.config.tie_word_embeddings:
        model.tie_weights()


def validate(cfg: Config) -> None:
    """Refuse settings the trainer cannot run, with one line naming the key
    (:meth:`treerl.config.Config.validate`: every key's declared type and range)."""
    cfg.validate()
