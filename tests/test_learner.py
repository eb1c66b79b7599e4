"""Non-finite training: a non-finite loss or gradient skips that update (weights and
optimizer state untouched) with a warning and a counter in the metrics;
``optim.max_nonfinite_updates`` in a row stop the run with one line; a checkpoint never
holds a non-finite weight. The first minibatch's proximal logprobs taken from its own update
(no proximal forward for it): the step equals the one with the forward."""

import copy

import pytest
import torch

from helpers.configs import run_config, run_overrides
from treerl import checkpoint as ckpt
from treerl.cli import main
from treerl.config import Config
from treerl.learner import NonFiniteError
from treerl.models import rmsnorm_in_input_precision
from treerl.tasks import get_task
from treerl.trainer import Trainer

BASE = run_overrides(None, "rollout.prompts_per_step=2", "rollout.group_size=2", "train.eval_problems=2",
                     "train.eval_every=0", "sft.batch_size=2")


def params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def poison(model, when):
    """NaN gradients while ``when()`` is true (a loss that returns NaN writes NaN into .grad)."""
    p = next(model.parameters())
    return p.register_hook(lambda g: g * float("nan") if when() else g)


def test_a_non_finite_gradient_skips_the_update_with_a_warning_and_a_counter(tmp_path, capsys):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}", "optim.max_nonfinite_updates=2"]))
    bad = [True]
    poison(trainer.model, lambda: bad[0])
    before, adam = params(trainer.model), dict(trainer.learner.optimizer.state)
    metrics = trainer.step()
    assert metrics["train/skipped_updates"] == 1.0
    assert torch.equal(params(trainer.model), before) and dict(trainer.learner.optimizer.state) == adam
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "skipping an update with a non-finite loss or gradient at RL step 1" in capsys.readouterr().err
    bad[0] = False
    metrics = trainer.step()  # a good update resets the count and steps the optimizer
    assert metrics["train/skipped_updates"] == 0.0 and len(trainer.learner.optimizer.state) > 0
    assert trainer.learner.nonfinite_in_a_row == 0 and trainer.learner.nonfinite_total == 1


def test_k_non_finite_updates_in_a_row_stop_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    import treerl.trainer

    original = treerl.trainer.Trainer.__init__

    def poisoned_init(self, *a, **k):
        original(self, *a, **k)
        poison(self.model, lambda: True)

    monkeypatch.setattr(treerl.trainer.Trainer, "__init__", poisoned_init)
    code = main(["train", *BASE, "train.steps=5", "optim.max_nonfinite_updates=2", f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("treerl train: error: training stopped: 2 updates in a row had a non-finite loss or "
                              "gradient (optim.max_nonfinite_updates=2")


def test_sft_skips_non_finite_updates_too(tmp_path):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}", "optim.max_nonfinite_updates=1"]))
    poison(trainer.model, lambda: True)
    with pytest.raises(NonFiniteError, match="at an SFT step"):
        trainer.sft_step()


def test_a_checkpoint_never_holds_a_non_finite_weight(tmp_path):
    trainer = Trainer(Config.from_yaml(None, BASE + [f"train.out_dir={tmp_path}"]))
    first = trainer.save()
    trainer.step_count = 1
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("inf")
    with pytest.raises(ckpt.CheckpointError, match="refusing to save step 1: the weight .* holds NaN or inf; the "
                                                   "previous checkpoint .* is kept"):
        trainer.save()
    assert ckpt.list_checkpoints(tmp_path / "checkpoints") == [first]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


# the first minibatch's proximal logprobs from its own update: algorithm overrides, stale samples
REUSE = {
    "minibatches-kl": (["algorithm.minibatches=2", "algorithm.kl_coef=0.1"], False),
    "epochs-cap": (["algorithm.ppo_epochs=2", "algorithm.behaviour_weight_cap=1.2"], False),
    "epochs-minibatches-gspo": (["algorithm.ppo_epochs=2", "algorithm.minibatches=2", "algorithm.ratio=sequence",
                                 "algorithm.eps_low=0.05", "algorithm.eps_high=0.08", "algorithm.dual_clip=1.05"], False),
    "stale-one-update": ([], True),
}


@pytest.mark.parametrize("case", list(REUSE))
def test_the_first_minibatch_reuses_its_own_logprobs_as_proximal(case, monkeypatch):
    """The proximal forward covers only the sequences outside the first minibatch of epoch 0;
    weights, loss metrics and the rollout mismatch equal the step that runs it over all (float64)."""
    extra, stale = REUSE[case]
    cfg = run_config(None, "model.dtype=float64", "rollout.prompts_per_step=3", "rollout.group_size=4",
                     "optim.lr=1e-2", *extra, layers=2)
    task = get_task("addition", digits=2)  # a reward that varies within a group: advantages != 0
    task.reward = lambda prompt, completion, **f: sum(ch in "13579" for ch in completion) / max(1, len(completion))
    a, b = Trainer(cfg, task=task), Trainer(cfg, task=task)
    for t in (a, b):
        rmsnorm_in_input_precision(t.model)
    b.model.load_state_dict(a.model.state_dict())
    samples = a.sampler.generate(a.sampler.next_problems(3), 4)
    gen = torch.Generator().manual_seed(5)
    for i, s in enumerate(samples):  # behaviour logprobs off the current weights: behaviour weights != 1
        s.behaviour_logprobs = (torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
                                + 0.3 * torch.randn(len(s.behaviour_logprobs), generator=gen, dtype=torch.float64)).tolist()
        if stale and i % 2:  # (the others give the rollout mismatch)
            s.versions = [v - 1 for v in s.versions]
    seen = {"reuse": {}, "forward": {}}  # sequences each no-grad forward received
    for t, name in ((a, "reuse"), (b, "forward")):
        forwards = t.learner.forwards

        def counted(engines, seqs, *args, name=name, forwards=forwards):
            for engine in engines:
                seen[name][engine] = seen[name].get(engine, 0) + len(seqs)
            return forwards(engines, seqs, *args)

        monkeypatch.setattr(t.learner, "forwards", counted)
    monkeypatch.setattr(b.learner, "proximal_reused", lambda *args: set())  # the forward over every sequence
    before = torch.cat([p.detach().flatten() for p in a.model.parameters()]).clone()
    m_reuse, m_forward = a.train_on(copy.deepcopy(samples)), b.train_on(copy.deepcopy(samples))
    first = a.learner.minibatches(samples, 0, 0)[0]
    assert seen["forward"]["proximal_logprobs"] == len(samples)
    assert seen["reuse"].get("proximal_logprobs", 0) == len(samples) - len(first)
    assert seen["reuse"].get("reference_logprobs") == seen["forward"].get("reference_logprobs")
    pa = torch.cat([p.detach().flatten() for p in a.model.parameters()])
    pb = torch.cat([p.detach().flatten() for p in b.model.parameters()])
    assert (pa - before).norm() > 0
    assert (pa - pb).norm() <= 1e-10 * (pa - before).norm()
    keys = [k for k in m_forward if k.startswith(("loss/", "rollout/"))]
    assert "rollout/logp_mismatch_mean" in keys and "loss/behaviour_weight_mean" in keys
    assert m_reuse.keys() == m_forward.keys()
    for k in keys:
        assert m_reuse[k] == pytest.approx(m_forward[k], rel=1e-9, abs=1e-12), k


def test_adamw_kernel_fused_on_a_single_cuda_device_only():
    """Fused AdamW where it is one kernel a step on one device; torch's default elsewhere."""
    from treerl.learner import adamw_fused
    assert adamw_fused("cuda", None) is True and adamw_fused(torch.device("cuda:0"), None) is True
    assert adamw_fused("cpu", None) is None
    assert adamw_fused("cuda", object()) is None  # data parallel: sharded parameters


@pytest.mark.parametrize("saved, ours", [(True, None), (None, True)])
def test_a_checkpoint_does_not_bring_its_adamw_kernel(saved, ours):
    """load_state_dict takes each group's settings from the checkpoint: a checkpoint written
    with another kernel choice (before fused, or single-GPU resumed under data parallelism)
    resumes under this process's choice, with the same moments and step."""
    from treerl.learner import with_our_kernel
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    writer = torch.optim.AdamW(params, lr=1e-2, fused=saved)
    for _ in range(2):
        sum((p ** 2).sum() for p in params).backward()
        writer.step()
        writer.zero_grad()
    state = copy.deepcopy(writer.state_dict())
    reader = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, fused=ours)
    reader.load_state_dict(with_our_kernel(reader, state))
    assert reader.param_groups[0]["fused"] is ours and reader.param_groups[0]["foreach"] is None
    for p, q in zip(writer.param_groups[0]["params"], reader.param_groups[0]["params"]):
        a, b = writer.state[p], reader.state[q]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and float(a["step"]) == float(b["step"]) == 2.0
    sum((p ** 2).sum() for p in reader.param_groups[0]["params"]).backward()
    reader.step()  # the loaded state runs under the new kernel
    assert float(reader.state[reader.param_groups[0]["params"][0]]["step"]) == 3.0
    assert with_our_kernel(reader, {"state": {}, "param_groups": []}) == {"state": {}, "param_groups": []}
