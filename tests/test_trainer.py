"""The synchronous trainer: exactness of a full RL step across engines, a short GRPO run
that learns, critic/GAE and multi-turn steps, and bad-input errors."""

import json
import math

import pytest
import torch

import treerl
from helpers.configs import run_config, tiny_model_overrides
from helpers.models import tiny_model
from treerl.models import rmsnorm_in_input_precision
from treerl.tasks import get_task
from treerl.tasks.base import DatasetError, RewardError
from treerl.trainer import Trainer

def config(*overrides):
    return run_config(None, "rollout.prompts_per_step=3", "rollout.group_size=4", "train.eval_problems=8", *overrides,
                      layers=2)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("extra", [
    [],  # GRPO, one update
    ["algorithm.ppo_epochs=2", "algorithm.minibatches=2", "algorithm.kl_coef=0.1", "algorithm.eps_high=0.28"],
    ["algorithm.advantage=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8"],
])
def test_tree_and_flat_give_the_same_parameters_after_an_rl_step(extra):
    """float64: a full RL step (rollout, forwards, advantages, updates) with the tree engine
    (auto with a small budget: chains and depth-first segments) equals the flat engine."""
    results = []

    def varied_reward(prompt, completion, **fields):  # a random model earns some of this
        return sum(ch in "13579" for ch in completion) / max(1, len(completion))

    for mode in ("flat", "auto"):
        budget = 64 if mode == "flat" else 12  # flat needs whole sequences; auto splits trees
        cfg = config("model.dtype=float64", f"engine.mode={mode}", f"engine.max_tokens={budget}", "engine.chunk_tokens=5",
                     "optim.lr=1e-2", *extra)
        task = get_task("addition", digits=2)
        task.reward = varied_reward
        trainer = Trainer(cfg, task=task)
        rmsnorm_in_input_precision(trainer.model)
        if trainer.critic is not None:
            rmsnorm_in_input_precision(trainer.critic.model)
        if mode == "auto":
            rng = torch.get_rng_state()
            plan = trainer.engine.plan(treerl.PrefixTree.from_sequences(
                [s.token_ids for s in trainer.sampler.generate(trainer.task.train_problems(3), 4)]))
            assert any(plan.children), "the tree plan must contain chains, or the test proves little"
            torch.set_rng_state(rng)  # undo the RNG use of this look
        before = params(trainer.model).clone()
        metrics = trainer.step()
        results.append((params(trainer.model), metrics, [s.token_ids for s in trainer.last_samples]))
    (flat_p, flat_m, flat_s), (tree_p, tree_m, tree_s) = results
    assert flat_m["reward/std"] > 0
    assert flat_s == tree_s  # the same rollouts
    assert not torch.equal(flat_p, before)  # the step changed something
    rel = (tree_p - flat_p).norm() / (flat_p - before).norm()
    assert rel < 1e-9, float(rel)
    assert tree_m["tree/ideal_ratio"] > 1.5


def test_grpo_raises_the_reward_of_a_builtin_task():
    """A seeded, short GRPO run (no SFT) on 1-digit addition with format credit (0.5 for a
    well-formed number): the policy learns the answer format, so the mean reward of the
    last steps clearly beats the first steps'. (Correctness via RL after an SFT warm-up
    is what the demo shows: examples/demo_sorting.yaml.)"""
    cfg = config("task.kwargs={digits: 1, format_reward: 0.5}", "rollout.prompts_per_step=8", "rollout.group_size=8",
                 "optim.lr=1e-2", "train.steps=40", "train.seed=3")
    trainer = Trainer(cfg)
    rewards = [trainer.step()["reward/mean"] for _ in range(cfg.train.steps)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > first + 0.08, (first, last, rewards)


def test_multi_turn_calculator_step_shares_the_conversation():
    cfg = config("task.name=calculator", "task.kwargs={}", "task.max_turns=3", "task.max_episode_tokens=60",
                 "rollout.max_new_tokens=12", "rollout.prompts_per_step=2", "rollout.group_size=3",
                 f"model.overrides={tiny_model_overrides(1, 128)}")
    trainer = Trainer(cfg)
    metrics = trainer.step()
    samples = trainer.last_samples
    assert {s.group for s in samples} == {0, 1}
    assert metrics["tree/ideal_ratio"] > 1.0
    # per-turn sequences of one episode extend each other; each trains only its own action
    by_episode = {}
    for s in samples:
        by_episode.setdefault(s.episode, []).append(s)
    for turns in by_episode.values():
        for a, b in zip(turns, turns[1:]):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids
            assert not any(b.loss_mask[: len(a.loss_mask)])


def test_reward_that_returns_nan_is_an_error_naming_the_sample():
    task = get_task("addition", digits=1)
    calls = []

    def reward(prompt, completion, **fields):
        calls.append(prompt)
        return math.nan if len(calls) == 3 else 0.0

    task.reward = reward
    trainer = Trainer(config(), task=task)
    with pytest.raises(RewardError, match=r"sample 2 .*nan"):
        trainer.step()


def test_reward_that_raises_is_an_error_naming_the_sample():
    task = get_task("addition", digits=1)

    def reward(prompt, completion, **fields):
        raise KeyError("answer")

    task.reward = reward
    with pytest.raises(RewardError, match=r"raised on sample 0"):
        Trainer(config(), task=task).step()


def test_prompt_longer_than_the_context_is_refused():
    """Every prompt too long: one line at build time naming the limit and the fix."""
    cfg = config(f"model.overrides={tiny_model_overrides(1, 8)}")
    with pytest.raises(DatasetError, match=r"every train prompt \(10000\) is longer than 4 tokens .* lower rollout.max_new_tokens"):
        Trainer(cfg)


def test_prompts_longer_than_the_context_are_skipped_with_a_count_and_a_warning(tmp_path, capsys):
    """Some prompts too long: skipped at load (train and held-out), one warning per split,
    counted in the metrics (data/skipped_prompts); the run goes on with the rest."""
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows += [{"prompt": "9" * 40 + f"+{i}=", "answer": "0"} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config("task.name=math_jsonl", f"task.kwargs={{path: {data}, eval_fraction: 0.25}}", "rollout.max_new_tokens=4",
                 "train.eval_problems=2", "model.overrides={num_hidden_layers: 1, max_position_embeddings: 24}")
    trainer = Trainer(cfg)
    err = capsys.readouterr().err
    assert "treerl: skipping" in err and "counted in data/skipped_prompts" in err
    assert all(len(p.prompt) < 40 for p in trainer.sampler.train_problems)
    skipped = sum(trainer.sampler.skipped_prompts.values())
    assert 1 <= skipped <= 4
    assert trainer.evaluate()["data/skipped_prompts"] == skipped
    trainer.step()  # no prompt error


def test_bad_algorithm_names_are_config_errors():
    with pytest.raises(ValueError, match="advantage"):
        Trainer(config("algorithm.advantage=ppo2"))
    with pytest.raises(ValueError, match="group_size >= 2"):
        Trainer(config("algorithm.advantage=rloo", "rollout.group_size=1"))


@pytest.mark.parametrize("mode", ["packed", "dfs"])
def test_critic_value_head_matches_per_sequence_forward(mode):
    """A critic engine (value head) gives the values and gradients of a per-sequence forward."""
    model = tiny_model(vocab_size=40, seed=2)
    head = torch.nn.Linear(model.config.hidden_size, 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 40, (6,), generator=gen).tolist()
    seqs = [prompt + torch.randint(0, 40, (int(k),), generator=gen).tolist() for k in (1, 4, 4, 7)] + [[3]]
    targets = [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]
    every = list(model.named_parameters()) + [("head." + n, p) for n, p in head.named_parameters()]

    ref = [head(model.model(input_ids=torch.tensor([s])).last_hidden_state[0, :-1])[:, 0] for s in seqs]
    sum(((r - t) ** 2).sum() for r, t in zip(ref, targets)).backward()
    ref_grads = {n: p.grad.clone() for n, p in every if p.grad is not None}
    for _, p in every:
        p.grad = None
    engine = treerl.TreeEngine(model, mode, value_head=head, chunk_tokens=3)
    for got, want in zip(engine.values(seqs), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    engine.forward_backward(seqs, lambda vs: sum(((v - t) ** 2).sum() for v, t in zip(vs, targets)))
    for n, p in every:
        if n in ref_grads:
            assert (p.grad - ref_grads[n]).norm() <= 1e-9 * ref_grads[n].norm(), n
    with pytest.raises(ValueError, match="no entropies"):
        engine.logprobs(seqs, entropy=True)


def test_multi_turn_turns_reuse_the_previous_turns_kv():
    """Multi-turn episodes go through the stream with the prefix cache on by default: later
    turns prefill only their new tokens, and the samples equal those of an engine without
    the cache (float64, same random numbers). The environment answers every action, so
    episodes run all their turns."""
    from treerl.tasks.calculator_env import CalculatorEnv

    class Chatty(CalculatorEnv):
        def step(self, action):
            return "<result>1</result>", 0.0, False

    base = ["task.name=calculator", "task.kwargs={}", "task.max_turns=3", "task.max_episode_tokens=60",
            "rollout.max_new_tokens=12", "rollout.prompts_per_step=2", "rollout.group_size=3", "model.dtype=float64",
            f"model.overrides={tiny_model_overrides(1, 128)}"]
    runs = []
    for extra in ([], ["rollout.prefix_cache_tokens=0"]):
        task = get_task("calculator")
        task.make_env = Chatty
        trainer = Trainer(config(*base, *extra), task=task)
        rmsnorm_in_input_precision(trainer.model)
        hits, turns = [], []
        generate = trainer.sampler.rollout.generate

        def counting(contexts, p, generate=generate, trainer=trainer, hits=hits, turns=turns):
            groups = generate(contexts, p)
            hits.append(trainer.sampler.rollout.stats.prefix_cache_hit_tokens)
            turns.append(len(contexts))
            return groups

        trainer.sampler.rollout.generate = counting
        torch.manual_seed(0)
        samples = trainer.sampler.generate(trainer.sampler.next_problems(2), 3)
        runs.append((samples, hits, turns, trainer.sampler.rollout.prefix_cache))
    (cached, hits, turns, cache), (plain, plain_hits, _, no_cache) = runs
    assert cache is not None and no_cache is None
    assert len(turns) > 1 and hits[0] == 0 and all(h > 0 for h in hits[1:]) and not any(plain_hits)
    assert [s.token_ids for s in cached] == [s.token_ids for s in plain]
    for a, b in zip(cached, plain):
        assert a.loss_mask == b.loss_mask
        assert torch.allclose(torch.tensor(a.behaviour_logprobs), torch.tensor(b.behaviour_logprobs), rtol=1e-9, atol=1e-12)


def test_each_part_saves_and_restores_its_own_state():
    """``Trainer.state_dict`` is the counters, RNG and config plus the learner's and the
    sampler's own ``state_dict`` (disjoint keys: the checkpoint's flat layout); each part's
    ``load_state_dict`` gives a fresh part the saved state (optimizers, schedule, critic,
    data order, version)."""
    cfg = config("algorithm.advantage=gae", "rollout.prompts_per_step=2", "rollout.group_size=2")
    a = Trainer(cfg)
    a.step()
    a.sampler.next_problems(3)
    learner, sampler = a.learner.state_dict(), a.sampler.state_dict()
    assert sampler == {"cursor": 5, "epoch": 0, "version": 1}
    assert set(learner) == {"optimizer", "scheduler", "critic", "critic_opt", "reference"} and learner["reference"] is None
    assert set(a.state_dict()) == {"step", "sft_steps", "rng", "config"} | set(learner) | set(sampler)
    b = Trainer(cfg)
    b.sampler.load_state_dict(sampler)
    b.learner.load_state_dict(learner)
    assert b.sampler.state_dict() == sampler and b.sampler.rollout.version == 1
    assert [p.prompt for p in b.sampler.next_problems(4)] == [p.prompt for p in a.sampler.next_problems(4)]
    assert b.learner.scheduler.state_dict() == a.learner.scheduler.state_dict()
    for opt in ("optimizer", "critic_opt"):
        mine, theirs = getattr(b.learner, opt).state_dict()["state"], getattr(a.learner, opt).state_dict()["state"]
        assert mine.keys() == theirs.keys() and len(mine) > 0
        assert all(torch.equal(mine[k]["exp_avg"], theirs[k]["exp_avg"]) for k in mine)
    assert torch.equal(params(b.critic.model), params(a.critic.model))
