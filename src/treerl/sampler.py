"""What produces samples: the order of the training problems, rollout (single-turn
groups or multi-turn episodes) with the rollout engine, scoring, supervised batches, and
held-out evaluation.

Owns the rollout engine (:class:`~treerl.rollout.RolloutEngine`: its weights and version)
and the data order (problems, epoch, cursor), and saves them (:meth:`Sampler.state_dict`:
the order and the version; the weights are the policy's). One process: the rollout engine
shares the policy's parameters. Data parallel: the policy is sharded, so each rank's
rollout engine holds a whole copy, refreshed by :meth:`Sampler.sync_weights` after every
optimizer step; each rank rolls out a contiguous slice of a step's prompts and the
samples are gathered.

Takes config sections ``rollout`` (sampling, the engine's settings) and ``task`` (episode
limits, agents); the seed and the held-out problems per evaluation (``train.seed``,
``train.eval_problems``) are passed explicitly.
"""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError, RolloutConfig, TaskConfig
from .distributed import ranks
from .distributed.data_parallel import DistContext, full_state_dict
from .overlap import GroupForwards, stream_groups
from .rollout import SamplingParams, build_rollout_engine
from .samples import Sample
from .tasks.base import DatasetError, Problem, Task, score_problems
from .tasks.env import ChatFormat, run_episode, run_episodes, scripted_policy


class Sampler:
    """Rollout and data order for one trainer (see the module docstring)."""

    def __init__(self, rollout_cfg: RolloutConfig, task_cfg: TaskConfig, task: Task, tokenizer: Any,
                 model: torch.nn.Module, dist: DistContext | None, *, seed: int = 0, eval_problems: int = 100,
                 weights_root: str | Path = "weights_for_server"):
        """``seed``: the data order's and the tasks' splits'; ``eval_problems``: held-out
        problems per evaluation; ``weights_root``: where a remote rollout backend's weights
        are written (``train.out_dir/weights_for_server``)."""
        self.rollout_cfg, self.task_cfg, self.seed, self.n_eval = rollout_cfg, task_cfg, seed, eval_problems
        self.task, self.tokenizer, self.model, self.dist = task, tokenizer, model, dist
        self.format = ChatFormat.for_tokenizer(tokenizer)
        self.multi_turn = task.max_turns > 1
        self.rollout = build_rollout_engine(rollout_cfg, copy.deepcopy(model) if dist else model,
                                            prefix_cache_tokens=self._prefix_cache_tokens())
        self.max_new_tokens = rollout_cfg.max_new_tokens or task.max_new_tokens
        self.agents = None  # agent episodes / a served or remote rollout backend (treerl.agents)
        if task_cfg.agent or rollout_cfg.backend != "embedded":
            from .agents import AgentRollout

            self.agents = AgentRollout(rollout_cfg, task_cfg, self.rollout, tokenizer, task, self.max_new_tokens, model,
                                       weights_root=weights_root)
        self.skipped_prompts = {"train": 0, "eval": 0}  # too long for the context (skipped, with a warning)
        self.train_problems = self._fitting(task.train_problems(seed=seed), "train")
        if not self.train_problems:
            raise ConfigError(f"task {task.name!r} has no training problems (empty dataset)")
        self.eval_problems(eval_problems)  # a held-out split too small is refused now, not later
        self.restore(cursor=0, epoch=0)

    def _fitting(self, problems: list[Problem], split: str) -> list[Problem]:
        """``problems`` without those whose prompt (+ ``max_new_tokens``) exceeds the model's
        context: skipped with one warning per split and counted (``skipped_prompts``); a
        split left empty is a :class:`DatasetError`. (Agent tasks build their own prompts.)"""
        context = self.rollout.max_positions
        if context is None or self.agents is not None:
            return problems
        limit = context - self.max_new_tokens
        if limit < 1:
            raise ConfigError(f"rollout.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in the "
                              f"model's context of {context} tokens (max_position_embeddings): lower it")
        fits = [len(self.format.prompt_ids(self.tokenizer, p.prompt)) <= limit for p in problems]
        keep = [p for p, ok in zip(problems, fits) if ok]
        skipped = len(problems) - len(keep)
        if not keep:
            raise DatasetError(f"task {self.task.name!r}: every {split} prompt ({len(problems)}) is longer than "
                               f"{limit} tokens (the context of {context} minus rollout.max_new_tokens="
                               f"{self.max_new_tokens}): lower rollout.max_new_tokens or use a longer-context model")
        if skipped and not self.skipped_prompts[split]:
            first = problems[fits.index(False)]
            print(f"treerl: skipping {skipped} of {len(problems)} {split} problems whose prompts are longer than "
                  f"{limit} tokens (the context of {context} minus max_new_tokens={self.max_new_tokens}; first: "
                  f"{first.prompt[:40]!r}); counted in data/skipped_prompts", file=sys.stderr)
        self.skipped_prompts[split] = max(self.skipped_prompts[split], skipped)
        return keep

    def eval_problems(self, n: int | None = None) -> list[Problem]:
        """The held-out problems of an evaluation (``n``, default ``train.eval_problems``),
        those too long for the context skipped (:meth:`_fitting`)."""
        return self._fitting(self.task.eval_problems(n or self.n_eval, seed=self.seed), "eval")

    def _prefix_cache_tokens(self) -> int:
        """``rollout.prefix_cache_tokens``, or by default: room for every episode's context of
        a step for multi-turn tasks (turn t + 1 then prefills only its new tokens), else 0."""
        r = self.rollout_cfg
        if r.prefix_cache_tokens is not None:  # >= 0 (declared in treerl.config)
            return int(r.prefix_cache_tokens)
        return r.prompts_per_step * r.group_size * self.task_cfg.max_episode_tokens if self.multi_turn else 0

    # ------------------------------------------------------------- its state
    def state_dict(self) -> dict:
        """The sampler's part of a checkpoint: the data order (``cursor``, ``epoch``) and the
        rollout engine's weight ``version`` (its weights are the policy's)."""
        return {"cursor": self.cursor, "epoch": self.epoch, "version": self.rollout.version}

    def load_state_dict(self, state: dict) -> None:
        """Continue the data order and the weight versions of :meth:`state_dict`."""
        self.restore(cursor=state["cursor"], epoch=state["epoch"])
        self.rollout.version = state["version"]

    # ------------------------------------------------------------- data order
    def restore(self, cursor: int, epoch: int) -> None:
        """Continue the data order at ``cursor`` of ``epoch`` (a fresh run: 0, 0)."""
        self.cursor, self.epoch = cursor, epoch  # cursor: position in the shuffled problems
        self._order = self._shuffled(epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.train_problems)))
        random.Random(self.seed * 1000 + epoch).shuffle(order)
        return order

    def next_problems(self, n: int) -> list[Problem]:
        """The next ``n`` training problems (a cursor through epochs of shuffled problems)."""
        out = []
        while len(out) < n:
            if self.cursor >= len(self._order):
                self.restore(cursor=0, epoch=self.epoch + 1)
            out.append(self.train_problems[self._order[self.cursor]])
            self.cursor += 1
        return out

    # ---------------------------------------------------------------- rollout
    def sampling_params(self, n: int, greedy: bool = False) -> SamplingParams:
        r = self.rollout_cfg
        return SamplingParams(
            n=n, temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=self.max_new_tokens, stop_token_ids=[self.tokenizer.eos_token_id],
            stop_strings=list(self.task.stop), decode=self.tokenizer,
            branch_every=0 if greedy else r.branch_every, branch_factor=r.branch_factor,
        )

    def step_samples(self, problems: list[Problem], n: int, ready: GroupForwards | None = None) -> list[Sample]:
        """A step's samples: ``n`` per problem. Data parallel: each rank rolls out its
        slice of ``problems`` and every rank returns the whole batch, in problem order.
        ``ready``: gets the finished groups' sequences during the rollout (:mod:`treerl.overlap`)."""
        mine, _ = ranks.my_slice(self.dist, problems)
        samples = self.generate(mine, n, ready=ready) if mine else []
        return ranks.gather_samples(samples) if self.dist else samples

    @torch.no_grad()
    def generate(self, problems: list[Problem], n: int, greedy: bool = False,
                 ready: GroupForwards | None = None) -> list[Sample]:
        """Roll out ``n`` samples (episodes) per problem and score them; ``ready`` (embedded
        engine) gets each group's (each ended episode's) sequences as soon as they are final."""
        self.model.eval()
        try:
            if self.agents is not None:
                return [Sample(**fields) for fields in self.agents.generate(problems, n, greedy)]
            if self.multi_turn:
                return self._episodes(problems, n, greedy, ready)
            return self._single_turn(problems, n, greedy, ready)
        finally:
            self.model.train()

    def _single_turn(self, problems: list[Problem], n: int, greedy: bool, ready: GroupForwards | None) -> list[Sample]:
        prompts = [self.format.prompt_ids(self.tokenizer, p.prompt) for p in problems]
        groups = stream_groups(self.rollout, prompts, self.sampling_params(n, greedy), ready)  # in prompt order
        return self.group_samples(problems, groups, self.rollout.version)

    def group_samples(self, problems: list[Problem], groups: list, version: int) -> list[Sample]:
        """The scored samples of single-turn ``groups`` (``groups[i]``: the rollout
        :class:`~treerl.rollout.Group` of ``problems[i]``): per completion, the prompt
        (untrained, stamped ``version``) then the completion's tokens, logprobs and versions;
        ``group`` is the problem's index, ``episode`` the completion's in the list."""
        flat = [(i, c) for i, g in enumerate(groups) for c in g.completions]
        texts = [self.tokenizer.decode(c.completion_ids.tolist(), skip_special_tokens=True) for _, c in flat]
        rewards = score_problems(self.task.reward, [problems[i] for i, _ in flat], texts)
        samples = []
        for k, ((i, c), text, reward) in enumerate(zip(flat, texts, rewards)):
            p, t = len(c.prompt_ids), len(c.completion_ids)
            samples.append(Sample(
                token_ids=c.token_ids.tolist(), loss_mask=[False] * (p - 1) + [True] * t,
                behaviour_logprobs=[0.0] * (p - 1) + c.logprobs.tolist(),
                versions=[version] * (p - 1) + c.versions.tolist(),
                reward=reward, group=i, episode=k, completion=text,
            ))
        return samples

    def _episodes(self, problems: list[Problem], n: int, greedy: bool, ready: GroupForwards | None) -> list[Sample]:
        params = self.sampling_params(1, greedy)

        def policy(contexts):
            if ready is not None:  # the episodes that ended last turn: their forwards beside this turn's rollout
                ready.turn_starts(contexts)
            groups = self.rollout.generate(contexts, params)
            if ready is not None:
                ready.turn_ends([g.completions[0].token_ids for g in groups])
            return [(g.completions[0].completion_ids, g.completions[0].logprobs) for g in groups]

        expanded = [p for p in problems for _ in range(n)]
        episodes = run_episodes([self.task.make_env() for _ in expanded], expanded, policy, self.tokenizer,
                                max_turns=self.task_cfg.max_turns, max_total_tokens=self.task_cfg.max_episode_tokens)
        samples = []
        for e, ep in enumerate(episodes):
            for seq in ep.sequences:
                samples.append(Sample(
                    token_ids=seq.token_ids, loss_mask=seq.loss_mask, behaviour_logprobs=seq.behaviour_logprobs,
                    versions=[self.rollout.version] * len(seq.loss_mask), reward=ep.reward, group=e // n,
                    episode=e, completion=ep.transcript(),
                ))
        return samples

    def sync_weights(self, model: torch.nn.Module) -> None:
        """After an optimizer step: the rollout engine gets ``model``'s weights (version += 1)."""
        if self.dist:
            self.rollout.update_weights(full_state_dict(model))
        else:
            self.rollout.update_weights(model)  # shares the parameters: bumps the version

    # -------------------------------------------------------------------- SFT
    def sft_batch(self, problems: list[Problem]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Supervised sequences ``[L]`` and their loss masks ``[L - 1]`` (True on target
        tokens): prompt + target + eos, or a whole expert episode (multi-turn tasks with
        ``expert_actions``; its actions, not the observations, are trained)."""
        seqs, masks = [], []
        for p in problems:
            if self.multi_turn and hasattr(self.task, "expert_actions"):
                episode = run_episode(self.task.make_env(), p, scripted_policy(self.task.expert_actions(p), self.tokenizer),
                                      self.tokenizer, max_turns=self.task_cfg.max_turns,
                                      max_total_tokens=self.task_cfg.max_episode_tokens)
                full = episode.full_sequence()
                seqs.append(torch.tensor(full.token_ids))
                masks.append(torch.tensor(full.loss_mask))
                continue
            prompt = self.format.prompt_ids(self.tokenizer, p.prompt)
            target = self.tokenizer.encode(self.task.target(p)) + [self.tokenizer.eos_token_id]
            seqs.append(torch.tensor(prompt + target))
            masks.append(torch.tensor([False] * (len(prompt) - 1) + [True] * len(target)))
        return seqs, masks

    # ------------------------------------------------------------------- eval
    def evaluate(self, n: int | None = None) -> dict[str, float]:
        """Greedy accuracy and mean reward on the task's held-out problems (data parallel:
        each rank scores its slice)."""
        problems = self.eval_problems(n)
        mine, _ = ranks.my_slice(self.dist, problems)
        samples = self.generate(mine, 1, greedy=True) if mine else []
        last = {}
        for s in samples:  # multi-turn: one reward per episode
            last[s.episode] = s
        rewards = [s.reward for s in last.values()]
        if self.dist:
            rewards = ranks.gather_list(rewards)
        correct = [r >= 1.0 - 1e-9 for r in rewards]
        out = {"eval/accuracy": float(np.mean(correct)), "eval/reward": float(np.mean(rewards))}
        if any(self.skipped_prompts.values()):
            out["data/skipped_prompts"] = float(sum(self.skipped_prompts.values()))
        return out
