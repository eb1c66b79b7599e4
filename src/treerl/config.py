"""Run configuration: dataclass sections, YAML files and dotted ``key=value`` overrides.

Every key is typed and checked: an unknown key is rejected with the closest valid name,
a value of the wrong type with the expected type. Free-form mappings (``task.kwargs``,
``model.overrides``) take dotted keys too: ``task.kwargs.path=my.jsonl``.
``Config.from_yaml(path, overrides)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem, explained in one line."""


@dataclass
class ModelConfig:
    path: str | None = None  # a local Hugging Face model directory; else built from family/shape
    family: str = "qwen3"
    shape: str | None = "tiny"
    overrides: dict = field(default_factory=dict)  # config fields, e.g. {num_hidden_layers: 2}
    dtype: str = "float32"


@dataclass
class TaskConfig:
    name: str = "addition"
    kwargs: dict = field(default_factory=dict)  # passed to the task's constructor
    max_turns: int = 4  # multi-turn environments
    max_episode_tokens: int = 512
    agent: str | None = None  # module:function, async def agent(client, problem) -> reward (README, "Agents")
    agent_timeout_s: float = 120.0  # an agent episode running longer fails (dropped from the step, counted)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None  # None: the task's recommendation
    branch_every: int = 0  # tree rollouts: fork a partial response every N tokens (0: off)
    branch_factor: int = 2
    # K/V of earlier prompts kept for prompts that extend them (the next turn of an episode), in
    # tokens; None: multi-turn tasks prompts_per_step x group_size x task.max_episode_tokens, else 0
    prefix_cache_tokens: int | None = None
    backend: str = "embedded"  # embedded (in-process engine), serve (treerl serve on loopback), remote
    server_url: str | None = None  # remote: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1
    server_model: str = "treerl"  # the served model's name (requests' model field)
    tool_call_parser: str | None = None  # embedded/serve: the served policy's tool-call format (hermes, tag)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # grpo, dr_grpo, rloo, reinforce_pp, gae
    normalise_std: bool = True  # grpo: divide by the group's std
    ratio: str = "token"  # token (PPO) or sequence (GSPO)
    eps_low: float = 0.2
    eps_high: float = 0.2  # > eps_low: DAPO clip-higher
    dual_clip: float | None = None
    behaviour_weight_cap: float | None = None  # decoupled PPO (AReaL)
    aggregation: str = "token-mean"  # token-mean, seq-mean-token-sum, seq-mean-token-mean
    norm_constant: float | None = None  # Dr.GRPO: constant normaliser (seq-mean-token-sum)
    kl_coef: float = 0.0  # KL to a frozen reference model
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    minibatches: int = 1
    gamma: float = 1.0  # gae
    lam: float = 1.0  # gae
    value_clip: float | None = None
    critic_lr: float = 1e-3


@dataclass
class EngineConfig:
    mode: str = "auto"
    memory_budget: float | None = None  # activations: fraction of device memory (<= 1) or bytes; None: 0.2
    max_tokens: int | None = None  # advanced: fixed tokens per call instead of the memory budget
    chunk_tokens: int = 2048
    compile: bool | None = None  # compiled decoder blocks; None: on CUDA
    attention: str = "auto"


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 0
    schedule: str = "cosine"  # cosine or constant
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0


@dataclass
class SFTConfig:
    steps: int = 0  # supervised warm-up steps before RL
    batch_size: int = 32
    lr: float = 3e-3


@dataclass
class TrainConfig:
    steps: int = 50
    seed: int = 0
    device: str = "cpu"
    autocast_bf16: bool = False  # bf16 autocast on CUDA for a float32 model
    eval_every: int = 10
    eval_problems: int = 100
    out_dir: str = "runs/default"
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    tensorboard: bool = True
    wandb: bool = False
    progress: bool = True
    trust_checkpoint: bool = False  # resume: unpickle a trainer state that is not plain data (runs its code)


@dataclass
class AsyncConfig:
    enabled: bool = False
    max_staleness: int = 1  # eta: trainer version - oldest token version <= eta (0: synchronous)
    workers: int = 1  # rollout worker processes
    weight_transfer: str = "auto"  # auto, shared, files, nccl, gloo
    worker_timeout_s: float = 300.0  # no progress for this long: the worker is stuck, restart it
    prompts_per_unit: int = 1  # prompt groups per unit of work handed to a worker
    proximal: str = "recompute"  # recompute (tree forward) or loglinear (AReaL's approximation)
    launcher: str = "process"  # process or ray
    worker_devices: list = field(default_factory=list)  # e.g. [cuda:1]; default: the trainer's
    worker_threads: int = 1  # torch threads per CPU worker
    linger_ratio: float = 0.5
    max_units_per_call: int | None = None
    heartbeat_s: float = 0.5
    max_restarts: int = 3
    start_timeout_s: float = 600.0


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
        return cfg

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
        setattr(section, key, _coerce(value, fields[key], dotted))

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(sec) for name, sec in _sections(self).items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def describe_sections() -> str:
    """One line per section with its keys: for ``treerl train --help``."""
    lines = []
    for name, sec in _sections(Config()).items():
        lines.append(f"  {name}: " + ", ".join(_fields(sec)))
    return "\n".join(lines)


# ------------------------------------------------------------------------ helpers
def _sections(cfg: Config) -> dict[str, Any]:
    # "async" is a Python keyword: the attribute is async_, the YAML section "async".
    return {f.name.rstrip("_"): getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


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
