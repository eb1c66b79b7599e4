"""The step's forwards during its rollout on a GPU (treerl.overlap): on a side stream beside the
CUDA-graph decode (``stream``) and between decode steps on the rollout's stream (``inline``),
the proximal / reference logprobs equal the sequential step's: float32 (TF32 off) to
float32 rounding, bf16 autocast within 1.5x the sequential bf16-vs-float32 difference (a group's
own call has other matrix shapes than the batch's, so the kernels may round differently:
bitwise equality is not expected). Skipped without a GPU."""

import pytest
import torch

from helpers.configs import run_config
from treerl.tasks import get_task
from treerl.trainer import Trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL = ("{hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, head_dim: 32, max_position_embeddings: 256}")


def varied_reward(prompt, completion, **fields):
    return sum(ch in "13579" for ch in completion) / max(1, len(completion))


def run_step(how: str, bf16: bool):
    """One step: the learner's forwards (and, at that moment, float32 forwards of the same
    weights without autocast), the samples, the GroupForwards."""
    cfg = run_config(None, "task.kwargs={digits: 3}", f"model.overrides={SMALL}", "train.device=cuda",
                     "rollout.prompts_per_step=6", "rollout.group_size=8", "rollout.max_new_tokens=48",
                     "algorithm.kl_coef=0.1", "algorithm.minibatches=2", "train.eval_problems=8",
                     f"train.autocast_bf16={str(bf16).lower()}", f"rollout.overlap_forwards={how}", layers=None)
    task = get_task("addition", digits=3)
    task.reward = varied_reward
    trainer = Trainer(cfg, task=task)
    got, readies = {}, []
    forwards, group_forwards = trainer.learner.forwards, trainer.learner.group_forwards
    depth = [0]

    def recording(engines, seqs, tree, dtype, ready=None):
        depth[0] += 1
        try:
            out = forwards(engines, seqs, tree, dtype, ready)
        finally:
            depth[0] -= 1
        if not depth[0]:
            got["fields"] = out
            got["float32"] = {n: [t.cpu().double() for t in e.logprobs(tree)] for n, e in engines.items()}
        return out

    trainer.learner.forwards = recording
    trainer.learner.group_forwards = lambda how: readies.append(group_forwards(how)) or readies[-1]
    # the sequential step's proximal forward over every sequence (not only those after the first minibatch)
    trainer.learner.proximal_reused = lambda *args: set()
    trainer.step()
    return got, [s.token_ids for s in trainer.last_samples], readies[0]


@pytest.mark.parametrize("how,priority", [("stream", True), ("stream", False), ("inline", True)])
def test_overlapped_logprobs_equal_the_sequential_ones_float32(how, priority, monkeypatch):
    """(``priority``: the rollout on a high-priority stream beside the forwards' side stream.)"""
    import treerl.overlap

    monkeypatch.setattr(treerl.overlap, "DECODE_PRIORITY", priority)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seq, seq_samples, none = run_step("after", bf16=False)
    got, samples, ready = run_step(how, bf16=False)
    assert none is None and samples == seq_samples
    assert ready.sequences == len(samples) and (ready.stream is not None) == (how == "stream")
    assert ready.gpu_seconds > 0
    for name, want in seq["fields"].items():
        for x, y in zip(got["fields"][name], want):
            assert x.shape == y.shape
            assert (x.double() - y.double()).abs().max() <= 2e-5 * max(1.0, float(y.abs().max())), name


def test_overlapped_logprobs_bf16_within_the_bf16_error():
    seq, seq_samples, _ = run_step("after", bf16=True)
    got, samples, ready = run_step("stream", bf16=True)
    assert samples == seq_samples and ready.sequences == len(samples)
    for name, want in seq["fields"].items():
        fp32 = torch.cat(seq["float32"][name])
        w = torch.cat([t.double() for t in want])
        x = torch.cat([t.double() for t in got["fields"][name]])
        bf16_error = float((w - fp32).abs().max())
        assert bf16_error > 0  # autocast was on
        assert float((x - w).abs().max()) <= 1.5 * bf16_error, name


def test_launching_a_groups_forwards_does_not_synchronise_the_host():
    """``GroupForwards.add`` only queues kernels on the side stream (no host sync: the
    rollout's decode loop goes on at once), and ``take`` then gives the logprobs of a
    sequential forward of the same sequences."""
    import warnings
    from contextlib import nullcontext

    from treerl.engine.tree_engine import TreeEngine
    from treerl.models import build_model
    from treerl.overlap import GroupForwards

    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_model("qwen3", "tiny", dtype=torch.float32, device="cuda", seed=1)
    engine = TreeEngine(model, "auto")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 70)]
    groups = [[p + torch.randint(0, vocab, (int(k),), generator=gen).tolist() for k in (5, 9, 9, 30)] for p in prompts]
    ready = GroupForwards({"x": engine}, nullcontext, torch.device("cuda"))
    ready.add(groups[0])  # warm-up: compilation, the engine's memory model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            ready.add(groups[1])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (torch's own notice on entering the mode, "Synchronization debug mode is a prototype feature...", is not a sync)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
    assert not syncs, syncs
    seqs = [torch.tensor(s) for g in groups for s in g]
    out, missing = ready.take(seqs, ["x"], torch.float64)
    assert missing == []
    want = engine.logprobs(seqs)
    for x, y in zip(out["x"], want):
        assert (x - y.cpu().double()).abs().max() <= 2e-5 * max(1.0, float(y.abs().max()))
