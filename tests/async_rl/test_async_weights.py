"""Weight transfer: shared memory and safetensors files deliver exactly the published
weights with their version, only when a newer version exists; tied weights travel once;
``auto`` picks the transport that fits the placement; and a worker's weight listener
interrupts an in-flight generation, whose tokens then carry both versions."""

import time

import pytest
import torch
import torch.multiprocessing as mp

from treerl.async_rl.ledger import WorkUnit
from treerl.async_rl.weights import (FilePublisher, SharedMemoryPublisher, choose_transfer, list_weight_files,
                                     model_state)
from treerl.async_rl.worker import RolloutWorker, WorkerSpec, build_worker_sampler
from treerl.rollout import RolloutEngine
from helpers.configs import run_config
from helpers.models import after_each_forward, tiny_model


SMALL = dict(dtype=torch.float32, vocab_size=40, tie_word_embeddings=True)  # tiny_model(seed=..., **SMALL)


def same(state: dict, model: torch.nn.Module) -> bool:
    own = model.state_dict()
    return all(torch.equal(v.to(own[k].device), own[k]) for k, v in state.items())


def publishers(tmp_path, model):
    return [SharedMemoryPublisher(model, 0, mp.get_context("spawn")), FilePublisher(tmp_path / "w", keep=2)]


@pytest.mark.parametrize("kind", ["shared", "files"])
def test_publish_receive_versions(tmp_path, kind):
    a, b = tiny_model(seed=0, **SMALL), tiny_model(seed=1, **SMALL)
    pub = {p.kind: p for p in publishers(tmp_path, a)}[kind]
    pub.publish(a, 0)
    rx = pub.source(0).open(torch.device("cpu"), a)
    version, state = rx.receive(timeout=5)
    assert version == 0 and same(state, a)
    assert "lm_head.weight" not in state  # tied to the embedding: sent once
    assert rx.receive(timeout=0.05) is None  # nothing newer
    pub.publish(b, 7)
    version, state = rx.receive(timeout=5)
    assert version == 7 and same(state, b) and not same(state, a)
    engine = RolloutEngine(tiny_model(seed=2, **SMALL), version=-1)
    assert engine.update_weights(state, version=version) == 7
    assert same(model_state(b), engine.model) and torch.equal(engine.model.lm_head.weight, b.lm_head.weight)


def test_a_worker_killed_while_copying_weights_out_does_not_block_publishing():
    """A worker copies the shared weights out under a lock; killed in the middle (an
    out-of-memory kill as it allocates its copy) it never releases it. With one lock for
    all workers the trainer's next publish then waited forever; now each incarnation has
    its own, and the one of a worker given up on (worker_gone) is dropped."""
    import threading

    a, b = tiny_model(seed=0, **SMALL), tiny_model(seed=1, **SMALL)
    pub = SharedMemoryPublisher(a, 0, mp.get_context("spawn"))
    dead, alive = pub.source(0), pub.source(1)
    assert dead.lock.acquire(timeout=5)  # worker 0 dies inside its copy: the lock stays taken
    pub.worker_gone(0)
    published = threading.Event()
    threading.Thread(target=lambda: (pub.publish(b, 1), published.set()), daemon=True).start()
    assert published.wait(60), "publish waited for the lock of a dead worker"
    version, state = alive.open(torch.device("cpu"), a).receive(timeout=60)
    assert version == 1 and same(state, b)
    restarted = pub.source(0)  # worker 0's next incarnation: a fresh lock, taking part again
    version, state = restarted.open(torch.device("cpu"), a).receive(timeout=60)
    assert version == 1 and same(state, b)


def test_files_are_atomic_and_pruned(tmp_path):
    a = tiny_model(seed=0, **{**SMALL, "tie_word_embeddings": False})
    pub = FilePublisher(tmp_path / "w", keep=2)
    for v in range(5):
        pub.publish(a, v)
    assert [v for v, _ in list_weight_files(tmp_path / "w")] == [3, 4]
    assert not list((tmp_path / "w").glob(".tmp-*"))
    assert "lm_head.weight" in model_state(a)  # untied: both travel


def test_auto_transfer_fits_the_placement():
    assert choose_transfer("auto", "cpu", ["cpu", "cpu"]) == "shared"
    assert choose_transfer("auto", "cuda:0", ["cuda:1"]) == "nccl"
    assert choose_transfer("auto", "cuda:0", ["cuda:0"]) == "files"  # same GPU: no NCCL peer
    assert choose_transfer("auto", "cpu", ["cuda:0"]) == "files"
    assert choose_transfer("auto", "cpu", ["cpu"], launcher="ray") == "files"
    assert choose_transfer("files", "cpu", ["cpu"]) == "files"
    with pytest.raises(ValueError, match="unknown"):
        choose_transfer("carrier-pigeon", "cpu", ["cpu"])
    with pytest.raises(ValueError, match="process launcher"):
        choose_transfer("shared", "cpu", ["cpu"], launcher="ray")


class _Sink(list):
    def put(self, item):
        self.append(item)


def test_weight_update_interrupts_generation_and_tokens_keep_both_versions():
    """A worker (in this process) generates greedily; during its 4th decode step the
    trainer publishes new weights. The listener applies them mid-generation: every
    completion that outlived the update has tokens of version 0 then version 1, and each
    part is exactly what that version's greedy decoding gives."""
    cfg = run_config(None, "rollout.max_new_tokens=12", "rollout.temperature=0", layers=2)
    sampler_a, sampler_b = build_worker_sampler(cfg, "cpu"), build_worker_sampler(cfg, "cpu")
    with torch.no_grad():  # version 1: different weights
        for p in sampler_b.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    pub = SharedMemoryPublisher(sampler_a.model, 0, mp.get_context("spawn"))
    worker = RolloutWorker(WorkerSpec(0, 0, cfg.to_dict(), "cpu", pub.source(0)), _Sink())
    worker._threads[0].start()  # the weight listener only
    try:
        engine = worker.engine
        decode_calls = []

        def hook(query_length):  # at the end of every forward
            if query_length == 1:
                decode_calls.append(1)
                if len(decode_calls) == 4:
                    pub.publish(sampler_b.model, 1)
                    deadline = time.monotonic() + 60  # a condition wait; generous under CPU load
                    while not engine._pending_updates and time.monotonic() < deadline:
                        time.sleep(1e-3)
                    assert engine._pending_updates, "the listener did not pick the new weights up"

        problems = sampler_a.task.train_problems(4, seed=1)
        handle = after_each_forward(worker.sampler.model, hook)
        try:
            result = worker.generate([WorkUnit(0, problems, 2, min_version=0)])
        finally:
            handle.remove()
        samples = result.units[0][2]
        assert result.first_version == 0 and result.last_version == 1 and result.recomputes == 1
        both = [s for s in samples if {0, 1} <= set(s.versions)]
        assert both, "no completion outlived the update"
        for s in samples:
            gen = [v for v, m in zip(s.versions, s.loss_mask) if m]
            cut = gen.count(0)
            assert gen == [0] * cut + [1] * (len(gen) - cut)  # every token keeps its version
            assert cut <= 5  # tokens 0..4 precede the update (sampled from version-0 logits)
            # greedy parts match each version's own greedy decoding
            P = len(s.loss_mask) - len(gen) + 1
            ids = s.token_ids
            for t in range(len(gen)):
                model = sampler_a.model if gen[t] == 0 else sampler_b.model
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids[: P + t]])).logits[0, -1]
                assert int(logits.argmax()) == ids[P + t]
    finally:
        worker.state.stop = True


def test_broadcast_transport_over_gloo(tmp_path):
    """The NCCL code path (two-rank group per worker incarnation, store-announced pushes,
    flat per-dtype buffers) run with Gloo on CPU: a worker gets the weights and version on
    ready, then every publish; a restarted incarnation gets a fresh group."""
    import threading

    from treerl.async_rl.nccl import CollectivePublisher

    a, b, c = tiny_model(seed=0, **SMALL), tiny_model(seed=1, **SMALL), tiny_model(seed=2, **SMALL)
    pub = CollectivePublisher(a, 0, backend="gloo", timeout_s=30)
    got = []

    def worker(source, n):
        rx = source.open(torch.device("cpu"), a)
        for _ in range(n):
            got.append(rx.receive(timeout=20))

    for incarnation, (model, version) in enumerate([(b, 5), (c, 9)]):
        source = pub.source(0)
        t = threading.Thread(target=worker, args=(source, 2))
        t.start()
        pub.worker_ready(0, a, 4 + incarnation)
        pub.publish(model, version)
        t.join(timeout=30)
        assert not t.is_alive()
        (v0, s0), (v1, s1) = got[-2], got[-1]
        assert v0 == 4 + incarnation and v1 == version
        assert same(s1, model) and not same(s1, a)
        pub.worker_gone(0)
