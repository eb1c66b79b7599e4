"""What turns samples into an update (the RL step): tree forwards (proximal, reference,
critic values), advantages, and the policy (and critic) minibatch updates through the tree
engine; also the supervised (SFT) update.

    samples -> prefix tree -> no-grad forwards -> advantages
            -> for each epoch and minibatch: loss -> forward_backward -> optimizer step

Owns the optimizers (policy, critic) and the learning-rate schedule, and saves them (with
the critic's and the reference's weights) in :meth:`Learner.state_dict`. Data parallel: every
rank passes the same global batch; forwards and minibatch updates are split over the
ranks (tree-aware), losses are normalised over the global minibatch and gradients summed,
so an update equals the one-process update of the same batch.

Takes config sections ``algorithm`` (advantages, losses, epochs, minibatches) and ``optim``
(AdamW, schedule, clipping); the run's length, seed, SFT learning rate and bf16 autocast
(``train.steps``, ``train.seed``, ``sft.lr``, ``train.autocast_bf16``) are passed explicitly.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .build import Engines
from .config import PROXIMAL, AlgorithmConfig, ConfigError, OptimConfig
from .distributed import ranks
from .distributed.data_parallel import (
    DistContext,
    all_gather_objects,
    all_reduce_sum,
    full_optimizer_state,
    full_state_dict,
    gathered,
    gradient_step,
    load_full_optimizer_state,
    load_full_state_dict,
)
from .engine.tree_engine import TreeEngine
from .moe import is_moe_model
from .moe_aux import forward_backward_with_router_aux
from .overlap import GroupForwards
from .rl import (
    LogLinearPolicyLoss,
    Normalisers,
    PolicyLoss,
    PolicyLossConfig,
    TokenBatch,
    ValueLoss,
    ValueLossConfig,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    loglinear_alpha,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .rl.batch import TOKEN_FIELDS
from .samples import Sample
from .engine.tree import PrefixTree


class NonFiniteError(RuntimeError):
    """``optim.max_nonfinite_updates`` updates in a row had a non-finite loss or gradient."""


def check_proximal(method: str, advantage: str) -> None:
    """Refuse a proximal-logprob method that does not exist or cannot serve ``advantage``."""
    if method not in PROXIMAL:
        raise ConfigError(f"proximal: unknown {method!r}; choose one of {', '.join(PROXIMAL)}")
    if method == "loglinear" and advantage == "reinforce_pp":
        raise ConfigError("proximal=loglinear cannot be used with advantage=reinforce_pp (its KL term needs "
                          "recomputed proximal logprobs)")


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then constant or cosine down to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Update:
    """What one :meth:`Learner.train_on` did (before the weights go to the rollout engine)."""

    tree: PrefixTree  # the batch's prefix tree
    updates: int  # optimizer steps (ppo_epochs x minibatches)
    losses: dict[str, list[float]] = field(default_factory=dict)  # per optimizer step
    mismatch: dict[str, float] = field(default_factory=dict)  # rollout/trainer logprob agreement
    skipped: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    timings: dict[str, float] = field(default_factory=dict)  # seconds: forward, update


def adamw_fused(device: torch.device | str, dist: DistContext | None) -> bool | None:
    """AdamW's kernel: fused (one kernel per step) on a single CUDA device (H100: 5.5 against 11.7
    ms for Qwen3-0.6B, 15.5 against 33.3 ms for 1.7B, bench/adamw_step.py); torch's default
    (None: foreach) elsewhere, sharded parameters under data parallelism included."""
    return True if torch.device(device).type == "cuda" and dist is None else None


def with_our_kernel(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """``state`` (an optimizer's state dict) with ``optimizer``'s kernel choice (``fused``,
    ``foreach``) in its groups. ``load_state_dict`` takes every group's settings from the
    checkpoint, so a checkpoint written under another choice (torch's default before fused,
    or a single-GPU run resumed under data parallelism) would bring its own. Groups that do
    not pair up are left as they are (torch's load then says what differs)."""
    saved, ours = state.get("param_groups"), optimizer.param_groups
    if not isinstance(saved, list) or len(saved) != len(ours):
        return state
    groups = [{**g, "fused": o.get("fused"), "foreach": o.get("foreach")} for g, o in zip(saved, ours)]
    return {**state, "param_groups": groups}


class Learner:
    """The RL (and SFT) update of one trainer (see the module docstring)."""

    def __init__(self, algorithm: AlgorithmConfig, optim: OptimConfig, engines: Engines, device: torch.device,
                 dist: DistContext | None, *, total_steps: int, seed: int = 0, sft_lr: float = 3e-3,
                 autocast_bf16: bool = False):
        """``total_steps``: RL steps of the run (the schedule's length); ``seed``: the
        minibatch order's; ``sft_lr``: :meth:`sft_update`'s learning rate; ``autocast_bf16``:
        bf16 autocast on CUDA (:meth:`autocast`)."""
        self.algorithm, self.optim, self.device, self.dist = algorithm, optim, device, dist
        self.seed, self.sft_lr, self.autocast_bf16 = seed, sft_lr, autocast_bf16
        self.engine, self.reference, self.critic = engines.policy, engines.reference, engines.critic
        self.model = self.engine.model
        o = optim
        fused = adamw_fused(device, dist)
        self.critic_opt = None
        if self.critic is not None:
            self.critic_opt = torch.optim.AdamW(trainable(self.critic.model), lr=algorithm.critic_lr,
                                                weight_decay=o.weight_decay, fused=fused)
        # a LoRA (PEFT) model: its adapters only (the base is frozen)
        self.optimizer = torch.optim.AdamW(trainable(self.model), lr=o.lr, betas=(o.beta1, o.beta2),
                                           weight_decay=o.weight_decay, fused=fused)
        self.router_aux_coef = check_router_aux(algorithm.router_aux_coef, self.model, dist)
        total = total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, o.warmup_steps, total, o.schedule, o.min_lr_ratio))
        self.nonfinite_in_a_row = 0  # updates skipped in a row (optim.max_nonfinite_updates stops the run)
        self.nonfinite_total = 0

    # --------------------------------------------------------------- its state
    def state_dict(self) -> dict:
        """The learner's part of a checkpoint: the optimizers (``optimizer``, ``critic_opt``),
        the schedule (``scheduler``), and the weights of the critic and of the frozen
        reference (``critic``, ``reference``; None without them; the policy's weights are the
        checkpoint's ``model/``). Data parallel: a collective; sharded state is gathered
        whole, so the layout is a one-process run's."""
        dist = self.dist is not None
        whole = full_state_dict if dist else (lambda m: m.state_dict())
        optim = full_optimizer_state if dist else (lambda o: o.state_dict())
        return {
            "optimizer": optim(self.optimizer), "scheduler": self.scheduler.state_dict(),
            "critic": None if self.critic is None else whole(self.critic.model),
            "critic_opt": None if self.critic_opt is None else optim(self.critic_opt),
            "reference": None if self.reference is None else self.reference.model.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s keys (the policy's weights already loaded: data
        parallel, the optimizer state is resharded onto them)."""
        if self.dist:
            load_full_optimizer_state(self.optimizer, with_our_kernel(self.optimizer, state["optimizer"]))
        else:
            self.optimizer.load_state_dict(with_our_kernel(self.optimizer, state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None and state.get("critic") is not None:
            if self.dist:
                load_full_state_dict(self.critic.model, state["critic"])
                load_full_optimizer_state(self.critic_opt, with_our_kernel(self.critic_opt, state["critic_opt"]))
            else:
                self.critic.model.load_state_dict(state["critic"])
                self.critic_opt.load_state_dict(with_our_kernel(self.critic_opt, state["critic_opt"]))
        if self.reference is not None and state.get("reference") is not None:
            self.reference.model.load_state_dict(state["reference"])

    # ------------------------------------------------------------------ RL step
    def train_on(self, samples: list[Sample], version: int, step: int, proximal: str = "recompute",
                 ready: GroupForwards | None = None) -> Update:
        """Forwards, advantages and ``ppo_epochs x minibatches`` optimizer steps on
        ``samples``, whose newest tokens come from weights ``version``; ``step`` (the
        trainer's step count) seeds the minibatch order. Ends with a scheduler step.

        ``proximal``: how decoupled PPO gets the proximal logprobs when it needs them
        (stale samples, several updates, a behaviour-weight cap): ``"recompute"`` (a tree
        forward of the current weights, exact) or ``"loglinear"`` (AReaL's per-token
        interpolation between behaviour and current logprobs by version, no forward;
        :mod:`treerl.rl.proximal`). The recompute forward skips the first minibatch of epoch 0,
        whose update runs on the proximal weights: its own logprobs, detached, serve
        (:meth:`proximal_reused`).

        ``ready``: forwards already run during the rollout (:meth:`group_forwards`); what
        they do not cover is computed here."""
        alg = self.algorithm
        t1 = time.perf_counter()
        seqs = [torch.tensor(s.token_ids) for s in samples]
        tree = PrefixTree.from_sequences(seqs)
        dtype = torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32
        fields: dict[str, list[torch.Tensor]] = {
            "behaviour_logprobs": [torch.tensor(s.behaviour_logprobs, dtype=dtype) for s in samples],
        }
        out = Update(tree=tree, updates=alg.ppo_epochs * alg.minibatches)
        stale = any(v < version for s in samples for v in s.versions)
        forwards = self.forward_engines(stale)
        loglinear = proximal == "loglinear" and forwards.pop("proximal_logprobs", None) is not None
        if loglinear:  # the per-token interpolation weights stand in the proximal field
            fields["proximal_logprobs"] = [loglinear_alpha(torch.tensor(s.versions, dtype=torch.int64), version).to(dtype)
                                           for s in samples]
        recompute = "proximal_logprobs" in forwards
        first = self.proximal_reused(samples, step, ready) if recompute else set()
        policy = forwards.pop("proximal_logprobs") if first else None
        fields.update(self.forwards(forwards, seqs, tree, dtype, ready))
        if first:  # the proximal forward of the other sequences; the first minibatch's come from its update
            fields["proximal_logprobs"] = [None] * len(seqs)
            self.forwards_into(fields, {"proximal_logprobs": policy}, seqs,
                               [i for i in range(len(seqs)) if i not in first], dtype)
        out.timings["forward"] = time.perf_counter() - t1
        if ready is not None and ready.sequences:  # host seconds the rollout spent launching them, their device seconds
            out.timings["forward_in_rollout"], out.timings["forward_in_rollout_gpu"] = ready.seconds, ready.gpu_seconds
        advantages = sample_advantages(samples, fields, alg)

        t2 = time.perf_counter()
        masks = [torch.tensor(s.loss_mask) for s in samples]
        loss_cfg = self.loss_config()
        for epoch in range(alg.ppo_epochs):
            for j, idx in enumerate(self.minibatches(samples, epoch, step)):
                take = lambda xs: [xs[i] for i in idx]  # noqa: E731
                adv = advantages[idx] if isinstance(advantages, torch.Tensor) else take(advantages)
                current = bool(first) and epoch == 0 and j == 0  # (its sequences are `first`)
                batch = TokenBatch.from_sequences(take(masks), adv, **{
                    k: take(v) for k, v in fields.items() if not (current and k == "proximal_logprobs")})
                local = ranks.share(self.dist, take(seqs))  # this rank's sequences (positions in idx)
                made: list[PolicyLoss] = []

                def policy_loss(b: TokenBatch, n: Normalisers | None) -> PolicyLoss:
                    made.append(LogLinearPolicyLoss(b, loss_cfg, alpha=b.proximal_logprobs, normalisers=n) if loglinear
                                else PolicyLoss(b, loss_cfg, normalisers=n, current_proximal=current))
                    return made[-1]

                policy_metrics = self.update(self.engine, batch, local, take(seqs), policy_loss,
                                             entropy=alg.entropy_coef != 0)
                if current:  # the proximal logprobs of the later epochs and of the mismatch metric
                    values = made[0].current_logprobs.cpu().to(dtype).split(batch.seq_lengths.tolist())
                    for i, v in zip(idx, values):
                        fields["proximal_logprobs"][i] = v
                for k, v in policy_metrics.items():
                    out.losses.setdefault(k, []).append(v)
                norm = self.optimizer_step(self.optimizer, self.model, policy_metrics.get("loss"), f"RL step {step + 1}")
                out.skipped += not math.isfinite(norm)
                out.losses.setdefault("grad_norm", []).append(norm)
                if self.critic is not None:
                    value_metrics = self.update(self.critic, batch, local, take(seqs), lambda b, n: ValueLoss(
                        b, ValueLossConfig(clip=alg.value_clip), normalisers=n))
                    for k, v in value_metrics.items():
                        out.losses.setdefault("critic/" + k, []).append(v)
                    self.optimizer_step(self.critic_opt, self.critic.model, value_metrics.get("loss"),
                                        f"RL step {step + 1} (critic)")
        self.scheduler.step()
        out.timings["update"] = time.perf_counter() - t2
        if recompute:
            out.mismatch = rollout_mismatch(samples, fields, version)
        return out

    def proximal_reused(self, samples: list[Sample], step: int, ready: GroupForwards | None) -> set[int]:
        """The sequences whose proximal logprobs are those of their own update, detached
        (``PolicyLoss(current_proximal=True)``), not a forward's: the first minibatch of epoch 0,
        which trains the proximal weights themselves (no optimizer step yet; stale samples too).
        None data parallel (each rank's loss sees its share only), when the rollout's forwards
        (``ready``) computed them, or with REINFORCE++ (its advantages read them before any update)."""
        if self.dist is not None or self.algorithm.advantage == "reinforce_pp" or (
                ready is not None and ready.sequences and "proximal_logprobs" in ready.engines):
            return set()
        return set(self.minibatches(samples, 0, step)[0])

    def minibatches(self, samples: list[Sample], epoch: int, step: int) -> list[list[int]]:
        """Sequence indices per minibatch; a group stays together (so it shares its tree)."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group, []).append(i)
        keys = list(groups)
        if epoch > 0:
            random.Random(self.seed + 7919 * step + epoch).shuffle(keys)
        k = min(self.algorithm.minibatches, len(keys))
        return [[i for key in keys[j::k] for i in groups[key]] for j in range(k)]

    def loss_config(self) -> PolicyLossConfig:
        a = self.algorithm
        return PolicyLossConfig(
            ratio=a.ratio, eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip,
            behaviour_weight_cap=a.behaviour_weight_cap, aggregation=a.aggregation, norm_constant=a.norm_constant,
            # TIS (truncate at the cap instead of masking): an AlgorithmConfig field once config.py has it
            behaviour_weight_truncate=bool(getattr(a, "behaviour_weight_truncate", False)),
            kl_coef=a.kl_coef if self.reference is not None and a.advantage != "reinforce_pp" else 0.0,
            kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
        )

    # ------------------------------------------------------ forwards, updates
    def forward_engines(self, stale: bool) -> dict[str, TreeEngine]:
        """The no-grad forwards a step needs (field name -> engine): proximal logprobs when
        the samples are ``stale``, with several updates, a behaviour-weight cap or
        REINFORCE++; reference logprobs with a reference; values with a critic."""
        alg, out = self.algorithm, {}
        if (alg.ppo_epochs * alg.minibatches > 1 or stale or alg.behaviour_weight_cap is not None
                or alg.advantage == "reinforce_pp"):
            out["proximal_logprobs"] = self.engine
        if self.reference is not None:
            out["reference_logprobs"] = self.reference
        if self.critic is not None:
            out["values"] = self.critic
        return out

    def group_forwards(self, how: str) -> GroupForwards | None:
        """The forwards of a synchronous step (fresh samples, proximal recomputed), to run on
        its groups as they finish (``how``: ``rollout.overlap_forwards``, :mod:`treerl.overlap`);
        None when ``"after"``, when none is needed, or data parallel (forwards sharded after the rollout)."""
        engines = self.forward_engines(stale=False)
        if how == "after" or not engines or self.dist is not None:
            return None
        # the modes the forwards after the rollout see: Sampler.generate leaves the policy in train mode
        modes = {name: True if e.model is self.model else e.model.training for name, e in engines.items()}
        return GroupForwards(engines, self.autocast, self.device, side_stream=how == "stream", modes=modes)

    def forwards(self, engines: dict[str, TreeEngine], seqs: list[torch.Tensor], tree: PrefixTree,
                 dtype: torch.dtype, ready: GroupForwards | None = None) -> dict[str, list[torch.Tensor]]:
        """No-grad per-sequence forwards (proximal / reference logprobs, critic values; one
        ``[L - 1]`` tensor per sequence) of the whole batch; those ``ready`` ran during the
        rollout are taken from it (the sequences it does not cover computed now). Data
        parallel: each rank runs its share, then every rank gets all."""
        if not engines:
            return {}
        done = [name for name in engines if ready is not None and ready.sequences and name in ready.engines]
        if done:
            out, missing = ready.take(seqs, done, dtype)
            if missing:
                self.forwards_into(out, {n: engines[n] for n in done}, seqs, missing, dtype)
            others = {n: e for n, e in engines.items() if n not in done}
            return {**out, **self.forwards(others, seqs, tree, dtype)}
        if not self.dist:
            with self.autocast():
                return {name: [t.cpu().to(dtype) for t in engine.logprobs(tree)] for name, engine in engines.items()}
        local = ranks.share(self.dist, seqs)
        sub = PrefixTree.from_sequences([seqs[i] for i in local]) if local else None
        mine = {}
        for name, engine in engines.items():
            with gathered(engine), self.autocast():
                mine[name] = [t.cpu().to(dtype) for t in engine.logprobs(sub)] if local else []
        out = {name: [None] * len(seqs) for name in engines}
        for rank_local, rank_out in all_gather_objects((local, mine)):
            for name, values in rank_out.items():
                for i, v in zip(rank_local, values):
                    out[name][i] = v
        return out

    def forwards_into(self, out: dict[str, list], engines: dict[str, TreeEngine], seqs: list[torch.Tensor],
                      indices: list[int], dtype: torch.dtype) -> None:
        """:meth:`forwards` of the sequences ``indices`` of ``seqs`` (a tree of their own), each
        result written at its sequence's place in ``out[name]`` (lists over ``seqs``)."""
        if not indices:
            return
        part = [seqs[i] for i in indices]
        done = self.forwards(engines, part, PrefixTree.from_sequences(part), dtype)
        for name, values in done.items():
            for i, v in zip(indices, values):
                out[name][i] = v

    def update(self, engine: TreeEngine, batch: TokenBatch, local: list[int], seqs: list[torch.Tensor],
               make_loss: Callable, entropy: bool = False) -> dict[str, float]:
        """Forward and backward of a separable loss over (this rank's share ``local`` of)
        ``batch``; returns the loss's metrics (over the whole batch). Leaves the gradients
        in place."""
        if not self.dist:
            loss = make_loss(batch.to(self.device), None)
            tree = PrefixTree.from_sequences(seqs)
            with self.autocast():
                if self.router_aux_coef and engine is self.engine:  # the policy's routers
                    _, aux = forward_backward_with_router_aux(engine, tree, loss, self.router_aux_coef,
                                                              separable=True, entropy=entropy)
                    return {**loss.metrics(), "router_aux": aux}
                engine.forward_backward(tree, loss, separable=True, entropy=entropy)
            return loss.metrics()
        norms = Normalisers.of(batch)  # the global minibatch's counts (every rank has it)
        raw = {}
        with gradient_step(engine):
            if local:
                mine = select_batch(batch, local)
                loss = make_loss(mine.to(self.device), norms)
                with self.autocast():
                    engine.forward_backward(PrefixTree.from_sequences([seqs[i] for i in local]), loss,
                                            separable=True, entropy=entropy)
                raw = loss._read()
        # metrics of the whole minibatch: per-rank sums (max / min) combined, then read
        # through a loss object of the global batch
        merged: dict[str, float] = {}
        for part in all_gather_objects(raw):
            for k, v in part.items():
                if k not in merged:
                    merged[k] = v
                elif k.endswith("_max"):
                    merged[k] = max(merged[k], v)
                elif k.endswith("_min"):
                    merged[k] = min(merged[k], v)
                else:
                    merged[k] += v
        whole = make_loss(batch, norms)
        whole._acc = {k: torch.tensor(v, dtype=torch.float64) for k, v in merged.items()}
        return whole.metrics()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, loss: float | None = None,
                       where: str = "") -> float:
        """Clip (``optim.grad_clip``; global norm over ranks), step, zero; returns the norm.

        A non-finite ``loss`` or gradient norm skips the step (the gradients are dropped,
        the weights and optimizer state stay as they were) with a warning, and returns
        NaN; ``optim.max_nonfinite_updates`` skipped in a row raise :class:`NonFiniteError`.
        The norm is global over ranks, so every rank makes the same decision."""
        clip = self.optim.grad_clip
        # Sharded (DTensor) gradients: clip_grad_norm_ reduces the norm over all ranks.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if math.isfinite(norm) and (loss is None or math.isfinite(loss)):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row = 0
            return norm
        optimizer.zero_grad(set_to_none=True)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        limit = self.optim.max_nonfinite_updates
        what = f"loss {loss}, gradient norm {norm}"
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteError(
                f"training stopped: {self.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient "
                f"(optim.max_nonfinite_updates={limit}; the last at {where or 'an update'}: {what}); the weights are "
                f"those before them: lower optim.lr, keep optim.grad_clip on, or check the reward and the data, "
                f"then --resume from the last checkpoint")
        print(f"treerl: skipping an update with a non-finite loss or gradient at {where or 'an update'} ({what}; "
              f"{self.nonfinite_in_a_row} in a row, the run stops at {limit}); counted in train/skipped_updates",
              file=sys.stderr)
        return float("nan")

    def autocast(self):
        """bf16 autocast on CUDA with ``train.autocast_bf16``; off otherwise."""
        if self.autocast_bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    # ---------------------------------------------------------------------- SFT
    def sft_update(self, seqs: list[torch.Tensor], masks: list[torch.Tensor]) -> dict[str, float]:
        """One supervised step at ``sft.lr``: token-mean NLL of the masked tokens (``masks[i]``
        is ``[L_i - 1]``, True on the target tokens). The schedule's learning rate is
        restored afterwards. Data parallel: every rank passes the same batch."""
        n_tokens = float(sum(int(m.sum()) for m in masks))

        def nll(logprobs, index):
            return -sum((lp * masks[i].to(lp.device, lp.dtype)).sum() for lp, i in zip(logprobs, index.tolist())) / n_tokens

        for group in self.optimizer.param_groups:
            group["lr"] = self.sft_lr
        if self.dist:  # every rank built the same batch: each runs its share
            local = ranks.share(self.dist, seqs)
            loss = 0.0
            with gradient_step(self.engine):
                if local:
                    where = torch.tensor(local)
                    with self.autocast():
                        loss = self.engine.forward_backward([seqs[i] for i in local],
                                                            lambda lps, index: nll(lps, where[index]), separable=True)
            loss = float(all_reduce_sum(loss, self.device))
        else:
            with self.autocast():
                loss = self.engine.forward_backward(seqs, nll, separable=True)
        loss = float(loss)
        norm = self.optimizer_step(self.optimizer, self.model, loss, "an SFT step")
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        return {"sft/loss": loss, "sft/grad_norm": norm, "train/skipped_updates": float(not math.isfinite(norm))}


# ------------------------------------------------------------------ functions
def check_router_aux(coef: float, model: torch.nn.Module, dist) -> float:
    """``algorithm.router_aux_coef`` (its range is the config's): > 0 needs a mixture-of-experts
    policy and one process (the routing counts are not yet reduced over ranks)."""
    if coef and not is_moe_model(model):
        raise ConfigError("algorithm.router_aux_coef > 0 needs a mixture-of-experts model (e.g. model.family=qwen3_moe)")
    if coef and dist is not None:
        raise ConfigError("algorithm.router_aux_coef > 0 is not supported with data parallel training yet")
    return coef


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: those that require grad."""
    return [p for p in model.parameters() if p.requires_grad]


def sample_advantages(samples: list[Sample], fields: dict[str, list[torch.Tensor]],
                      alg: AlgorithmConfig) -> torch.Tensor | list[torch.Tensor]:
    """Advantages of ``algorithm.advantage``: one per sequence ``[N]`` (GRPO, Dr.GRPO,
    RLOO: one reward and one group per *episode*, per-turn sequences inherit their
    episode's), or one ``[L_i - 1]`` tensor per sequence (REINFORCE++, GAE; GAE also puts
    ``returns`` into ``fields``)."""
    episode_ids = sorted({s.episode for s in samples})
    first = {}
    for s in samples:
        first.setdefault(s.episode, s)
    ep_rewards = torch.tensor([first[e].reward for e in episode_ids], dtype=torch.float64)
    ep_groups = torch.tensor([first[e].group for e in episode_ids])
    where = {e: i for i, e in enumerate(episode_ids)}
    to_seq = torch.tensor([where[s.episode] for s in samples])
    if alg.advantage == "grpo":
        return grpo_advantages(ep_rewards, ep_groups, normalise_std=alg.normalise_std)[to_seq]
    if alg.advantage == "dr_grpo":
        return dr_grpo_advantages(ep_rewards, ep_groups)[to_seq]
    if alg.advantage == "rloo":
        return rloo_advantages(ep_rewards, ep_groups)[to_seq]
    masks = [torch.tensor(s.loss_mask) for s in samples]
    lengths = torch.tensor([len(m) for m in masks])
    flat_mask = torch.cat(masks)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if alg.advantage == "reinforce_pp":
        kl = None
        if "reference_logprobs" in fields and alg.kl_coef > 0:
            kl = torch.cat(fields["proximal_logprobs"]) - torch.cat(fields["reference_logprobs"])
        return reinforce_pp_advantages(rewards, lengths, flat_mask, kl=kl, kl_coef=alg.kl_coef,
                                       gamma=alg.gamma, group_ids=torch.tensor([s.group for s in samples]))
    # gae: terminal reward on each sequence's last trained token
    token_rewards = torch.zeros(len(flat_mask), dtype=torch.float64)
    ends = torch.cumsum(lengths, 0)
    for i, m in enumerate(masks):
        trained = m.nonzero()
        if len(trained):
            token_rewards[int(ends[i] - lengths[i] + trained[-1, 0])] = rewards[i]
    values = torch.cat(fields["values"]).to(torch.float64)
    adv, ret = gae(token_rewards, values, flat_mask, lengths, gamma=alg.gamma, lam=alg.lam)
    fields["returns"] = list(ret.split(lengths.tolist()))
    return list(adv.split(lengths.tolist()))


def rollout_mismatch(samples: list[Sample], fields: dict[str, list[torch.Tensor]], version: int) -> dict[str, float]:
    """Rollout/trainer agreement: ``|logp_rollout - logp_train|`` (mean, max) over trained
    tokens sampled with weights ``version``; the trainer's side: its proximal logprobs (weights ``version``)."""
    diffs = [(prox - behav).abs()[torch.tensor(s.loss_mask) & (torch.tensor(s.versions) == version)]
             for s, behav, prox in zip(samples, fields["behaviour_logprobs"], fields["proximal_logprobs"])]
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    if not len(d):
        return {}
    return {"rollout/logp_mismatch_mean": float(d.double().mean()), "rollout/logp_mismatch_max": float(d.max())}


def step_metrics(samples: list[Sample], update: Update, version: int, lr: float, rollout_seconds: float) -> dict:
    """The metrics of one RL step; ``version``: the weights after it (staleness = how many
    versions older than the weights that trained on it each sample's oldest token is)."""
    tree, timings = update.tree, {"rollout": rollout_seconds, **update.timings}
    rollout_tokens = sum(sum(s.loss_mask) for s in samples)
    rewards = torch.tensor([s.reward for s in samples])
    versions = torch.tensor([min(s.versions) if s.versions else version for s in samples])
    out = {
        "staleness/max": float(version - 1 - versions.min()),
        "staleness/mean": float((version - 1 - versions).float().mean()),
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "tree/flat_tokens": tree.num_flat_tokens, "tree/tree_tokens": tree.num_tree_tokens,
        "tree/ideal_ratio": tree.ideal_ratio, "tree/sequences": tree.num_sequences,
        "lr": lr, "version": version,
        "time/rollout_s": timings["rollout"], "time/forward_s": timings["forward"],
        "time/update_s": timings["update"],
        "perf/rollout_tokens_per_s": rollout_tokens / max(timings["rollout"], 1e-9),
        "perf/train_tokens_per_s": tree.num_flat_tokens * update.updates / max(timings["update"], 1e-9),
        "completion/mean_tokens": rollout_tokens / max(1, len(samples)),
    }
    if "forward_in_rollout" in timings:  # rollout.overlap_forwards: the forwards run during the rollout
        out["time/forward_in_rollout_s"] = timings["forward_in_rollout"]  # host (launch) seconds, in the rollout's
        out["time/forward_in_rollout_gpu_s"] = timings["forward_in_rollout_gpu"]  # their device seconds
    out.update({("loss/" + k if "/" not in k else k): float(np.mean(v)) for k, v in update.losses.items()})
    out["train/skipped_updates"] = float(update.skipped)
    out.update(update.mismatch)
    return out


def select_batch(batch: TokenBatch, index: list[int]) -> TokenBatch:
    """The sequences ``index`` of ``batch`` (in that order) as a batch of their own."""
    tokens, _ = batch.token_index(index)
    if tokens is None:
        return batch
    fields = {n: getattr(batch, n)[tokens.to(batch.device)] for n in TOKEN_FIELDS if getattr(batch, n) is not None}
    return TokenBatch(seq_lengths=batch.seq_lengths[torch.as_tensor(index, dtype=torch.int64)], **fields)
