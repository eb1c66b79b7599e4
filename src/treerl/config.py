"""Run configuration: dataclass sections, YAML files and dotted ``key=value`` overrides.

Every key is declared once, beside its field, with its type, range or choices and a short
help (:func:`key`; the rule is the field's ``metadata["rule"]``). The declarations are
checked when a value is set (``Config.set``: an override, a YAML key) and for the whole
config by :meth:`Config.validate` (``from_yaml`` ends with it; the trainer calls it for a
config built in Python), before anything is built: one :class:`ConfigError` line naming
the key, the value and what is allowed. ``treerl train --help`` prints the same
declarations (:func:`describe_sections`). An unknown key is rejected with the closest
valid name. Free-form mappings (``task.kwargs``, ``model.overrides``) take dotted keys
too: ``task.kwargs.path=my.jsonl``. ``Config.from_yaml(path, overrides)``.

The choices of names (advantages, aggregations, engine modes, ...) are literals here, the
lowest layer; ``tests/test_config_validation.py`` checks each equals its module's own list.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem, explained in one line."""


@dataclass(frozen=True)
class Rule:
    """What a key allows besides its type: bounds (``ge``/``gt``/``le``/``lt``), a
    ``multiple_of``, or ``choices``; ``help`` is its one-line description. Numbers must be
    finite; ``None`` is allowed exactly when the type says ``| None``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: int | None = None
    choices: tuple | None = None
    help: str = ""

    def allowed(self) -> str:
        """What is allowed, in words (``> 0``, ``in (0, 1]``, ``one of a, b``)."""
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + low[1:]
        elif high:
            text = ("<= " if high[-1] == "]" else "< ") + high[:-1]
        else:
            text = ""
        if self.multiple_of:
            text = (text + ", " if text else "") + f"a multiple of {self.multiple_of}"
        return text

    def check(self, where: str, value: Any) -> None:
        """Raise :class:`ConfigError` unless ``value`` (already of the key's type) is allowed."""
        if value is None:
            return
        if self.choices is not None:
            if value not in self.choices:
                close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{where}: unknown {value!r}; choose one of {', '.join(map(str, self.choices))}{hint}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        ok = math.isfinite(value)
        ok = ok and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        ok = ok and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        ok = ok and (not self.multiple_of or value % self.multiple_of == 0)
        if not ok:
            allowed = self.allowed() or "a finite number"
            raise ConfigError(f"{where}: {value!r} is not allowed; allowed: {allowed}")


def key(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, help: str = "", **rule: Any) -> Any:
    """A config field with its rule (:class:`Rule`) declared beside it."""
    meta = {"rule": Rule(help=help, **rule)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Choices (one list each; tests/test_config_validation.py checks them against their modules).
FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")  # treerl.models.FAMILIES
SHAPES = ("tiny", "small", "qwen3-0.6b", "qwen3-1.7b", "tiny-moe", "qwen3-30b-a3b")  # treerl.models.SHAPES
DTYPES = ("float32", "float64", "bfloat16", "float16")  # treerl.models.DTYPES
BACKENDS = ("embedded", "serve", "remote")  # treerl.agents.rollout.BACKENDS
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")  # treerl.learner.ADVANTAGES
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo")  # advantages relative to the group: group_size >= 2
RATIOS = ("token", "sequence")  # treerl.rl.losses.RATIO_LEVELS
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # treerl.rl.aggregation
KL_ESTIMATORS = ("k1", "k2", "k3")  # treerl.rl.kl
ENGINE_MODES = ("flat", "packed", "dfs", "auto")  # treerl.engine.plan.MODES
ATTENTIONS = ("auto", "sdpa", "flex")  # auto + treerl.engine.attention.BACKENDS
SCHEDULES = ("cosine", "constant")  # treerl.learner.lr_lambda
TRANSFERS = ("auto", "shared", "files", "nccl", "gloo")  # treerl.async_rl.weights.TRANSFERS
KV_CACHE_DTYPES = ("auto", "fp8")  # treerl.rollout.types.KV_CACHE_DTYPES
PROXIMAL = ("recompute", "loglinear")  # treerl.learner.PROXIMAL
OVERLAP = ("stream", "inline", "after")  # treerl.overlap: where a step's forwards run during its rollout
LAUNCHERS = ("process", "ray")  # treerl.async_rl.runner.make_pool


@dataclass
class ModelConfig:
    path: str | None = key(None, help="a local Hugging Face model directory; else built from family/shape")
    family: str = key("qwen3", choices=FAMILIES, help="model family (built from a shape)")
    shape: str | None = key("tiny", choices=SHAPES, help="named shape (random weights); null: the family's defaults")
    overrides: dict = key(factory=dict, help="HF config fields, e.g. {num_hidden_layers: 2}")
    dtype: str = key("float32", choices=DTYPES, help="parameter dtype")
    lora: dict = key(factory=dict, help="LoRA adapters: rank, alpha, target_modules, dropout (treerl.lora); {}: off")


@dataclass
class TaskConfig:
    name: str = key("addition", help="a registered task (addition, sorting, countdown, calculator, math_jsonl)")
    kwargs: dict = key(factory=dict, help="passed to the task's constructor")
    max_turns: int = key(4, ge=1, help="multi-turn environments: actions per episode")
    max_episode_tokens: int = key(512, ge=1, help="multi-turn environments: tokens per episode")
    agent: str | None = key(None, help="module:function, async def agent(client, problem) -> reward (README, Agents)")
    agent_timeout_s: float = key(120.0, gt=0, help="an agent episode running longer fails (dropped, counted)")


@dataclass
class RolloutConfig:
    prompts_per_step: int = key(16, ge=1, help="prompts (groups) per RL step")
    group_size: int = key(8, ge=1, help="samples per prompt (>= 2 for grpo, dr_grpo, rloo)")
    temperature: float = key(1.0, ge=0, help="sampling temperature (0: greedy)")
    top_p: float = key(1.0, gt=0, le=1, help="nucleus sampling mass")
    top_k: int = key(0, ge=0, help="top-k sampling (0: off)")
    max_new_tokens: int | None = key(None, ge=1, help="tokens per response; null: the task's recommendation")
    branch_every: int = key(0, ge=0, help="tree rollouts: fork a partial response every N tokens (0: off)")
    branch_factor: int = key(2, ge=1, help="tree rollouts: continuations per fork")
    prefix_cache_tokens: int | None = key(None, ge=0, help="K/V of earlier prompts and finished responses kept for "
                                          "prompts that extend them, in tokens; null: multi-turn tasks prompts x "
                                          "group x task.max_episode_tokens, treerl serve max_batch_tokens, else 0")
    max_batch_tokens: int = key(1 << 17, ge=1, help="rollout engine: K/V slots of the running batch")
    kv_block_size: int = key(64, ge=16, multiple_of=16, help="rollout engine: tokens per paged K/V block")
    kv_cache_dtype: str = key("auto", choices=KV_CACHE_DTYPES, help="rollout engine: the running batch's K/V in the "
                              "model's dtype (auto, exact) or float8 (fp8: half the bytes, not exact)")
    prefill_chunk_tokens: int = key(8192, ge=1, help="rollout engine: prompt tokens prefilled in one piece")
    prefill_graph_tokens: int | None = key(None, ge=0, help="rollout engine: a prefill of at most this many (padded) "
                                           "query tokens runs in fixed shapes, as a CUDA graph; null: 2048 on CUDA, "
                                           "0: off")
    cuda_graphs: bool | None = key(None, help="rollout engine: decode in CUDA graphs; null: on CUDA")
    backend: str = key("embedded", choices=BACKENDS, help="embedded (in-process engine), serve (treerl serve "
                       "on loopback) or remote (rollout.server_url)")
    server_url: str | None = key(None, help="remote: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    server_model: str = key("treerl", help="the served model's name (requests' model field)")
    tool_call_parser: str | None = key(None, help="embedded/serve: the served policy's tool-call format "
                                                  "(hermes, llama3_json, tag)")
    keep_stream_buffers: bool = key(True, help="rollout engine: keep the running batch's K/V arena and its CUDA "
                                    "graphs between steps (no re-capture per step; false frees them for training)")
    overlap_forwards: str = key("after", choices=OVERLAP, help="the step's no-grad forwards (proximal, reference, "
                                "critic) of each finished group run while the others decode: stream (on CUDA a "
                                "second stream beside the decode), inline (between decode steps, on the rollout's "
                                "stream), after (the forwards after the rollout); results equal (treerl.overlap)")


@dataclass
class AlgorithmConfig:
    advantage: str = key("grpo", choices=ADVANTAGES, help="advantage estimator")
    normalise_std: bool = key(True, help="grpo: divide by the group's std")
    ratio: str = key("token", choices=RATIOS, help="importance ratio: token (PPO) or sequence (GSPO)")
    eps_low: float = key(0.2, ge=0, lt=1, help="clip below 1 - eps_low")
    eps_high: float = key(0.2, ge=0, help="clip above 1 + eps_high (> eps_low: DAPO clip-higher)")
    dual_clip: float | None = key(None, gt=1, help="dual-clip constant c > 1 (null: off)")
    behaviour_weight_cap: float | None = key(None, gt=0, help="decoupled PPO (AReaL): cap on behaviour weights")
    aggregation: str = key("token-mean", choices=AGGREGATIONS, help="how token losses are averaged")
    norm_constant: float | None = key(None, gt=0, help="Dr.GRPO: constant normaliser (seq-mean-token-sum)")
    kl_coef: float = key(0.0, ge=0, help="KL to a frozen reference model (0: no reference)")
    kl_estimator: str = key("k3", choices=KL_ESTIMATORS, help="KL estimator")
    entropy_coef: float = key(0.0, help="entropy bonus coefficient")
    ppo_epochs: int = key(1, ge=1, help="passes over each batch")
    minibatches: int = key(1, ge=1, help="optimizer steps per pass")
    gamma: float = key(1.0, ge=0, le=1, help="discount (gae, reinforce_pp)")
    lam: float = key(1.0, ge=0, le=1, help="gae lambda")
    value_clip: float | None = key(None, gt=0, help="critic value clip (null: off)")
    critic_lr: float = key(1e-3, ge=0, help="critic learning rate (gae)")
    router_aux_coef: float = key(0.0, ge=0, help="mixture of experts: weight of the router's load-balancing loss (treerl.moe_aux)")


@dataclass
class EngineConfig:
    mode: str = key("auto", choices=ENGINE_MODES, help="tree engine mode")
    memory_budget: float | None = key(None, gt=0, help="activations: fraction of device memory (<= 1) or "
                                      "bytes; null: 0.25")
    max_tokens: int | None = key(None, ge=1, help="advanced: fixed tokens per call instead of the memory budget")
    chunk_tokens: int = key(2048, ge=1, help="tokens per chunk of a long node (dfs)")
    compile: bool | None = key(None, help="compiled decoder blocks; null: on CUDA")
    compile_cache_dir: str | None = key(None, help="where compiled kernels are kept for later runs (torch's "
                                        "compile caches and an artifacts file); null: ~/.cache/treerl/compile, "
                                        "\"\": torch's defaults")
    attention: str = key("auto", choices=ATTENTIONS, help="attention backend (auto: flex on CUDA, else sdpa)")


@dataclass
class OptimConfig:
    lr: float = key(1e-3, ge=0, help="AdamW learning rate (RL)")
    weight_decay: float = key(0.0, ge=0, help="AdamW weight decay")
    beta1: float = key(0.9, ge=0, lt=1, help="AdamW beta1")
    beta2: float = key(0.95, ge=0, lt=1, help="AdamW beta2")
    warmup_steps: int = key(0, ge=0, help="linear warm-up steps")
    schedule: str = key("cosine", choices=SCHEDULES, help="learning-rate schedule after warm-up")
    min_lr_ratio: float = key(0.1, ge=0, le=1, help="cosine: final lr / lr")
    grad_clip: float | None = key(1.0, ge=0, help="clip the global gradient norm (0 or null: off)")
    max_nonfinite_updates: int = key(3, ge=1, help="updates in a row skipped for a non-finite loss or "
                                     "gradient before the run stops")


@dataclass
class SFTConfig:
    steps: int = key(0, ge=0, help="supervised warm-up steps before RL")
    batch_size: int = key(32, ge=1, help="problems per SFT step")
    lr: float = key(3e-3, ge=0, help="SFT learning rate")


@dataclass
class TrainConfig:
    steps: int = key(50, ge=0, help="RL steps")
    seed: int = key(0, ge=0, help="random seed")
    device: str = key("cpu", help="cpu, cuda or cuda:N")
    autocast_bf16: bool = key(False, help="bf16 autocast on CUDA for a float32 model")
    eval_every: int = key(10, ge=0, help="evaluate every N RL steps (0: at the end only)")
    eval_problems: int = key(100, ge=1, help="held-out problems per evaluation")
    out_dir: str = key("runs/default", help="run directory (metrics, rollouts, checkpoints)")
    save_every: int = key(0, ge=0, help="checkpoint every N RL steps (0: only at the end)")
    keep_last: int = key(2, ge=0, help="checkpoints kept (0: all)")
    tensorboard: bool = key(True, help="write TensorBoard logs")
    wandb: bool = key(False, help="log to Weights & Biases")
    progress: bool = key(True, help="progress bar")
    trust_checkpoint: bool = key(False, help="resume: unpickle a trainer state that is not plain data (runs its code)")


@dataclass
class AsyncConfig:
    enabled: bool = key(False, help="asynchronous training with rollout workers")
    max_staleness: int = key(1, ge=0, help="eta: trainer version - oldest token version <= eta (0: synchronous)")
    workers: int = key(1, ge=1, help="rollout worker processes")
    weight_transfer: str = key("auto", choices=TRANSFERS, help="how weights reach the workers")
    worker_timeout_s: float = key(300.0, gt=0, help="no progress for this long: the worker is stuck, restart it")
    prompts_per_unit: int = key(1, ge=1, help="prompt groups per unit of work handed to a worker")
    proximal: str = key("recompute", choices=PROXIMAL, help="recompute (tree forward) or loglinear (AReaL)")
    launcher: str = key("process", choices=LAUNCHERS, help="worker launcher")
    worker_devices: list = key(factory=list, help="e.g. [cuda:1]; default: the trainer's")
    worker_threads: int = key(1, ge=1, help="torch threads per CPU worker")
    linger_ratio: float = key(0.5, ge=0, help="train first if a generation call would take longer than this x")
    max_units_per_call: int | None = key(None, ge=1, help="work units per generation call (null: all ready)")
    heartbeat_s: float = key(0.5, gt=0, help="worker heartbeat period")
    max_restarts: int = key(3, ge=0, help="worker restarts before the run fails")
    start_timeout_s: float = key(600.0, gt=0, help="a worker not ready after this long fails the run")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)

    # ---------------------------------------------------------------- building
    @classmethod
    def from_dict(cls, data: dict | None) -> "Config":
        cfg = cls()
        for key, value in _flatten(data or {}).items():
            cfg.set(key, value)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "Config":
        data: dict = {}
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {path}")
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                raise ConfigError(f"{path}: YAML syntax error{where}: {getattr(exc, 'problem', exc)}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        cfg = cls.from_dict(data)
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
            cfg.set(key.strip(), _parse_scalar(raw))
        cfg.validate()
        return cfg

    def validate(self) -> "Config":
        """Check every key against its declaration (type and rule) and the rules between
        keys; raise :class:`ConfigError` (one line: the key, the value, what is allowed)."""
        for name, section in _sections(self).items():
            for key, hint in _fields(section).items():
                where = f"{name}.{key}"
                value = _coerce(getattr(section, key), hint, where)
                _rule(section, key).check(where, value)
        a, r = self.algorithm, self.rollout
        if a.advantage in GROUP_ADVANTAGES and r.group_size < 2:
            raise ConfigError(f"algorithm.advantage={a.advantage} needs rollout.group_size >= 2 (got "
                              f"{r.group_size}: every advantage would be 0); raise rollout.group_size or use "
                              f"reinforce_pp / gae")
        if self.async_.enabled and (self.task.agent or r.backend != "embedded"):
            raise ConfigError("task.agent and rollout.backend=serve/remote run in one synchronous process: they do "
                              "not work with async.enabled=true yet; set async.enabled=false")
        return self

    def set(self, dotted: str, value: Any) -> None:
        """Set ``section.key`` (type-checked)."""
        section_name, _, key = dotted.partition(".")
        sections = _sections(self)
        if section_name not in sections:
            raise ConfigError(f"unknown config section {section_name!r}{_suggest(section_name, sections)}")
        if not key:
            raise ConfigError(f"{dotted!r}: name a key inside the section, e.g. {section_name}.{next(iter(_fields(sections[section_name])))}")
        section = sections[section_name]
        fields = _fields(section)
        key, _, inner = key.partition(".")
        if key not in fields:
            raise ConfigError(f"unknown key {section_name + '.' + key!r}{_suggest(key, fields, prefix=section_name + '.')}")
        if inner:  # into a free-form mapping: task.kwargs.path=..., model.overrides.num_hidden_layers=2
            setattr(section, key, _set_nested(getattr(section, key), fields[key], f"{section_name}.{key}", inner, value))
            return
        value = _coerce(value, fields[key], dotted)
        _rule(section, key).check(dotted, value)
        setattr(section, key, value)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(sec) for name, sec in _sections(self).items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def describe_sections() -> str:
    """Every key with its type, default, allowed values and help: for ``treerl train --help``
    (from the same declarations :meth:`Config.validate` checks)."""
    lines = []
    for name, sec in _sections(Config()).items():
        lines.append(f"  {name}:")
        for key, hint in _fields(sec).items():
            rule = _rule(sec, key)
            allowed = rule.allowed()
            default = yaml.safe_dump(getattr(sec, key), default_flow_style=True).strip().removesuffix("...").strip()
            head = f"    {name}.{key}: {_type_name(hint)} = {default}"
            if allowed:
                head += f"  [{allowed}]"
            lines.append(head + (f"  {rule.help}" if rule.help else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------ helpers
def _sections(cfg: Config) -> dict[str, Any]:
    # "async" is a Python keyword: the attribute is async_, the YAML section "async".
    return {f.name.rstrip("_"): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _rule(section: Any, key: str) -> Rule:
    return section.__dataclass_fields__[key].metadata.get("rule", _NO_RULE)


_NO_RULE = Rule()


def _type_name(hint: Any) -> str:
    """``int``, ``float or null``, ``mapping``, ... (for the help)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        names = [_type_name(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in typing.get_args(hint) else "")
    hint = typing.get_origin(hint) or hint
    return {bool: "bool", int: "int", float: "float", str: "str", dict: "mapping", list: "list"}.get(hint, str(hint))


def _fields(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def _suggest(name: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f": did you mean '{prefix}{close[0]}'?" if close else f" (valid: {', '.join(options)})"


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if not prefix:  # sections
            if not isinstance(value, dict):
                raise ConfigError(f"section {key!r} must be a mapping of keys, got {value!r}")
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _set_nested(mapping: Any, hint: Any, where: str, inner: str, value: Any) -> dict:
    """A copy of the free-form ``mapping`` (field ``where``) with ``inner`` (dotted) set."""
    if hint is not dict and typing.get_origin(hint) is not dict:
        raise ConfigError(f"{where} is not a mapping, so {where}.{inner} cannot be set; use {where}=VALUE")
    out = dict(mapping or {})
    node, parts = out, inner.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{where}.{'.'.join(parts[:i + 1])} is {child!r}, not a mapping, "
                              f"so {where}.{inner} cannot be set")
        node[part] = child = dict(child)
        node = child
    if not parts[-1]:
        raise ConfigError(f"{where}.{inner}: empty key name")
    node[parts[-1]] = value
    return out


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected a whole number, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return value
