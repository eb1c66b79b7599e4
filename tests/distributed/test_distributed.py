"""Data parallelism (FSDP2, 2 gloo processes on the CPU): after one step, the gradients of
a globally normalised loss equal the single-process gradients of the same global batch
(float64, <= 1e-9 relative) for every engine mode — although the ranks hold different
trees and so make different numbers of model calls — with the gradient reduce run by FSDP2's
end-of-backward hook (which must be found on this torch) and by the fallback model call."""

import os

import pytest
import torch
import torch.multiprocessing as mp

import treerl
from helpers.gloo import start_worker
from helpers.models import tiny_model
from treerl.devtools.workloads import SCALES, make_workload
from treerl.distributed.data_parallel import leave

MODES = ("flat", "packed", "dfs", "auto")


def batch():
    seqs = [list(map(int, s)) for s in make_workload("agentic", SCALES["tiny"], 60, seed=4)]
    seqs += [list(map(int, s)) for s in make_workload("grpo", SCALES["tiny"], 60, seed=5)]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]
    total = sum(len(s) - 1 for s in seqs)

    def loss_fn(lps, index):  # separable; normalised by the global token count
        return sum((lp * weights[i]).sum() + 0.1 * lp.mean().exp() for lp, i in zip(lps, index.tolist())) / total

    return seqs, loss_fn


MODEL = dict(vocab_size=60, seed=1)  # tiny_model(**MODEL): float64


def engine_for(m, mode):
    return treerl.TreeEngine(m, mode, max_tokens=64 if mode in ("flat", "packed") else 12, chunk_tokens=3)


def shares(seqs, world, skewed):
    """Whole trees per rank (round-robin over roots), or everything on rank 0."""
    tree = treerl.PrefixTree.from_sequences(seqs)
    roots = tree.seq_index[tree.seq_offsets[:-1]].tolist()
    order = {r: k for k, r in enumerate(sorted(set(roots)))}
    return [[i for i, r in enumerate(roots) if (0 if skewed else order[r] % world) == rank] for rank in range(world)]


def worker(rank, world, init_file, out_dir):
    """Both tests' work in one gloo group (its two processes start once): the gradients of
    every mode, then the bucketed weight gather; results on disk."""
    start_worker(rank, world, init_file)
    gradients_part(rank, world, out_dir)
    gather_part(rank, world, out_dir)
    leave()  # results on disk: barrier, destroy, os._exit(0)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """The directory of :func:`worker`'s results (one spawn for the tests of this module)."""
    out = tmp_path_factory.mktemp("gloo")
    mp.spawn(worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return out


def gradients_part(rank, world, out_dir):
    from treerl.distributed import data_parallel
    from treerl.distributed.data_parallel import full_gradients, gradient_step, shard

    fast_reduce = data_parallel._reduce_now
    used_fast = []
    seqs, loss_fn = batch()
    for skewed in (False, True):
        mine = shares(seqs, world, skewed)[rank]
        for mode in MODES + ("auto-reduce-call",):
            # the last: the fallback reduce (a zero-loss model call) instead of FSDP2's hook
            data_parallel._reduce_now = ((lambda engine: False) if mode.endswith("call")
                                         else (lambda engine: used_fast.append(fast_reduce(engine)) or used_fast[-1]))
            engine = engine_for(tiny_model(**MODEL), mode.split("-")[0])
            shard(engine)
            global_index = torch.tensor(mine, dtype=torch.long)
            with gradient_step(engine):
                if mine:
                    engine.forward_backward([seqs[i] for i in mine],
                                            lambda lps, index: loss_fn(lps, global_index[index]), separable=True)
            grads = full_gradients(engine)
            if rank == 0:
                torch.save({n: g.clone() for n, g in grads.items()}, os.path.join(out_dir, f"{mode}-{skewed}.pt"))
    data_parallel._reduce_now = fast_reduce
    assert all(used_fast), "FSDP2's end-of-backward hook was not found: gradient_step fell back to a model call"


def test_two_gloo_ranks_match_one_process(gloo_results):
    seqs, loss_fn = batch()
    ranks = shares(seqs, 2, skewed=False)
    assert ranks[0] and ranks[1]
    reference = tiny_model(**MODEL)
    engine_for(reference, "packed").forward_backward(seqs, loss_fn, separable=True)
    for skewed in (False, True):
        for mode in MODES + ("auto-reduce-call",):
            grads = torch.load(gloo_results / f"{mode}-{skewed}.pt")
            for name, p in reference.named_parameters():
                if p.grad is None:
                    continue
                err = (grads[name] - p.grad).norm() / p.grad.norm()
                assert err <= 1e-9, (mode, skewed, name, float(err))


def gather_part(rank, world, out_dir):
    """Whole weights of a sharded model, bucketed, against one full_tensor per parameter."""
    from treerl.distributed.data_parallel import full_state_dict, shard

    engine = engine_for(tiny_model(dtype=torch.float32, vocab_size=61, seed=2), "packed")
    shard(engine)
    one_by_one = {k: (t.full_tensor() if hasattr(t, "full_tensor") else t) for k, t in engine.model.state_dict().items()}
    for bucket_bytes in (1, 4096, 64 << 20):  # every parameter alone, small ones in buckets, all in one
        got = full_state_dict(engine.model, bucket_bytes=bucket_bytes)
        assert got.keys() == one_by_one.keys()
        for k in got:
            assert got[k].shape == one_by_one[k].shape and torch.equal(got[k], one_by_one[k]), (bucket_bytes, k)
    if rank == 0:
        torch.save(got, os.path.join(out_dir, "whole.pt"))


def test_bucketed_weight_gather_equals_per_parameter_gather(gloo_results):
    whole = torch.load(gloo_results / "whole.pt")
    reference = tiny_model(dtype=torch.float32, vocab_size=61, seed=2).state_dict()
    assert whole.keys() == reference.keys()
    assert all(torch.equal(whole[k], reference[k]) for k in whole)  # 61 embedding rows: an uneven split
