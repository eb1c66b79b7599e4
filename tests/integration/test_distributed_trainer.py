"""Data-parallel RL training (FSDP2, 2 gloo processes on the CPU).

(a) One ``Trainer.train_on`` step on a fixed global batch gives the same parameters and
    metrics under 2 ranks as in one process (float64, <= 1e-9 relative to the update):
    GRPO with 2 minibatches and a KL reference (gradient clipping at 1); GSPO with
    seq-mean-token-mean, 2 PPO epochs and gradient clipping that is active; GAE with a
    (sharded) critic and value clipping; REINFORCE++ with KL and an entropy bonus.
(c) A batch that is one chain (the partition leaves a rank with nothing) still works.
(b) ``treerl train`` under torchrun (2 gloo processes): rank 0 writes metrics and a
    checkpoint, and the run resumes from it.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers.configs import run_config
from helpers.gloo import start_worker
from helpers.models import tiny_model
from helpers.processes import kill_leftovers
from treerl.config import Config
from treerl.distributed import ranks
from treerl.distributed.data_parallel import leave
from treerl.tasks import get_task
from treerl.trainer import Sample, Trainer

ROOT = Path(__file__).parents[2]

CONFIGS = {
    "grpo-kl-2mb": ["algorithm.advantage=grpo", "algorithm.minibatches=2", "algorithm.kl_coef=0.1",
                    "optim.grad_clip=1.0"],
    "gspo-seqmean-2ep": ["algorithm.advantage=grpo", "algorithm.ratio=sequence", "algorithm.eps_low=0.0003",
                         "algorithm.eps_high=0.0004", "algorithm.aggregation=seq-mean-token-mean",
                         "algorithm.ppo_epochs=2", "optim.grad_clip=0.01"],
    "gae": ["algorithm.advantage=gae", "algorithm.minibatches=2", "algorithm.value_clip=0.5"],
    "rpp": ["algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01"],
}
CHAIN = "grpo-kl-2mb"  # config of the one-chain batch (c)


def config(name: str) -> Config:
    return run_config(None, "model.dtype=float64", "engine.mode=auto", "engine.max_tokens=24", "engine.chunk_tokens=6",
                      "optim.lr=0.01", "optim.schedule=constant", *CONFIGS[name], task="sorting", layers=None)


def model(cfg: Config):
    tok = get_task(cfg.task.name).tokenizer()
    return tiny_model(seed=1, **tok.hf_config_kwargs())


def samples(vocab: int, chain: bool = False) -> list[Sample]:
    """Groups of completions sharing a prompt (some share a completion prefix), random
    rewards and behaviour logprobs; ``chain``: one sequence and a strict prefix of it."""
    rng = random.Random(3)
    out = []
    groups = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 7))] for _ in range(5)]
    for g, prompt in enumerate(groups):
        stem = [rng.randrange(3, vocab) for _ in range(2)]
        for k in range(3):
            completion = (stem if k < 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
            out.append((prompt, completion, g))
    if chain:
        prompt, completion, _ = out[0]
        out = [(prompt, completion, 0), (prompt, completion[:-2], 0)]
    result = []
    for e, (prompt, completion, g) in enumerate(out):
        n, p = len(prompt) + len(completion), len(prompt)
        result.append(Sample(
            token_ids=prompt + completion, loss_mask=[False] * (p - 1) + [True] * len(completion),
            behaviour_logprobs=[0.0] * (p - 1) + [rng.uniform(-4.0, -2.0) for _ in completion],
            versions=[0] * (n - 1), reward=float(e % 2 if chain else rng.random()), group=g, episode=e))
    return result


def train_once(name: str, chain: bool) -> tuple[Trainer, dict]:
    cfg = config(name)
    trainer = Trainer(cfg, model=model(cfg))
    return trainer, trainer.train_on(samples(trainer.tokenizer.vocab_size, chain))


def worker(rank, world, init_file, out_dir):
    start_worker(rank, world, init_file)
    from treerl.distributed.data_parallel import full_state_dict

    runs = [(name, False) for name in CONFIGS] + [(CHAIN, True)]
    for name, chain in runs:
        trainer, metrics = train_once(name, chain)
        assert trainer.dist is not None and trainer.dist.world_size == world
        share = len(ranks.share(trainer.dist, [torch.tensor(s.token_ids) for s in samples(trainer.tokenizer.vocab_size, chain)]))
        params = full_state_dict(trainer.model)
        if trainer.critic is not None:
            params.update({"critic." + k: v for k, v in full_state_dict(trainer.critic.model).items()})
        rollout = trainer.sampler.rollout.model.state_dict()
        assert all(torch.equal(params[k], rollout[k]) for k in rollout), "rollout copy is not the new policy"
        if rank == 0:
            torch.save({"params": params, "metrics": metrics}, os.path.join(out_dir, f"{name}-{chain}.pt"))
        torch.save(share, os.path.join(out_dir, f"share-{name}-{chain}-{rank}.pt"))
    leave()  # results on disk: barrier, destroy, os._exit(0)


def test_two_ranks_train_on_matches_one_process(tmp_path):
    # the ranks are spawned first and run while this process trains the one-process references
    # (independent: the ranks write only to tmp_path); then the ranks are joined and compared
    ranks_ctx = mp.start_processes(worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False,
                                   start_method="spawn")
    try:
        runs = [(name, False) for name in CONFIGS] + [(CHAIN, True)]
        references = {(name, chain): (model(config(name)).state_dict(), *train_once(name, chain))
                      for name, chain in runs}
        while not ranks_ctx.join():
            pass
    finally:
        for proc in ranks_ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
    for name, chain in runs:
        shares = [torch.load(tmp_path / f"share-{name}-{chain}-{r}.pt") for r in range(2)]
        assert (0 in shares) == chain, (name, shares)  # (c): the chain leaves one rank empty
        got = torch.load(tmp_path / f"{name}-{chain}.pt")
        init, trainer, metrics = references[name, chain]
        params = dict(trainer.model.state_dict())
        if trainer.critic is not None:
            init.update({"critic." + k: v for k, v in init.items()})
            init["critic.value_head.weight"] = torch.zeros_like(trainer.critic.model.value_head.weight)
            init["critic.value_head.bias"] = torch.zeros_like(trainer.critic.model.value_head.bias)
            params.update({"critic." + k: v for k, v in trainer.critic.model.state_dict().items()})
        assert set(params) == set(got["params"])
        if name == "gspo-seqmean-2ep" and not chain:
            assert metrics["loss/grad_norm"] > 0.01  # the clip is active: the global norm matters
        for k, p in params.items():
            update = p - init[k]
            err = (got["params"][k] - p).norm() / max(update.norm(), 1e-300)
            assert update.norm() > 0 or err == 0, (name, k)
            assert err <= 1e-9, (name, chain, k, float(err))
        for k, v in metrics.items():
            if k.startswith(("time/", "perf/")):
                continue
            assert abs(got["metrics"][k] - v) <= 1e-9 * (1 + abs(v)), (name, chain, k, got["metrics"][k], v)


def torchrun_train(out: Path, *overrides: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`treerl train` of a short sorting run under torchrun (2 gloo ranks), writing to ``out``:
    an SFT step, 3 prompts per step (an uneven split), a checkpoint every step; then
    ``overrides``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "treerl.cli", "train", str(ROOT / "examples" / "demo_sorting.yaml"),
            "model.overrides={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
            "num_key_value_heads: 1, head_dim: 16, max_position_embeddings: 64}",
            "sft.steps=1", "sft.batch_size=6", "rollout.prompts_per_step=3", "rollout.group_size=2",
            "train.eval_problems=3", "train.eval_every=0", "train.save_every=1", "train.progress=false",
            "train.tensorboard=false", f"train.out_dir={out}"]
    return subprocess.Popen(base + list(overrides), env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


@pytest.fixture(scope="module", autouse=True)
def first_torchrun(request, tmp_path_factory):
    """The first (2-step) run of :func:`test_torchrun_train_writes_and_resumes`, started with
    this module's first test (it is independent of the others and spends seconds importing and
    waiting on its ranks): (Popen, out, its stderr file); None where that test is not collected."""
    if "test_torchrun_train_writes_and_resumes" not in {item.name for item in request.session.items}:
        yield None
        return
    tmp = tmp_path_factory.mktemp("torchrun")
    with open(tmp / "first.err", "w+") as err:  # a file: a pipe read only at the end could fill
        proc = torchrun_train(tmp / "run", "train.steps=2", stderr=err)
        try:
            yield proc, tmp / "run", err
        finally:
            kill_leftovers([proc])


def test_torchrun_train_writes_and_resumes(first_torchrun):
    """`treerl train` under torchrun (2 gloo ranks): a short sorting run with an SFT step,
    3 prompts per step (an uneven split), a checkpoint every step; then resumed for a step
    with 1 prompt (rank 1 generates nothing)."""
    first, out, first_err = first_torchrun  # torchrun_train(out, "train.steps=2"), started early
    first.wait(timeout=300)
    first_err.seek(0)
    assert first.returncode == 0, first_err.read()[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # eval, SFT, 2 RL steps: each once (rank 0 only)
    assert all(r["tree/sequences"] == 6 for r in rows[2:])  # the global batch: 3 prompts x 2
    assert (out / "checkpoints" / "step-000002").is_dir()
    # resumed with 1 prompt per step: rank 1 rolls out nothing (c) and trains on its share
    second = torchrun_train(out, "train.steps=3", "rollout.prompts_per_step=1", "--resume", str(out))
    try:
        _, second_err = second.communicate(timeout=300)
    finally:
        kill_leftovers([second])
    assert second.returncode == 0, second_err[-4000:]
    assert "resumed from" in second_err and "step 2" in second_err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["version"] == 4
    assert rows[-1]["tree/sequences"] == 2 and "eval/accuracy" in rows[-1]
    assert (out / "checkpoints" / "step-000003").is_dir()
