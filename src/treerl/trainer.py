"""The synchronous RL trainer: one readable loop.

    rollout (shared-prefix sampling, per-token behaviour logprobs and versions)
      -> rewards -> prefix tree
      -> tree forwards: proximal (current policy), reference (KL), critic values (GAE)
      -> advantages -> policy (and critic) updates through the tree engine
      -> weights refresh (the rollout engine shares the policy's parameters; version += 1)

Also supervised fine-tuning (SFT) on prompt + target through the same engine, held-out
evaluation, checkpoints with exact resume, and per-step metrics.
``Trainer(config, model=None, tokenizer=None, task=None).train()``.

Under torchrun (WORLD_SIZE > 1) the same loop is data parallel (README, "Multi-GPU"): the
policy is FSDP2-sharded, each rank rolls out its share of the prompts with a whole copy of
the weights, the samples are all-gathered (advantages on the global batch), and forwards
and minibatch updates run on tree-aware shares with globally normalised losses, so an
update equals the one-process update of the same batch.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import load_state, resolve_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import Config, ConfigError
from .engine import TreeEngine
from .models import DTYPES, build_model, load_model
from .rl import (
    Normalisers,
    PolicyLoss,
    LogLinearPolicyLoss,
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
from .rollout import RolloutEngine, SamplingParams
from .tasks import get_task
from .tasks.base import Problem, Task, score_problems
from .tasks.env import ChatFormat, run_episode, run_episodes, scripted_policy
from .tree import PrefixTree

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
PROXIMAL = ("recompute", "loglinear")


def check_proximal(method: str, advantage: str) -> None:
    """Refuse a proximal-logprob method that does not exist or cannot serve ``advantage``."""
    if method not in PROXIMAL:
        raise ConfigError(f"proximal: unknown {method!r}; choose one of {', '.join(PROXIMAL)}")
    if method == "loglinear" and advantage == "reinforce_pp":
        raise ConfigError("proximal=loglinear cannot be used with advantage=reinforce_pp (its KL term needs "
                          "recomputed proximal logprobs)")


@dataclass
class Sample:
    """One training sequence. Per-token lists have length L - 1 (element t is token t + 1)."""

    token_ids: list[int]
    loss_mask: list[bool]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float
    group: int  # samples of one group share a problem (GRPO baselines)
    episode: int  # per-turn sequences of one episode share it
    completion: str = ""


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then constant or cosine down to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, config: Config, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 task: Task | None = None):
        self.cfg = config
        _validate(config)
        torch.manual_seed(config.train.seed)
        random.seed(config.train.seed)
        np.random.seed(config.train.seed)
        self.task = task if task is not None else get_task(config.task.name, **config.task.kwargs)
        self.tokenizer = tokenizer if tokenizer is not None else self._default_tokenizer()
        self.dist = self._setup_distributed(config)
        self.device = self.dist.device if self.dist else torch.device(config.train.device)
        self.model = (model if model is not None else self._build_model()).to(self.device)
        self.format = ChatFormat.for_tokenizer(self.tokenizer)
        self.multi_turn = self.task.max_turns > 1
        alg, eng = config.algorithm, config.engine
        engine_kw = dict(mode=eng.mode, memory_budget=eng.memory_budget, max_tokens=eng.max_tokens,
                         chunk_tokens=eng.chunk_tokens, compile=eng.compile, attention=eng.attention,
                         temperature=max(config.rollout.temperature, 1e-6))
        self.engine = TreeEngine(self.model, **engine_kw)
        # One process: the rollout engine shares the policy's parameters. Data parallel: the
        # policy is sharded, so each rank's rollout engine holds a whole copy, refreshed
        # from the gathered weights after every optimizer step.
        rollout_model = copy.deepcopy(self.model) if self.dist else self.model
        self.rollout = RolloutEngine(rollout_model, version=0)
        self.reference = None
        if alg.kl_coef > 0:
            ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.reference = TreeEngine(ref_model, **engine_kw)
        self.critic = self.critic_opt = None
        if alg.advantage == "gae":
            critic_model = copy.deepcopy(self.model)
            head = torch.nn.Linear(self.model.config.hidden_size, 1, device=self.device,
                                   dtype=next(self.model.parameters()).dtype)
            torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
            critic_model.value_head = head  # registered, so it moves and saves with the critic
            self.critic = TreeEngine(critic_model, value_head=head, **engine_kw)
            self.critic_opt = torch.optim.AdamW(critic_model.parameters(), lr=alg.critic_lr,
                                                weight_decay=config.optim.weight_decay)
        if self.dist:
            self._shard()
            if self.critic is not None:
                self.critic_opt = torch.optim.AdamW(self.critic.model.parameters(), lr=alg.critic_lr,
                                                    weight_decay=config.optim.weight_decay)
        o = config.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                           weight_decay=o.weight_decay)
        total = config.train.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, o.warmup_steps, total, o.schedule, o.min_lr_ratio))
        self.train_problems = self.task.train_problems(seed=config.train.seed)
        if not self.train_problems:
            raise ConfigError(f"task {self.task.name!r} has no training problems (empty dataset)")
        self.step_count = 0
        self.sft_count = 0
        self.last_samples: list[Sample] = []
        self.cursor = 0  # position in the shuffled training problems
        self.epoch = 0
        self._order = self._shuffled(0)
        self.max_new_tokens = config.rollout.max_new_tokens or self.task.max_new_tokens
        self.agents = None  # agent episodes / a served or remote rollout backend (treerl.agents)
        if config.task.agent or config.rollout.backend != "embedded":
            from .agents import AgentRollout

            self.agents = AgentRollout(config, self.rollout, self.tokenizer, self.task, self.max_new_tokens, self.model)
        if self.dist and self.dist.rank:  # ranks sample their own prompts with their own streams
            torch.manual_seed(config.train.seed + 7919 * self.dist.rank)

    # ------------------------------------------------------------ distributed
    @property
    def is_main(self) -> bool:
        """Rank 0 (or the only process): the one that writes logs and checkpoints."""
        return self.dist is None or self.dist.is_main

    @staticmethod
    def _setup_distributed(config: Config):
        """Under torchrun (WORLD_SIZE > 1): join the process group, one rank per GPU
        (NCCL) when ``train.device`` is CUDA, gloo on CPU otherwise."""
        from .distributed import data_parallel as dp

        if not dp.launched():
            return None
        if config.async_.enabled:
            raise ConfigError("async.enabled=true does not run under torchrun yet: launch it as one process")
        cuda = torch.device(config.train.device).type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError(f"train.device={config.train.device} but CUDA is not available")
        return dp.setup("nccl" if cuda else "gloo")

    def _shard(self) -> None:
        """FSDP2 on the policy (and critic): bf16 compute from float32 shards with float32
        gradient reduction on CUDA when ``train.autocast_bf16``; the model's dtype otherwise.
        The frozen reference stays whole on every rank (forward only)."""
        from .distributed.data_parallel import shard

        dtype = next(self.model.parameters()).dtype
        param_dtype = reduce_dtype = None
        if self.device.type == "cuda" and dtype != torch.float64:
            reduce_dtype = torch.float32
            if self.cfg.train.autocast_bf16 and dtype == torch.float32:
                param_dtype = torch.bfloat16
        shard(self.engine, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        if self.critic is not None:
            shard(self.critic, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def _share(self, seqs: list) -> list[int]:
        """This rank's sequences of a batch every rank holds: the tree-aware partition
        (:func:`treerl.distributed.partition`, equal predicted time per rank), computed on
        rank 0 and broadcast (every rank must use the same one)."""
        from .distributed import partition
        from .distributed.data_parallel import broadcast_object

        ranks = partition(PrefixTree.from_sequences(seqs), self.dist.world_size).ranks if self.dist.is_main and seqs else None
        ranks = broadcast_object(ranks)
        return ranks[self.dist.rank] if ranks else []

    def _my_problems(self, problems: list[Problem]) -> tuple[list[Problem], int]:
        """This rank's contiguous slice of a step's prompts (and where it starts)."""
        if not self.dist:
            return problems, 0
        w, r, n = self.dist.world_size, self.dist.rank, len(problems)
        start, end = r * n // w, (r + 1) * n // w
        return problems[start:end], start

    def _gather_samples(self, samples: list[Sample]) -> list[Sample]:
        """Every rank's samples, in rank order (= the order of the step's prompts), with
        group and episode ids renumbered to be global."""
        from .distributed.data_parallel import all_gather_objects

        out, groups, episodes = [], {}, {}
        for rank, part in enumerate(all_gather_objects(samples)):
            for s in part:
                s.group = groups.setdefault((rank, s.group), len(groups))
                s.episode = episodes.setdefault((rank, s.episode), len(episodes))
                out.append(s)
        return out

    def _sync_rollout_weights(self) -> None:
        """After an optimizer step: the rollout engine gets the new weights (version += 1)."""
        if self.dist:
            from .distributed.data_parallel import full_state_dict

            self.rollout.update_weights(full_state_dict(self.model))
        else:
            self.rollout.update_weights(self.model)  # shares the parameters: bumps the version

    # ------------------------------------------------------------------ setup
    def _default_tokenizer(self):
        """The model directory's tokenizer, else the task's character tokenizer, else a
        character tokenizer over printable ASCII (tasks of free text, e.g. JSONL math)."""
        if self.cfg.model.path:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.cfg.model.path, local_files_only=True)
        if self.task.alphabet:
            return self.task.tokenizer()
        from .tasks.tokenizer import CharTokenizer

        return CharTokenizer()

    def _build_model(self) -> torch.nn.Module:
        m = self.cfg.model
        if m.path:
            return load_model(m.path, dtype=m.dtype)
        extra = dict(self.tokenizer.hf_config_kwargs()) if hasattr(self.tokenizer, "hf_config_kwargs") else {}
        extra.update(vocab_size=self.tokenizer.vocab_size)
        extra.update(m.overrides)
        return build_model(m.family, m.shape, dtype=m.dtype, seed=self.cfg.train.seed, **extra)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_problems)))
        random.Random(self.cfg.train.seed * 1000 + epoch).shuffle(order)
        return order

    def next_problems(self, n: int) -> list[Problem]:
        """The next ``n`` training problems (a cursor through epochs of shuffled problems)."""
        out = []
        while len(out) < n:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._shuffled(self.epoch)
            out.append(self.train_problems[self._order[self.cursor]])
            self.cursor += 1
        return out

    # ---------------------------------------------------------------- rollout
    def sampling_params(self, n: int, greedy: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=n, temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=self.max_new_tokens, stop_token_ids=[self.tokenizer.eos_token_id],
            stop_strings=list(self.task.stop), decode=self.tokenizer,
            branch_every=0 if greedy else r.branch_every, branch_factor=r.branch_factor,
        )

    @torch.no_grad()
    def generate_samples(self, problems: list[Problem], n: int, greedy: bool = False) -> list[Sample]:
        """Roll out ``n`` samples (episodes) per problem and score them."""
        self.model.eval()
        try:
            if self.agents is not None:
                return [Sample(**fields) for fields in self.agents.generate(problems, n, greedy)]
            if self.multi_turn:
                return self._episodes(problems, n, greedy)
            return self._single_turn(problems, n, greedy)
        finally:
            self.model.train()

    def _single_turn(self, problems, n, greedy) -> list[Sample]:
        prompts = [self.format.prompt_ids(self.tokenizer, p.prompt) for p in problems]
        groups = self.rollout.generate(prompts, self.sampling_params(n, greedy))
        flat = [(g, c) for g in groups for c in g.completions]
        texts = [self.tokenizer.decode(c.completion_ids.tolist(), skip_special_tokens=True) for _, c in flat]
        rewards = score_problems(self.task.reward, [problems[g.prompt_index] for g, _ in flat], texts)
        samples = []
        for k, ((g, c), text, reward) in enumerate(zip(flat, texts, rewards)):
            p, t = len(c.prompt_ids), len(c.completion_ids)
            samples.append(Sample(
                token_ids=c.token_ids.tolist(), loss_mask=[False] * (p - 1) + [True] * t,
                behaviour_logprobs=[0.0] * (p - 1) + c.logprobs.tolist(),
                versions=[self.rollout.version] * (p - 1) + c.versions.tolist(),
                reward=reward, group=g.prompt_index, episode=k, completion=text,
            ))
        return samples

    def _episodes(self, problems, n, greedy) -> list[Sample]:
        params = self.sampling_params(1, greedy)

        def policy(contexts):
            groups = self.rollout.generate(contexts, params)
            return [(g.completions[0].completion_ids, g.completions[0].logprobs) for g in groups]

        expanded = [p for p in problems for _ in range(n)]
        episodes = run_episodes([self.task.make_env() for _ in expanded], expanded, policy, self.tokenizer,
                                max_turns=self.cfg.task.max_turns, max_total_tokens=self.cfg.task.max_episode_tokens)
        samples = []
        for e, ep in enumerate(episodes):
            for seq in ep.sequences:
                samples.append(Sample(
                    token_ids=seq.token_ids, loss_mask=seq.loss_mask, behaviour_logprobs=seq.behaviour_logprobs,
                    versions=[self.rollout.version] * len(seq.loss_mask), reward=ep.reward, group=e // n,
                    episode=e, completion=ep.transcript(),
                ))
        return samples

    # ------------------------------------------------------------- advantages
    def advantages(self, samples: list[Sample], batch_fields: dict) -> torch.Tensor | list[torch.Tensor]:
        alg = self.cfg.algorithm
        # One reward and one group per *episode*; per-turn sequences inherit their episode's.
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
            if "reference_logprobs" in batch_fields and alg.kl_coef > 0:
                kl = torch.cat(batch_fields["proximal_logprobs"]) - torch.cat(batch_fields["reference_logprobs"])
            return reinforce_pp_advantages(rewards, lengths, flat_mask, kl=kl, kl_coef=alg.kl_coef,
                                           gamma=alg.gamma, group_ids=torch.tensor([s.group for s in samples]))
        # gae: terminal reward on each sequence's last trained token
        token_rewards = torch.zeros(len(flat_mask), dtype=torch.float64)
        ends = torch.cumsum(lengths, 0)
        for i, m in enumerate(masks):
            trained = m.nonzero()
            if len(trained):
                token_rewards[int(ends[i] - lengths[i] + trained[-1, 0])] = rewards[i]
        values = torch.cat(batch_fields["values"]).to(torch.float64)
        adv, ret = gae(token_rewards, values, flat_mask, lengths, gamma=alg.gamma, lam=alg.lam)
        batch_fields["returns"] = list(ret.split(lengths.tolist()))
        return list(adv.split(lengths.tolist()))

    # --------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One synchronous RL step (rollout, then training on it); returns its metrics."""
        t0 = time.perf_counter()
        problems = self.next_problems(self.cfg.rollout.prompts_per_step)
        mine, _ = self._my_problems(problems)  # data parallel: each rank rolls out its share
        samples = self.generate_samples(mine, self.cfg.rollout.group_size) if mine else []
        if self.dist:
            samples = self._gather_samples(samples)
        metrics = self.train_on(samples, rollout_seconds=time.perf_counter() - t0)
        if self.agents is not None:
            metrics.update(self.agents.pop_metrics())
        return metrics

    def train_on(self, samples: list[Sample], rollout_seconds: float = 0.0,
                 proximal: str = "recompute") -> dict[str, float]:
        """Train on a batch of scored samples (from this trainer's rollout or from
        asynchronous workers: behaviour logprobs and versions come with the samples).

        ``proximal``: how decoupled PPO gets the proximal logprobs when it needs them (stale
        samples, several updates, a behaviour-weight cap): ``"recompute"`` (a tree forward of
        the current weights, exact) or ``"loglinear"`` (AReaL's per-token interpolation
        between behaviour and current logprobs by version, no forward;
        :mod:`treerl.rl.proximal`).

        Data parallel: every rank passes the same global batch; the forwards and the
        minibatch updates are split over the ranks (tree-aware), the loss is normalised over
        the global minibatch and gradients are summed, so the update equals the one-process
        update of the same batch."""
        cfg, alg = self.cfg, self.cfg.algorithm
        check_proximal(proximal, alg.advantage)
        self.last_samples = samples
        timings = {"rollout": rollout_seconds}
        rollout_tokens = sum(sum(s.loss_mask) for s in samples)

        t1 = time.perf_counter()
        seqs = [torch.tensor(s.token_ids) for s in samples]
        tree = PrefixTree.from_sequences(seqs)
        dtype = torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32
        fields: dict[str, list[torch.Tensor]] = {
            "behaviour_logprobs": [torch.tensor(s.behaviour_logprobs, dtype=dtype) for s in samples],
        }
        updates = alg.ppo_epochs * alg.minibatches
        stale = any(v < self.rollout.version for s in samples for v in s.versions)
        forwards = {}
        if updates > 1 or stale or alg.behaviour_weight_cap is not None or alg.advantage == "reinforce_pp":
            forwards["proximal_logprobs"] = self.engine
        loglinear = proximal == "loglinear" and forwards.pop("proximal_logprobs", None) is not None
        if loglinear:  # the per-token interpolation weights stand in the proximal field
            version = self.rollout.version
            fields["proximal_logprobs"] = [loglinear_alpha(torch.tensor(s.versions, dtype=torch.int64), version).to(dtype)
                                           for s in samples]
        if self.reference is not None:
            forwards["reference_logprobs"] = self.reference
        if self.critic is not None:
            forwards["values"] = self.critic
        fields.update(self._forwards(forwards, seqs, tree, dtype))
        timings["forward"] = time.perf_counter() - t1
        mismatch = self._rollout_mismatch(samples, fields) if "proximal_logprobs" in forwards else {}
        advantages = self.advantages(samples, fields)

        t2 = time.perf_counter()
        masks = [torch.tensor(s.loss_mask) for s in samples]
        metrics_acc: dict[str, list[float]] = {}
        for epoch in range(alg.ppo_epochs):
            for idx in self._minibatches(samples, epoch):
                take = lambda xs: [xs[i] for i in idx]  # noqa: E731
                adv = advantages[idx] if isinstance(advantages, torch.Tensor) else take(advantages)
                batch = TokenBatch.from_sequences(take(masks), adv, **{k: take(v) for k, v in fields.items()})
                # data parallel: this rank's sequences of the minibatch (positions in idx)
                local = self._share(take(seqs)) if self.dist else list(range(len(idx)))
                policy_metrics = self._update(self.engine, batch, local, take(seqs), lambda b, n: (
                    LogLinearPolicyLoss(b, self._loss_config(), alpha=b.proximal_logprobs, normalisers=n) if loglinear
                    else PolicyLoss(b, self._loss_config(), normalisers=n)), entropy=self._need_entropy())
                for k, v in policy_metrics.items():
                    metrics_acc.setdefault(k, []).append(v)
                metrics_acc.setdefault("grad_norm", []).append(self._optimizer_step(self.optimizer, self.model))
                if self.critic is not None:
                    value_metrics = self._update(self.critic, batch, local, take(seqs), lambda b, n: ValueLoss(
                        b, ValueLossConfig(clip=alg.value_clip), normalisers=n))
                    for k, v in value_metrics.items():
                        metrics_acc.setdefault("critic/" + k, []).append(v)
                    self._optimizer_step(self.critic_opt, self.critic.model)
        self.scheduler.step()
        self._sync_rollout_weights()
        timings["update"] = time.perf_counter() - t2
        if self.dist:  # the slowest rank's times
            from .distributed.data_parallel import all_gather_objects

            timings = {k: max(t[k] for t in all_gather_objects(timings)) for k in timings}
        self.step_count += 1

        rewards = torch.tensor([s.reward for s in samples])
        versions = torch.tensor([min(s.versions) if s.versions else self.rollout.version for s in samples])
        out = {
            "staleness/max": float(self.rollout.version - 1 - versions.min()),
            "staleness/mean": float((self.rollout.version - 1 - versions).float().mean()),
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "tree/flat_tokens": tree.num_flat_tokens, "tree/tree_tokens": tree.num_tree_tokens,
            "tree/ideal_ratio": tree.ideal_ratio, "tree/sequences": tree.num_sequences,
            "lr": self.scheduler.get_last_lr()[0], "version": self.rollout.version,
            "time/rollout_s": timings["rollout"], "time/forward_s": timings["forward"],
            "time/update_s": timings["update"],
            "perf/rollout_tokens_per_s": rollout_tokens / max(timings["rollout"], 1e-9),
            "perf/train_tokens_per_s": tree.num_flat_tokens * updates / max(timings["update"], 1e-9),
            "completion/mean_tokens": rollout_tokens / max(1, len(samples)),
        }
        out.update({("loss/" + k if "/" not in k else k): float(np.mean(v)) for k, v in metrics_acc.items()})
        out.update(mismatch)
        return out

    def _rollout_mismatch(self, samples: list[Sample], fields: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """Rollout/trainer agreement: ``|logp_rollout - logp_train|`` (mean, max) over trained
        tokens sampled with the current weights, the trainer's from its proximal forward."""
        diffs = [(prox - behav).abs()[torch.tensor(s.loss_mask) & (torch.tensor(s.versions) == self.rollout.version)]
                 for s, behav, prox in zip(samples, fields["behaviour_logprobs"], fields["proximal_logprobs"])]
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        if not len(d):
            return {}
        return {"rollout/logp_mismatch_mean": float(d.double().mean()), "rollout/logp_mismatch_max": float(d.max())}

    def _forwards(self, engines: dict[str, TreeEngine], seqs: list[torch.Tensor], tree: PrefixTree,
                  dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
        """No-grad per-sequence forwards (proximal / reference logprobs, critic values) of
        the whole batch. Data parallel: each rank runs its share, then every rank gets all."""
        if not engines:
            return {}
        if not self.dist:
            with self._autocast():
                return {name: [t.cpu().to(dtype) for t in engine.logprobs(tree)] for name, engine in engines.items()}
        from .distributed.data_parallel import all_gather_objects, gathered

        local = self._share(seqs)
        sub = PrefixTree.from_sequences([seqs[i] for i in local]) if local else None
        mine = {}
        for name, engine in engines.items():
            with gathered(engine), self._autocast():
                mine[name] = [t.cpu().to(dtype) for t in engine.logprobs(sub)] if local else []
        out = {name: [None] * len(seqs) for name in engines}
        for rank_local, rank_out in all_gather_objects((local, mine)):
            for name, values in rank_out.items():
                for i, v in zip(rank_local, values):
                    out[name][i] = v
        return out

    def _update(self, engine: TreeEngine, batch: TokenBatch, local: list[int], seqs: list[torch.Tensor],
                make_loss, entropy: bool = False) -> dict[str, float]:
        """Forward and backward of a separable loss over (this rank's share of) ``batch``;
        returns the loss's metrics (over the whole batch). Leaves the gradients in place."""
        if not self.dist:
            loss = make_loss(batch.to(self.device), None)
            with self._autocast():
                engine.forward_backward(PrefixTree.from_sequences(seqs), loss, separable=True, entropy=entropy)
            return loss.metrics()
        from .distributed.data_parallel import all_gather_objects, gradient_step

        norms = Normalisers.of(batch)  # the global minibatch's counts (every rank has it)
        raw = {}
        with gradient_step(engine):
            if local:
                mine = _select_batch(batch, local)
                loss = make_loss(mine.to(self.device), norms)
                with self._autocast():
                    engine.forward_backward(PrefixTree.from_sequences([seqs[i] for i in local]), loss,
                                            separable=True, entropy=entropy)
                raw = loss._read()
        # metrics of the whole minibatch: per-rank sums (max / min) combined, then read
        # through a loss object of the global batch (its batch-wide statistics included)
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

    def _minibatches(self, samples: list[Sample], epoch: int) -> list[list[int]]:
        """Sequence indices per minibatch; a group stays together (so it shares its tree)."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group, []).append(i)
        keys = list(groups)
        if epoch > 0:
            random.Random(self.cfg.train.seed + 7919 * self.step_count + epoch).shuffle(keys)
        k = min(self.cfg.algorithm.minibatches, len(keys))
        return [[i for key in keys[j::k] for i in groups[key]] for j in range(k)]

    def _loss_config(self) -> PolicyLossConfig:
        a = self.cfg.algorithm
        return PolicyLossConfig(
            ratio=a.ratio, eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip,
            behaviour_weight_cap=a.behaviour_weight_cap, aggregation=a.aggregation, norm_constant=a.norm_constant,
            # TIS (truncate at the cap instead of masking): an AlgorithmConfig field once config.py has it
            behaviour_weight_truncate=bool(getattr(a, "behaviour_weight_truncate", False)),
            kl_coef=a.kl_coef if self.reference is not None and a.advantage != "reinforce_pp" else 0.0,
            kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
        )

    def _need_entropy(self) -> bool:
        return self.cfg.algorithm.entropy_coef != 0

    def _optimizer_step(self, optimizer, model) -> float:
        clip = self.cfg.optim.grad_clip
        # Sharded (DTensor) gradients: clip_grad_norm_ reduces the norm over all ranks.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _autocast(self):
        if self.cfg.train.autocast_bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    # ---------------------------------------------------------------------- SFT
    def sft_step(self, problems: list[Problem] | None = None) -> dict[str, float]:
        """One supervised step on prompt + target (+ eos), token-mean NLL of the target."""
        problems = problems or self.next_problems(self.cfg.sft.batch_size)
        seqs, masks = [], []
        for p in problems:
            if self.multi_turn and hasattr(self.task, "expert_actions"):
                # a whole expert episode; its actions (not the observations) are trained
                episode = run_episode(self.task.make_env(), p, scripted_policy(self.task.expert_actions(p), self.tokenizer),
                                      self.tokenizer, max_turns=self.cfg.task.max_turns,
                                      max_total_tokens=self.cfg.task.max_episode_tokens)
                full = episode.full_sequence()
                seqs.append(torch.tensor(full.token_ids))
                masks.append(torch.tensor(full.loss_mask))
                continue
            prompt = self.format.prompt_ids(self.tokenizer, p.prompt)
            target = self.tokenizer.encode(self.task.target(p)) + [self.tokenizer.eos_token_id]
            seqs.append(torch.tensor(prompt + target))
            masks.append(torch.tensor([False] * (len(prompt) - 1) + [True] * len(target)))
        n_tokens = float(sum(int(m.sum()) for m in masks))

        def nll(logprobs, index):
            return -sum((lp * masks[i].to(lp.device, lp.dtype)).sum() for lp, i in zip(logprobs, index.tolist())) / n_tokens

        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.sft.lr
        if self.dist:  # every rank built the same batch: each runs its share
            from .distributed.data_parallel import all_reduce_sum, gradient_step

            local = self._share(seqs)
            loss = 0.0
            with gradient_step(self.engine):
                if local:
                    where = torch.tensor(local)
                    with self._autocast():
                        loss = self.engine.forward_backward([seqs[i] for i in local],
                                                            lambda lps, index: nll(lps, where[index]), separable=True)
            loss = float(all_reduce_sum(loss, self.device))
        else:
            with self._autocast():
                loss = self.engine.forward_backward(seqs, nll, separable=True)
        norm = self._optimizer_step(self.optimizer, self.model)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.sft_count += 1
        self._sync_rollout_weights()
        return {"sft/loss": loss, "sft/grad_norm": norm}

    # ------------------------------------------------------------------- eval
    def evaluate(self, n: int | None = None) -> dict[str, float]:
        """Greedy accuracy and mean reward on the task's held-out problems."""
        problems = self.task.eval_problems(n or self.cfg.train.eval_problems, seed=self.cfg.train.seed)
        mine, _ = self._my_problems(problems)  # data parallel: each rank scores its slice
        samples = self.generate_samples(mine, 1, greedy=True) if mine else []
        last = {}
        for s in samples:  # multi-turn: one reward per episode
            last[s.episode] = s
        rewards = [s.reward for s in last.values()]
        if self.dist:
            from .distributed.data_parallel import all_gather_objects

            rewards = [r for part in all_gather_objects(rewards) for r in part]
        correct = [r >= 1.0 - 1e-9 for r in rewards]
        return {"eval/accuracy": float(np.mean(correct)), "eval/reward": float(np.mean(rewards))}

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The trainer state of a checkpoint. Data parallel: a collective (every rank calls
        it); sharded optimizer and critic state are gathered whole, so a checkpoint has the
        same layout as a one-process one, plus every rank's RNG state (``rng_ranks``)."""
        if not self.dist:
            return {
                "step": self.step_count, "sft_steps": self.sft_count, "cursor": self.cursor, "epoch": self.epoch,
                "version": self.rollout.version, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": rng_state(), "config": self.cfg.to_dict(),
                "critic": None if self.critic is None else self.critic.model.state_dict(),
                "critic_opt": None if self.critic_opt is None else self.critic_opt.state_dict(),
                "reference": None if self.reference is None else self.reference.model.state_dict(),
            }
        from .distributed.data_parallel import all_gather_objects, full_optimizer_state, full_state_dict

        rngs = all_gather_objects(rng_state())
        return {
            "step": self.step_count, "sft_steps": self.sft_count, "cursor": self.cursor, "epoch": self.epoch,
            "version": self.rollout.version, "optimizer": full_optimizer_state(self.optimizer),
            "scheduler": self.scheduler.state_dict(), "rng": rngs[0], "rng_ranks": rngs,
            "config": self.cfg.to_dict(),
            "critic": None if self.critic is None else full_state_dict(self.critic.model),
            "critic_opt": None if self.critic_opt is None else full_optimizer_state(self.critic_opt),
            "reference": None if self.reference is None else self.reference.model.state_dict(),
        }

    def save(self, out_dir: str | Path | None = None) -> Path:
        """Write a checkpoint (data parallel: every rank calls it, rank 0 writes: the
        rollout engine's whole copy of the weights, which is the policy's)."""
        root = Path(out_dir or self.cfg.train.out_dir) / "checkpoints"
        if not self.dist:
            return save_checkpoint(root, self.step_count, self.model, self.tokenizer, self.state_dict(),
                                   keep_last=self.cfg.train.keep_last)
        import torch.distributed as dist

        state = self.state_dict()
        path = root / f"step-{self.step_count:06d}"
        if self.is_main:
            path = save_checkpoint(root, self.step_count, self.rollout.model, self.tokenizer, state,
                                   keep_last=self.cfg.train.keep_last)
        dist.barrier()
        return path

    def load(self, checkpoint: str | Path) -> Path:
        """Restore model, optimizer, scheduler, RNG, data cursor and version."""
        path = resolve_checkpoint(checkpoint)
        state = load_state(path)
        from safetensors.torch import load_file

        weights = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            weights.update(load_file(f))
        # data parallel: the whole weights go to the rollout copy, each rank's shards to the policy
        whole = self.rollout.model if self.dist else self.model
        missing, unexpected = whole.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise ConfigError(f"checkpoint {path} does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if whole.config.tie_word_embeddings:
            whole.tie_weights()
        if self.dist:
            from .distributed.data_parallel import load_full_optimizer_state, load_full_state_dict

            load_full_state_dict(self.model, whole.state_dict())
            load_full_optimizer_state(self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None and state.get("critic") is not None:
            if self.dist:
                load_full_state_dict(self.critic.model, state["critic"])
                load_full_optimizer_state(self.critic_opt, state["critic_opt"])
            else:
                self.critic.model.load_state_dict(state["critic"])
                self.critic_opt.load_state_dict(state["critic_opt"])
        if self.reference is not None and state.get("reference") is not None:
            self.reference.model.load_state_dict(state["reference"])
        self.step_count, self.sft_count = state["step"], state["sft_steps"]
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._shuffled(self.epoch)
        self.rollout.version = state["version"]
        rngs = state.get("rng_ranks")
        rank, world = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        if rngs is not None and len(rngs) == world:
            set_rng_state(rngs[rank])
        else:  # saved with another number of processes
            set_rng_state(state["rng"])
            if rank:
                torch.manual_seed(self.cfg.train.seed + 7919 * rank + 104729 * self.step_count)
        return path


def _validate(cfg: Config) -> None:
    a = cfg.algorithm
    if a.advantage not in ADVANTAGES:
        raise ConfigError(f"algorithm.advantage: unknown {a.advantage!r}; choose one of {', '.join(ADVANTAGES)}")
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: unknown {cfg.model.dtype!r}; choose one of {', '.join(DTYPES)}")
    for name in ("prompts_per_step", "group_size"):
        if getattr(cfg.rollout, name) < 1:
            raise ConfigError(f"rollout.{name} must be at least 1")
    if a.advantage == "rloo" and cfg.rollout.group_size < 2:
        raise ConfigError("algorithm.advantage=rloo needs rollout.group_size >= 2")
    if a.ppo_epochs < 1 or a.minibatches < 1:
        raise ConfigError("algorithm.ppo_epochs and algorithm.minibatches must be at least 1")


def _select_batch(batch: TokenBatch, index: list[int]) -> TokenBatch:
    """The sequences ``index`` of ``batch`` (in that order) as a batch of their own."""
    from .rl.batch import TOKEN_FIELDS

    tokens, _ = batch.token_index(index)
    if tokens is None:
        return batch
    fields = {n: getattr(batch, n)[tokens.to(batch.device)] for n in TOKEN_FIELDS if getattr(batch, n) is not None}
    return TokenBatch(seq_lengths=batch.seq_lengths[torch.as_tensor(index, dtype=torch.int64)], **fields)
