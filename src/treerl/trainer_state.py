"""What persists a trainer: its checkpoint state (model, optimizers, schedule, RNG, data
order, counters, weight version) and exact resume.

Data parallel: :func:`state_dict` and :func:`save` are collectives (every rank calls them);
sharded optimizer and critic state are gathered whole, so a checkpoint has the same layout
as a one-process one (either can resume the other), plus every rank's RNG state
(``rng_ranks``); rank 0 writes. The file format is :mod:`treerl.checkpoint`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .checkpoint import load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import ConfigError
from .preflight import check_resume_shape
from .distributed.data_parallel import (
    all_gather_objects,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)
from .lora import is_adapter_dir, is_peft

if TYPE_CHECKING:
    from .trainer import Trainer


def state_dict(trainer: Trainer) -> dict:
    """The trainer state of a checkpoint (everything but the policy's weights)."""
    t, learner, sampler = trainer, trainer.learner, trainer.sampler
    dist = t.dist is not None
    whole = full_state_dict if dist else (lambda m: m.state_dict())
    optim = full_optimizer_state if dist else (lambda o: o.state_dict())
    state = {
        "step": t.step_count, "sft_steps": t.sft_count, "cursor": sampler.cursor, "epoch": sampler.epoch,
        "version": sampler.rollout.version, "optimizer": optim(learner.optimizer),
        "scheduler": learner.scheduler.state_dict(), "rng": rng_state(), "config": t.cfg.to_dict(),
        "critic": None if t.critic is None else whole(t.critic.model),
        "critic_opt": None if learner.critic_opt is None else optim(learner.critic_opt),
        "reference": None if t.reference is None else t.reference.model.state_dict(),
    }
    if dist:
        rngs = all_gather_objects(state["rng"])
        state["rng"], state["rng_ranks"] = rngs[0], rngs
    return state


def save(trainer: Trainer, out_dir: str | Path | None = None) -> Path:
    """Write a checkpoint under ``out_dir/checkpoints`` (default ``train.out_dir``).
    Data parallel: every rank calls it, rank 0 writes the rollout engine's whole copy of
    the weights (which is the policy's)."""
    t = trainer
    root = Path(out_dir or t.cfg.train.out_dir) / "checkpoints"
    if t.dist is None:
        return save_checkpoint(root, t.step_count, t.model, t.tokenizer, state_dict(t), keep_last=t.cfg.train.keep_last)
    import torch.distributed as dist

    state = state_dict(t)
    path = root / f"step-{t.step_count:06d}"
    if t.is_main:
        path = save_checkpoint(root, t.step_count, t.rollout.model, t.tokenizer, state, keep_last=t.cfg.train.keep_last)
    dist.barrier()
    return path


def load(trainer: Trainer, checkpoint: str | Path) -> Path:
    """Restore model, optimizers, scheduler, RNG, data order, counters and version."""
    from safetensors.torch import load_file

    t, learner = trainer, trainer.learner
    path = resolve_checkpoint(checkpoint)
    state = load_state(path, trust=t.cfg.train.trust_checkpoint)
    check_resume_shape(path, state.get("config"), t.cfg, t.rollout.model if t.dist else t.model)
    weights = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(f))
    # data parallel: the whole weights go to the rollout copy, each rank's shards to the policy
    whole = t.rollout.model if t.dist else t.model
    if is_peft(whole):  # a LoRA run: the checkpoint holds the adapter (the base is rebuilt from the config)
        from peft import set_peft_model_state_dict

        if not is_adapter_dir(path / "model"):
            raise ConfigError(f"checkpoint {path} holds a full model, but this run trains LoRA adapters (model.lora)")
        unexpected = set_peft_model_state_dict(whole, weights).unexpected_keys
        if unexpected:
            raise ConfigError(f"checkpoint {path}'s adapter does not match the model's (unexpected {unexpected[:3]})")
    else:
        if is_adapter_dir(path / "model"):
            raise ConfigError(f"checkpoint {path} holds a LoRA adapter: resume it with the run's model.lora settings")
        missing, unexpected = whole.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise ConfigError(f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if whole.config.tie_word_embeddings:
            whole.tie_weights()
    if t.dist:
        load_full_state_dict(t.model, whole.state_dict())
        load_full_optimizer_state(learner.optimizer, state["optimizer"])
    else:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    if t.critic is not None and state.get("critic") is not None:
        if t.dist:
            load_full_state_dict(t.critic.model, state["critic"])
            load_full_optimizer_state(learner.critic_opt, state["critic_opt"])
        else:
            t.critic.model.load_state_dict(state["critic"])
            learner.critic_opt.load_state_dict(state["critic_opt"])
    if t.reference is not None and state.get("reference") is not None:
        t.reference.model.load_state_dict(state["reference"])
    t.step_count, t.sft_count = state["step"], state["sft_steps"]
    t.sampler.restore(cursor=state["cursor"], epoch=state["epoch"])
    t.rollout.version = state["version"]
    rngs = state.get("rng_ranks")
    rank, world = (t.dist.rank, t.dist.world_size) if t.dist else (0, 1)
    if rngs is not None and len(rngs) == world:
        set_rng_state(rngs[rank])
    else:  # saved with another number of processes
        set_rng_state(state["rng"])
        if rank:
            torch.manual_seed(t.cfg.train.seed + 7919 * rank + 104729 * t.step_count)
    return path
