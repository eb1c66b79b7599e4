"""The step's forwards run during its rollout (treerl.overlap, ``rollout.overlap_forwards``):
the proximal / reference logprobs and critic values of an overlapped step equal those of the
sequential step (float64, 1e-9 relative), for GRPO groups and multi-turn episodes; and the
forwards really ran during the rollout (not computed afterwards)."""

import pytest
import torch

from helpers.configs import run_config
from helpers.models import tiny_model
from treerl.config import Config, ConfigError
from treerl.models import rmsnorm_in_input_precision
from treerl.overlap import GroupForwards
from treerl.tasks import get_task
from treerl.trainer import Trainer

def config(*overrides):
    return run_config(None, "model.dtype=float64", "rollout.prompts_per_step=3", "rollout.group_size=4",
                      "train.eval_problems=8", "algorithm.kl_coef=0.1", "algorithm.minibatches=2", "optim.lr=1e-2",
                      "engine.max_tokens=24", "engine.chunk_tokens=5", *overrides, layers=2, context=128)


def varied_reward(prompt, completion, **fields):  # a random model earns some of this: real gradients
    return sum(ch in "13579" for ch in completion) / max(1, len(completion))


def run_steps(cfg, task=None, steps=2):
    """Fields of the forwards of ``steps`` steps, the samples, and the GroupForwards used.
    (Rewards must vary: with zero advantages the update is Adam on rounding noise, which
    tells nothing about the forwards.)"""
    if task is None:
        task = get_task("addition", digits=2)
        task.reward = varied_reward
    trainer = Trainer(cfg, task=task)
    rmsnorm_in_input_precision(trainer.model)
    for m in (trainer.reference, trainer.critic):
        if m is not None:
            rmsnorm_in_input_precision(m.model)
    fields, readies, samples = [], [], []
    forwards, group_forwards = trainer.learner.forwards, trainer.learner.group_forwards

    depth = [0]

    def recording_forwards(engines, seqs, tree, dtype, ready=None):  # the learner's call, not its inner ones
        depth[0] += 1
        try:
            out = forwards(engines, seqs, tree, dtype, ready)
        finally:
            depth[0] -= 1
        if not depth[0]:
            fields.append(out)
        return out

    def recording_group_forwards(how):
        ready = group_forwards(how)
        readies.append(ready)
        return ready

    trainer.learner.forwards = recording_forwards
    trainer.learner.group_forwards = recording_group_forwards
    # the sequential step's proximal forward over every sequence (not only those after the first minibatch)
    trainer.learner.proximal_reused = lambda *args: set()
    for _ in range(steps):
        assert trainer.step()["reward/std"] > 0
        samples.append([s.token_ids for s in trainer.last_samples])
    return fields, samples, readies


def assert_same_fields(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name])
        for x, y in zip(a[name], b[name]):
            assert x.dtype == y.dtype == torch.float64 and x.shape == y.shape
            assert (x - y).abs().max() <= 1e-9 * y.abs().max().clamp_min(1e-30), name


@pytest.mark.parametrize("extra", [
    [],  # GRPO with a KL reference and two minibatches: proximal + reference
    ["algorithm.advantage=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8"],  # + critic values
])
def test_overlapped_forwards_equal_the_sequential_ones_grpo(extra):
    """Two steps (the second after an update: the forwards see new weights): every field of
    every sequence equals the sequential step's; every sequence's forwards ran during the
    rollout, one group at a time."""
    seq_fields, seq_samples, seq_ready = run_steps(config("rollout.overlap_forwards=after", *extra))
    for how in ("stream", "inline"):
        fields, samples, readies = run_steps(config(f"rollout.overlap_forwards={how}", *extra))
        assert samples == seq_samples  # the same rollouts
        assert seq_ready == [None, None]
        names = {"proximal_logprobs", "reference_logprobs"} | ({"values"} if extra else set())
        for f, g, ready, s in zip(fields, seq_fields, readies, samples):
            assert set(f) == names
            assert ready.sequences == len(s)  # all computed during the rollout...
            assert len(ready._batches) == 3  # ... one group (prompt) at a time
            assert ready.stream is None  # CPU
            assert_same_fields(f, g)


class EndsAtTurn:
    """A calculator-like environment whose episodes end after 1, 2 or 3 turns (by episode)."""

    count = 0

    def __init__(self):
        EndsAtTurn.count += 1
        self.limit, self.turns = 1 + EndsAtTurn.count % 3, 0

    def reset(self, problem):
        return problem.prompt

    def step(self, action):
        self.turns += 1
        return "<result>1</result>", float(len(action) % 3) / 2, self.turns >= self.limit


def test_overlapped_forwards_equal_the_sequential_ones_multi_turn():
    """Multi-turn episodes ending at different turns: the episodes that ended at a turn get
    their forwards during the next turn's rollout, every turn's sequence takes its values
    from its episode's last sequence (a prefix of it), and all equal the sequential step's."""
    base = ["task.name=calculator", "task.kwargs={}", "task.max_turns=3", "task.max_episode_tokens=60",
            "rollout.max_new_tokens=12", "rollout.prompts_per_step=2", "rollout.group_size=3"]
    runs = []
    for how in ("after", "stream"):
        task = get_task("calculator")
        task.make_env = EndsAtTurn
        EndsAtTurn.count = 0
        runs.append(run_steps(config(*base, f"rollout.overlap_forwards={how}"), task=task, steps=1))
    (seq_fields, seq_samples, _), (fields, samples, readies) = runs
    assert samples == seq_samples
    ready = readies[0]
    turns = len(samples[0])
    assert turns > 6  # several turns per episode, so earlier turns are covered by later sequences
    assert 0 < ready.sequences < 6  # episodes that ended before the last turn, one sequence each
    assert_same_fields(fields[0], seq_fields[0])


def test_take_covers_prefixes_and_reports_what_it_lacks():
    """Content matching: a sequence takes the values of a computed sequence it is a prefix
    of (exactly those of its own forward), an uncomputed one is reported missing; a turn's
    ended episodes are those no next context extends."""
    from treerl.engine.tree_engine import TreeEngine
    model = tiny_model(vocab_size=40, seed=3)
    engine = TreeEngine(model, "auto")
    from contextlib import nullcontext

    ready = GroupForwards({"x": engine}, nullcontext, torch.device("cpu"))
    ready.turn_ends([[1, 2, 3, 4], [1, 2, 5], [7, 8, 9]])
    ready.turn_starts([[1, 2, 3, 4, 6, 6], [7, 8, 9, 1]])  # [1, 2, 5] ended
    assert ready.sequences == 1
    ready.add([torch.tensor([4, 5, 6, 7, 8])])
    seqs = [torch.tensor(s) for s in ([1, 2], [1, 2, 5], [4, 5, 6], [4, 5, 6, 7, 8], [9, 9, 9], [1, 2, 3])]
    out, missing = ready.take(seqs, ["x"], torch.float64)
    assert missing == [4, 5]  # [9, 9, 9] was never computed; [1, 2, 3] only in a turn that continued
    want = engine.logprobs([seqs[i] for i in (0, 1, 2, 3)])
    for i, w in zip((0, 1, 2, 3), want):
        torch.testing.assert_close(out["x"][i], w, rtol=1e-12, atol=0)
    assert out["x"][4] is None and out["x"][5] is None


def test_overlap_forwards_setting_is_checked():
    with pytest.raises(ConfigError, match="rollout.overlap_forwards"):
        Config.from_yaml(None, ["rollout.overlap_forwards=sometimes"])


def test_the_policy_runs_its_forwards_in_the_mode_the_sequential_ones_see():
    """The rollout puts the policy in eval mode; its forwards during the rollout run in train
    mode, as those after it (Sampler.generate puts it back), from the very first step."""
    modes = {}
    for how in ("after", "inline"):
        trainer = Trainer(config(f"rollout.overlap_forwards={how}"))
        trainer.model.eval()  # as a model fresh from from_pretrained
        seen, forward = [], trainer.engine.forward
        trainer.engine.forward = lambda *a, **k: seen.append(trainer.model.training) or forward(*a, **k)
        trainer.step()
        modes[how] = seen
    assert modes["after"] and set(modes["after"]) == set(modes["inline"]) == {True}
