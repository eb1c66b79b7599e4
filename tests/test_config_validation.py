"""The config's one validation layer: every key's type, range or choices declared beside it
(``treerl.config.key``), checked at load before anything is built (one line naming the key,
the value and what is allowed), printed by ``treerl train --help``."""

import dataclasses

import pytest

from treerl.cli import main
from treerl.config import Config, ConfigError


@pytest.mark.parametrize("override,message", [
    ("optim.lr=-0.001", "optim.lr: -0.001 is not allowed; allowed: >= 0"),
    ("sft.lr=-1", "sft.lr: -1.0 is not allowed; allowed: >= 0"),
    ("rollout.temperature=-0.5", "rollout.temperature: -0.5 is not allowed; allowed: >= 0"),
    ("rollout.temperature=.nan", "rollout.temperature: nan is not allowed"),
    ("async.max_staleness=-1", "async.max_staleness: -1 is not allowed; allowed: >= 0"),
    ("rollout.top_p=1.5", "rollout.top_p: 1.5 is not allowed; allowed: in (0, 1]"),
    ("rollout.top_p=0", "rollout.top_p: 0.0 is not allowed; allowed: in (0, 1]"),
    ("rollout.top_k=-1", "rollout.top_k: -1 is not allowed; allowed: >= 0"),
    ("engine.mode=fast", "engine.mode: unknown 'fast'; choose one of flat, packed, dfs, auto"),
    ("engine.attention=xformers", "engine.attention: unknown 'xformers'; choose one of auto, sdpa, flex"),
    ("algorithm.aggregation=mean", "algorithm.aggregation: unknown 'mean'; choose one of token-mean, "
                                   "seq-mean-token-sum, seq-mean-token-mean"),
    ("optim.schedule=linear", "optim.schedule: unknown 'linear'; choose one of cosine, constant"),
    ("algorithm.advantage=ppo2", "algorithm.advantage: unknown 'ppo2'; choose one of grpo, dr_grpo, rloo"),
    ("algorithm.kl_estimator=k4", "algorithm.kl_estimator: unknown 'k4'; choose one of k1, k2, k3"),
    ("algorithm.ratio=seq", "algorithm.ratio: unknown 'seq'; choose one of token, sequence"),
    ("model.dtype=float8", "model.dtype: unknown 'float8'; choose one of float32, float64, bfloat16, float16"),
    ("async.weight_transfer=rdma", "async.weight_transfer: unknown 'rdma'"),
    ("async.proximal=exact", "async.proximal: unknown 'exact'; choose one of recompute, loglinear"),
    ("rollout.backend=vllm", "rollout.backend: unknown 'vllm'; choose one of embedded, serve, remote"),
    ("sft.batch_size=0", "sft.batch_size: 0 is not allowed; allowed: >= 1"),
    ("optim.grad_clip=-1", "optim.grad_clip: -1.0 is not allowed; allowed: >= 0"),
    ("train.steps=-2", "train.steps: -2 is not allowed; allowed: >= 0"),
    ("sft.steps=-1", "sft.steps: -1 is not allowed; allowed: >= 0"),
    ("algorithm.kl_coef=-0.1", "algorithm.kl_coef: -0.1 is not allowed; allowed: >= 0"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens: 0 is not allowed; allowed: >= 1"),
    ("rollout.group_size=0", "rollout.group_size: 0 is not allowed; allowed: >= 1"),
    ("rollout.prompts_per_step=0", "rollout.prompts_per_step: 0 is not allowed; allowed: >= 1"),
    ("algorithm.eps_low=1.5", "algorithm.eps_low: 1.5 is not allowed; allowed: in [0, 1)"),
    ("algorithm.dual_clip=0.5", "algorithm.dual_clip: 0.5 is not allowed; allowed: > 1"),
    ("algorithm.ppo_epochs=0", "algorithm.ppo_epochs: 0 is not allowed; allowed: >= 1"),
    ("algorithm.gamma=1.5", "algorithm.gamma: 1.5 is not allowed; allowed: in [0, 1]"),
    ("optim.beta2=1", "optim.beta2: 1.0 is not allowed; allowed: in [0, 1)"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio: 2.0 is not allowed; allowed: in [0, 1]"),
    ("optim.max_nonfinite_updates=0", "optim.max_nonfinite_updates: 0 is not allowed; allowed: >= 1"),
    ("engine.memory_budget=0", "engine.memory_budget: 0.0 is not allowed; allowed: > 0"),
    ("train.eval_problems=0", "train.eval_problems: 0 is not allowed; allowed: >= 1"),
    ("train.keep_last=-1", "train.keep_last: -1 is not allowed; allowed: >= 0"),
    ("train.seed=-3", "train.seed: -3 is not allowed; allowed: >= 0"),
    ("rollout.kv_block_size=20", "rollout.kv_block_size: 20 is not allowed; allowed: >= 16, a multiple of 16"),
    ("rollout.max_batch_tokens=0", "rollout.max_batch_tokens: 0 is not allowed; allowed: >= 1"),
    ("rollout.prefill_chunk_tokens=-8", "rollout.prefill_chunk_tokens: -8 is not allowed; allowed: >= 1"),
    ("rollout.prefill_graph_tokens=-1", "rollout.prefill_graph_tokens: -1 is not allowed; allowed: >= 0"),
    ("rollout.cuda_graphs=maybe", "rollout.cuda_graphs: expected true or false, got 'maybe'"),
    ("rollout.keep_stream_buffers=sometimes", "rollout.keep_stream_buffers: expected true or false, got 'sometimes'"),
    ("train.trust_checkpoint=perhaps", "train.trust_checkpoint: expected true or false, got 'perhaps'"),
    ("algorithm.router_aux_coef=-0.5", "algorithm.router_aux_coef: -0.5 is not allowed; allowed: >= 0"),
    ("async.workers=0", "async.workers: 0 is not allowed; allowed: >= 1"),
    ("task.agent_timeout_s=0", "task.agent_timeout_s: 0.0 is not allowed; allowed: > 0"),
])
def test_out_of_range_values_are_one_line_naming_key_value_and_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override", ["optim.lr=-1", "engine.mode=fast", "rollout.top_p=2"])
def test_the_cli_refuses_them_with_exit_2_before_building_anything(override, capsys, tmp_path, monkeypatch):
    import treerl.trainer

    monkeypatch.setattr(treerl.trainer.Trainer, "__init__", lambda *a, **k: pytest.fail("built a trainer"))
    assert main(["train", override, f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treerl train: error: ") and len(err.splitlines()) == 1 and override.split("=")[0] in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_with_one_sample_per_group_are_refused(advantage):
    with pytest.raises(ConfigError, match=f"algorithm.advantage={advantage} needs rollout.group_size >= 2"):
        Config.from_yaml(None, [f"algorithm.advantage={advantage}", "rollout.group_size=1"])
    for fine in ("reinforce_pp", "gae"):
        Config.from_yaml(None, [f"algorithm.advantage={fine}", "rollout.group_size=1"])


def test_a_config_built_in_python_is_validated_by_the_trainer():
    from treerl.trainer import Trainer

    cfg = Config()
    cfg.optim.lr = -1.0
    with pytest.raises(ConfigError, match="optim.lr: -1.0 is not allowed"):
        Trainer(cfg)
    cfg = Config()
    cfg.rollout.temperature = "hot"
    with pytest.raises(ConfigError, match="rollout.temperature: expected a number, got 'hot'"):
        cfg.validate()


def test_every_key_declares_a_help_and_the_help_prints_type_default_and_allowed(capsys):
    for section in dataclasses.fields(Config()):
        for f in dataclasses.fields(section.default_factory()):
            assert f.metadata.get("rule") and f.metadata["rule"].help, f"{section.name}.{f.name} has no declaration"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "rollout.top_p: float = 1.0  [in (0, 1]]" in out
    assert "engine.mode: str = auto  [one of flat, packed, dfs, auto]" in out
    assert "rollout.max_new_tokens: int or null = null  [>= 1]" in out
    assert "rollout.max_batch_tokens: int = 131072  [>= 1]" in out
    assert "optim.max_nonfinite_updates: int = 3  [>= 1]" in out


def test_choices_match_the_modules_that_use_them():
    from treerl import config as c
    from treerl.agents.rollout import BACKENDS
    from treerl.async_rl.weights import TRANSFERS
    from treerl.engine.attention import BACKENDS as ATTENTION
    from treerl.learner import lr_lambda
    from treerl.models import DTYPES, FAMILIES, SHAPES
    from treerl.engine.plan import MODES
    from treerl.rl.aggregation import AGGREGATIONS
    from treerl.rl.kl import KL_ESTIMATORS
    from treerl.rl.losses import RATIO_LEVELS
    from treerl.rollout.types import KV_CACHE_DTYPES

    assert c.FAMILIES == tuple(FAMILIES) and c.SHAPES == tuple(SHAPES) and c.DTYPES == tuple(DTYPES)
    assert c.BACKENDS == BACKENDS and c.TRANSFERS == TRANSFERS and c.ATTENTIONS == ("auto", *ATTENTION)
    assert c.ENGINE_MODES == MODES and c.AGGREGATIONS == AGGREGATIONS and c.KL_ESTIMATORS == KL_ESTIMATORS
    assert c.RATIOS == RATIO_LEVELS and c.KV_CACHE_DTYPES == tuple(KV_CACHE_DTYPES)
    assert lr_lambda(50, 0, 100, "constant", 0.1) == 1.0 and lr_lambda(50, 0, 100, "cosine", 0.1) < 1.0


def test_rollout_engine_keys_reach_the_rollout_engine():
    from treerl.trainer import Trainer

    cfg = Config.from_yaml(None, ["model.overrides={num_hidden_layers: 1}", "rollout.max_batch_tokens=4096",
                                  "rollout.kv_block_size=32", "rollout.prefill_chunk_tokens=256", "rollout.kv_cache_dtype=fp8",
                                  "rollout.prefill_graph_tokens=128", "rollout.cuda_graphs=false",
                                  "train.eval_problems=2"])
    engine = Trainer(cfg).sampler.rollout
    assert (engine.max_batch_tokens, engine.kv_block_size, engine.prefill_chunk_tokens) == (4096, 32, 256)
    assert engine.prefill_graph_tokens == 128 and engine.prefill_graphs is not None
    assert str(engine.kv_dtype) == "torch.float8_e4m3fn"


def test_zero_layers_and_other_zero_sizes_in_model_overrides_are_one_line():
    from treerl.preflight import check_run_config

    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        with pytest.raises(ConfigError, match=f"model.overrides.{name}: 0 is not allowed; allowed: a whole number >= 1"):
            check_run_config(Config.from_yaml(None, [f"model.overrides.{name}=0"]))


@pytest.mark.parametrize("agent", ["task.agent=treerl.agents.calculator:agent", "rollout.backend=serve"])
def test_agents_with_asynchronous_training_are_refused_by_the_config(agent):
    with pytest.raises(ConfigError) as err:
        Config.from_yaml(None, [agent, "async.enabled=true"])
    assert str(err.value) == ("task.agent and rollout.backend=serve/remote run in one synchronous process: they do "
                              "not work with async.enabled=true yet; set async.enabled=false")
