"""LoRA adapters (PEFT) through the whole system: every engine mode against the
per-sequence reference (float64, 1e-9: logprobs and every adapter's gradient), greedy
rollout with the merged decode weights against full forwards (before and after the
adapters change), a trainer step that moves only the adapters, checkpoint save/resume,
the merged export, ``treerl serve --lora`` and the ``model.lora`` checks."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.configs import run_config
from helpers.forests import RandomLoss, SMALL_MODE_KW, SMALL_SPEC, shaped_forest
from helpers.models import get_model, tiny_model
from helpers.reference import FLOOR, TOL, assert_grads_close, assert_seq_close, grads_of, reference_step, zero_grads
from helpers.rollout import greedy_reference, random_prompts, sampling
from treerl import TreeEngine
from treerl.config import ConfigError
from treerl.lora import apply_lora, effective_weight, is_peft, merged_model, peft_config
from treerl.models import decoder_of
from treerl.rollout import RolloutEngine
from treerl.trainer import Trainer

SPEC, MODE_KW = SMALL_SPEC, SMALL_MODE_KW


def lora_model(base: torch.nn.Module, gen: torch.Generator, rank: int = 4, targets=None) -> torch.nn.Module:
    """``base`` (a copy) with LoRA adapters whose B is random (PEFT starts B at 0, which
    would make every adapter's effect, and A's gradient, zero)."""
    model = apply_lora(copy.deepcopy(base), {"rank": rank, "alpha": 3 * rank,
                                             **({"target_modules": targets} if targets else {})})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.3 / rank ** 0.5)
    return model


def adapter_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("mode", ["flat", "packed", "dfs", "auto"])
def test_every_mode_equals_the_reference(mode, gen):
    model = lora_model(get_model("qwen3"), gen)
    assert is_peft(model) and type(decoder_of(model)).__name__ == "Qwen3Model"
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen, coupled=True)
    ref_loss, ref_grads, ref_lps, ref_ents = reference_step(model, seqs, loss, entropy=True)
    engine = TreeEngine(model, mode, **MODE_KW[mode])
    assert engine.runner.stack.own_loop  # the LoRA layers run inside treerl's own block loop
    lps, ents = engine.logprobs(seqs, entropy=True)
    assert_seq_close(lps, ref_lps, TOL[torch.float64])
    assert_seq_close(ents, ref_ents, TOL[torch.float64], "entropies")
    zero_grads(model)
    value = engine.forward_backward(seqs, loss, entropy=True)
    assert value == pytest.approx(ref_loss, rel=1e-9, abs=1e-9)
    grads = grads_of(model)
    trainable = adapter_names(model)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)  # the base is frozen
    assert all(grads[n].abs().max() > 0 for n in trainable)  # every adapter gets a gradient
    assert_grads_close({n: grads[n] for n in trainable}, {n: ref_grads[n] for n in trainable},
                       TOL[torch.float64], FLOOR[torch.float64])
    zero_grads(model)


def test_block_recompute_runs_the_adapters(gen):
    """A memory budget small enough that calls recompute their blocks in the backward,
    with adapters on some projections only (a layer's K/V then depend on no trained weight)."""
    from treerl.engine.memory import MemoryModel

    # 16 layers: recomputing blocks holds far fewer bytes per token than not (test_engine_memory)
    model = lora_model(get_model("qwen3", num_hidden_layers=16), gen, targets=["q_proj", "v_proj", "down_proj"])
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen)
    _, ref_grads, ref_lps, _ = reference_step(model, seqs, loss)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    budget = int(m.fixed + 6 * m.per_token + 36 * m.per_pair) + 1  # calls over 6 tokens recompute their blocks
    engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4)
    stats = _check_adapter_grads(engine, model, seqs, loss, ref_grads, ref_lps, TOL[torch.float64])
    assert stats.recomputed_calls >= 1, stats


@pytest.mark.slow
def test_compiled_blocks_run_the_adapters(gen):
    """CPU ``torch.compile`` of the blocks, the adapters' layers inside the compiled graph."""
    model = lora_model(get_model("qwen3"), gen)
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen)
    _, ref_grads, ref_lps, _ = reference_step(model, seqs, loss)
    engine = TreeEngine(model, "packed", max_tokens=64, compile=True)
    assert engine.runner.stack.compile
    # inductor's fused float64 kernels round differently (the rollout engine's docstring: ~1e-8)
    _check_adapter_grads(engine, model, seqs, loss, ref_grads, ref_lps, 1e-8)


def _check_adapter_grads(engine, model, seqs, loss, ref_grads, ref_lps, tol):
    trainable = adapter_names(model)
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    stats = engine.stats
    grads = grads_of(model)
    assert_grads_close({n: grads[n] for n in trainable}, {n: ref_grads[n] for n in trainable}, tol, FLOOR[torch.float64])
    assert_seq_close(engine.logprobs(seqs), ref_lps, tol)
    zero_grads(model)
    return stats


def test_effective_weight_is_the_merged_weight(gen):
    model = lora_model(get_model("qwen3"), gen)
    merged = merged_model(model)
    assert not is_peft(merged)
    q = decoder_of(model).layers[1].self_attn.q_proj
    assert torch.allclose(effective_weight(q), merged.model.layers[1].self_attn.q_proj.weight, rtol=0, atol=1e-14)
    assert not torch.equal(effective_weight(q), q.base_layer.weight)  # the adapter really changes it
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    assert torch.allclose(model(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-12)
    # written in place into rows of a larger tensor (the decode blocks' fused copies)
    room = torch.full((q.out_features + 3, q.in_features), float("nan"), dtype=torch.float64)
    out = effective_weight(q, out=room[3:])
    assert out.data_ptr() == room[3:].data_ptr() and torch.isnan(room[:3]).all()
    assert torch.allclose(room[3:], merged.model.layers[1].self_attn.q_proj.weight, rtol=0, atol=1e-14)
    plain = merged.model.layers[1].self_attn.q_proj
    assert effective_weight(plain) is plain.weight
    assert torch.equal(effective_weight(plain, out=torch.empty_like(plain.weight)), plain.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adapters_are_kept_in_the_model_dtype(tmp_path, dtype):
    """A bf16 model trains bf16 adapters (PEFT would upcast them to float32, and every
    adapter product would run in float32 on an input cast to float32), fresh or loaded."""
    from treerl.lora import load_adapter
    from treerl.models import build_model

    model = apply_lora(build_model("qwen3", "tiny", dtype=dtype), {"rank": 4})
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {dtype}
    model.save_pretrained(tmp_path)
    loaded = load_adapter(build_model("qwen3", "tiny", dtype=dtype), tmp_path, trainable=True)
    assert {p.dtype for n, p in loaded.named_parameters() if "lora_" in n} == {dtype}


def test_a_decode_step_runs_no_adapter_product(gen):
    """The decode and prefill blocks use the merged copies only: no PEFT LoRA layer runs in
    a decode step or a prefill (the model's Hugging Face forward runs them: the hooks see
    it)."""
    model = lora_model(tiny_model(dtype=torch.float64, seed=3), gen)
    engine = RolloutEngine(model, max_batch_tokens=4096)
    calls = {"decode": 0, "other": 0}
    where = ["other"]

    def count(module, args):
        calls[where[0]] += 1

    hooks = [m.register_forward_pre_hook(count) for m in model.modules() if hasattr(m, "base_layer")]
    decode = engine.decode_blocks

    class Counting:
        def __getattr__(self, name):
            return getattr(decode, name)

        def __call__(self, *args, **kwargs):
            where[0] = "decode"
            try:
                return decode(*args, **kwargs)
            finally:
                where[0] = "other"

    engine.decode_blocks = Counting()
    try:
        engine.generate(random_prompts([5, 9], seed=4), sampling(6, n=2))
        assert engine.stats.decode_steps > 0 and engine.stats.prefill_calls > 0
        assert calls == {"decode": 0, "other": 0}
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        assert calls["other"] > 0
    finally:
        for h in hooks:
            h.remove()


def test_rollout_greedy_equals_full_forwards_before_and_after_an_update(gen):
    """The decode blocks run merged copies of the adapted weights: greedy output equals a
    per-prompt full forward of the PEFT model, and still does after the adapters change
    and ``update_weights`` (the trainer's path after each optimizer step) refreshes them."""
    base = tiny_model(dtype=torch.float64, seed=3)
    model = lora_model(base, gen, rank=8)
    engine = RolloutEngine(model, max_batch_tokens=4096)
    assert engine.decode_blocks is not None and all(w is not None for w in engine.decode_blocks.fused.o_w)  # merged copies
    prompts = random_prompts([5, 9, 3], seed=4)
    params = sampling(16, n=1)
    for step in range(2):
        groups = engine.generate(prompts, params)
        for prompt, group in zip(prompts, groups):
            assert group.completions[0].completion_ids.tolist() == greedy_reference(model, prompt, 16)
        with torch.no_grad():  # an "optimizer step" on the adapters only
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        engine.update_weights(model)
    # the outputs depend on the adapters (else the check above proves nothing)
    plain = RolloutEngine(tiny_model(dtype=torch.float64, seed=3), max_batch_tokens=4096).generate(prompts, params)
    assert any(a.completions[0].completion_ids.tolist() != b.completions[0].completion_ids.tolist()
               for a, b in zip(plain, groups))


# ----------------------------------------------------------------- trainer level
PLAIN = ("rollout.prompts_per_step=2", "rollout.group_size=4")  # run_config(out, *PLAIN, ..., layers=2)
RUN = (*PLAIN, "train.eval_problems=4", "model.lora={rank: 4, alpha: 8}", "optim.lr=5e-2", "train.steps=3")


def varied_reward(prompt, completion, **fields):
    return sum(ch in "13579" for ch in completion) / max(1, len(completion))


def lora_trainer(cfg) -> Trainer:
    from treerl.tasks import get_task

    task = get_task("addition", digits=2)
    task.reward = varied_reward
    return Trainer(cfg, task=task)


def test_a_trainer_step_changes_only_the_adapters(tmp_path):
    trainer = lora_trainer(run_config(tmp_path, *RUN, layers=2))
    model = trainer.model
    assert is_peft(model)
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    in_optimizer = [p for g in trainer.learner.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optimizer} == adapters  # only adapter weights in the optimizer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.step()
    trainer.step()  # B starts at zero: A's gradient appears after B has moved once
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n, p in model.named_parameters() if "lora_" in n}


def test_checkpoint_saves_the_adapter_and_resumes_exactly(tmp_path):
    cfg = run_config(tmp_path / "run", *RUN, layers=2)
    trainer = lora_trainer(cfg)
    trainer.step()
    trainer.step()
    path = trainer.save()
    assert (path / "model" / "adapter_config.json").is_file()
    assert (path / "model" / "adapter_model.safetensors").is_file()
    assert not (path / "model" / "model.safetensors").exists()  # the adapter only, not the base
    trainer.step()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    resumed = lora_trainer(run_config(tmp_path / "run", *RUN, layers=2))
    resumed.load(path)
    resumed.step()
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, after[n]), n
    # a full-model run cannot resume a LoRA checkpoint (and says why)
    plain = Trainer(run_config(tmp_path / "plain", *PLAIN, layers=2))
    with pytest.raises(ConfigError, match="LoRA adapter"):
        plain.load(path)


def test_merge_export_is_a_plain_hf_model_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from treerl.cli import main

    trainer = lora_trainer(run_config(tmp_path / "run", *RUN, "model.dtype=float64", layers=2))
    trainer.step()
    trainer.step()
    trainer.save()
    out = tmp_path / "merged"
    assert main(["export", "--merge-lora", str(tmp_path / "run"), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float64)
    assert type(merged).__name__ == "Qwen3ForCausalLM" and not is_peft(merged)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-10)
    assert (out / "tokenizer_config.json").is_file() or any(out.glob("*.json"))


def test_eval_of_a_lora_run_loads_the_merged_model(tmp_path, capsys):
    """``treerl eval`` loads a LoRA run's checkpoint as serve and export do (treerl.build.load_saved:
    the base rebuilt from the run's config, its adapter merged) and scores it."""
    from treerl.build import load_saved
    from treerl.cli import main

    trainer = lora_trainer(run_config(tmp_path / "run", *RUN, "model.dtype=float64", layers=2))
    trainer.step()
    path = trainer.save()
    model, tokenizer = load_saved(path / "model", trainer.cfg, checkpoint=path)
    assert not is_peft(model) and tokenizer.get_vocab() == trainer.tokenizer.get_vocab()
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    with torch.no_grad():
        want = merged_model(trainer.model)(input_ids=ids).logits
        assert torch.allclose(model(input_ids=ids).logits, want, rtol=0, atol=1e-10)
    assert main(["eval", str(tmp_path / "run"), "-n", "4"]) == 0
    assert "4 held-out problems: accuracy" in capsys.readouterr().out


def test_export_of_a_full_model_run_is_refused(tmp_path, capsys):
    from treerl.cli import main

    trainer = Trainer(run_config(tmp_path / "plain", *PLAIN, layers=2))
    trainer.save()
    assert main(["export", "--merge-lora", str(tmp_path / "plain"), str(tmp_path / "out")]) == 2
    assert "holds a full model, not a LoRA adapter" in capsys.readouterr().err


def test_serve_loads_a_base_model_plus_an_adapter(tmp_path):
    from treerl.serve.server import load_for_serving

    trainer = lora_trainer(run_config(tmp_path / "run", *RUN, layers=2))
    trainer.step()
    path = trainer.save()
    want = merged_model(trainer.model)
    base_dir = tmp_path / "base"
    trainer.model.get_base_model()  # the base, adapters in place: save a plain copy of it
    copy.deepcopy(trainer.model).unload().save_pretrained(base_dir)
    trainer.tokenizer.save_pretrained(base_dir)
    model, tokenizer, version = load_for_serving(None, [], str(base_dir), "cpu", "float32", lora=str(path / "model"))
    assert not is_peft(model)  # merged once at load
    ids = torch.tensor([[2, 7, 1, 8, 2, 8]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, want(input_ids=ids).logits, atol=1e-5)
    # --weights of a LoRA run's checkpoint: the base rebuilt from its config, plus its adapter
    model, _, version = load_for_serving(None, [], str(path), "cpu", None)
    assert version == trainer.sampler.rollout.version
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, want(input_ids=ids).logits, atol=1e-5)
    with pytest.raises(ConfigError, match="not a LoRA adapter directory"):
        load_for_serving(None, [], str(base_dir), "cpu", None, lora=str(base_dir))


@pytest.mark.parametrize("settings, message", [
    ({"rank": 0}, "model.lora.rank must be a whole number >= 1"),
    ({"rank": 2.5}, "model.lora.rank must be a whole number >= 1"),
    ({"alpha": -1}, "model.lora.alpha must be a positive number"),
    ({"dropout": 0.1}, "model.lora.dropout must be 0"),
    ({"target_modules": []}, "model.lora.target_modules must be a non-empty list"),
    ({"ranks": 4}, "model.lora.ranks: unknown key"),
])
def test_bad_lora_settings_are_one_clear_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        peft_config(settings)


def test_unknown_target_modules_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        Trainer(run_config(tmp_path, *RUN, "model.lora={rank: 4, target_modules: [no_such_proj]}", layers=2))
