"""Running the API: :class:`ServerThread` (uvicorn in a background thread on a socket bound
up front, so the port is known and connections queue before the server starts) and
:func:`serve` (the ``treerl serve`` command: build the engine, serve until interrupted)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ConfigError, RolloutConfig
from ..rollout import RolloutEngine, build_rollout_engine
from .app import create_app
from .state import ServeState
from .chat import ChatRenderer
from .hoststats import freeze_startup_objects
from .limits import ServeLimits
from .tools import get_tool_format
from .loop import EngineLoop
from .security import API_KEY_ENV, Guard, exposure_warning, is_loopback
from .weights import default_weights_root, reload_weights


@dataclass
class ServeOptions:
    """Settings of a served engine."""

    model_name: str = "treerl"
    default_max_tokens: int = 256  # when a request sets no max_tokens (capped by the context)
    max_rows: int | None = 256  # rows of the running batch (None: as the K/V budget allows)
    idle_timeout_s: float = 1.0  # a running batch ends after this long without work
    tool_call_parser: str | None = None  # a treerl.serve.tools format (hermes, tag); None: tools refused
    history_tokens: int = 1 << 22  # token-exact histories: produced turns kept, in tokens (0: off)
    limits: ServeLimits = field(default_factory=ServeLimits)  # caps per request (treerl.serve.limits)
    weights_root: str | None = None  # /update_weights_from_disk reads only under it (None: reloads refused)


def make_state(engine: RolloutEngine, tokenizer: Any, options: ServeOptions | None = None) -> ServeState:
    """An :class:`EngineLoop` over ``engine`` and the handlers' state (weights reload
    included: only under ``options.weights_root``, :func:`~treerl.serve.weights.reload_weights`)."""
    o = options or ServeOptions()
    loop = EngineLoop(engine, decode=tokenizer, max_rows=o.max_rows, idle_timeout_s=o.idle_timeout_s)
    chat = ChatRenderer(tokenizer, o.tool_call_parser, o.history_tokens)
    limits = o.limits.resolved(engine.max_positions, tokenizer)
    default_max_tokens = min(o.default_max_tokens, limits.max_tokens or o.default_max_tokens)
    root = None if o.weights_root is None else Path(o.weights_root)
    return ServeState(loop, tokenizer, model_name=o.model_name, default_max_tokens=default_max_tokens, chat=chat,
                      load_weights=lambda path, version: reload_weights(engine, path, version, root), limits=limits)


class ServerThread:
    """``treerl serve``'s app on ``host:port`` (0: an ephemeral port, see :attr:`port`) in a
    daemon thread, behind :class:`~treerl.serve.security.Guard` (``api_key``: every route but
    ``/health`` needs it; the state's limits). Listening beyond loopback without a key prints
    a warning naming who can reach it. ``stop(force=True)`` drops in-flight connections
    (their clients get a connection error) instead of letting them finish."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        import uvicorn

        self.state = state
        self.guard = Guard(create_app(state), api_key=api_key, limits=state.limits)
        self.sock = self._bind(host, port)
        self.sock.listen(1024)
        self.host, self.port = host, self.sock.getsockname()[1]
        if api_key is None and not is_loopback(host):
            print(exposure_warning(host, self.port), file=sys.stderr, flush=True)
        config = uvicorn.Config(self.guard, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="treerl-serve", daemon=True)

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        """A socket bound to ``host:port``; an invalid or busy address is one :class:`ConfigError` line.

        Its protocol is named (``IPPROTO_TCP``, not 0): asyncio turns Nagle's algorithm off
        (``TCP_NODELAY``) only on connections of a socket that says it is TCP. With Nagle on,
        a response's body (written after its headers) waited for the client's delayed ACK of
        the headers on a kept-alive connection: +40 ms per request on Linux loopback."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if not 0 <= int(port) <= 65535:
                raise OverflowError("a port is 0-65535")
            sock.bind((host, port))
        except (OSError, OverflowError) as err:
            sock.close()
            reason = getattr(err, "strerror", None) or str(err)
            raise ConfigError(f"cannot listen on {host}:{port} ({reason}): choose another --port (0: any free "
                              f"port) or --host") from None
        return sock

    @classmethod
    def check_address(cls, host: str, port: int) -> None:
        """Raise :class:`ConfigError` if ``host:port`` cannot be listened on now."""
        cls._bind(host, port).close()

    @property
    def url(self) -> str:
        """The API's base URL (``.../v1``), for ``openai.AsyncOpenAI(base_url=...)``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "ServerThread":
        self.thread.start()
        return self

    def stop(self, force: bool = False, stop_loop: bool = True) -> None:
        self.server.force_exit = force
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        if stop_loop:
            self.state.loop.stop()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def load_for_serving(config_path: str | None, overrides: list[str], weights: str | None,
                     device: str, dtype: str | None, trust: bool = False, lora: str | None = None
                     ) -> tuple[torch.nn.Module, Any, int]:
    """The model, tokenizer and weight version to serve: from a treerl checkpoint / run
    directory or a Hugging Face model directory (``weights``), else built from a config
    (its ``model`` section; random weights unless ``model.path``). ``lora``: a LoRA adapter
    directory (PEFT ``save_pretrained``, e.g. a LoRA run's checkpoint ``model/``) applied to
    that model and merged into it once, at load (a LoRA run's checkpoint as ``weights``
    gets its own adapter the same way, on the base rebuilt from the run's config)."""
    model, tokenizer, version = _load_base_for_serving(config_path, overrides, weights, device, dtype, trust)
    if lora is not None:
        from ..lora import load_adapter

        model = load_adapter(model, lora).merge_and_unload()
    return model, tokenizer, version


def _load_base_for_serving(config_path, overrides, weights, device, dtype, trust: bool
                           ) -> tuple[torch.nn.Module, Any, int]:
    from ..build import build_base, config_tokenizer, load_saved
    from ..checkpoint import META

    cfg = Config.from_yaml(config_path, overrides)
    if weights is None:
        cfg.model.dtype = dtype or cfg.model.dtype
        tokenizer = config_tokenizer(cfg)
        return build_base(cfg.model, tokenizer, cfg.train.seed, device), tokenizer, 0
    from .weights import weights_dir

    model_dir = weights_dir(weights)
    root = model_dir.parent if (model_dir.parent / META).is_file() else None
    version = 0
    if root is not None:  # a treerl checkpoint: its run's config
        from ..checkpoint import load_state

        state = load_state(root, trust=trust)
        cfg = Config.from_dict(state["config"])
        version = int(state.get("version", 0))
    cfg.model.dtype = dtype or cfg.model.dtype
    model, tokenizer = load_saved(model_dir, cfg, checkpoint=root, device=device)
    return model, tokenizer, version


def serve(args) -> int:
    """``treerl serve``: serve until SIGINT/SIGTERM."""
    import signal

    from ..preflight import check_device

    if args.tool_call_parser is not None:
        try:
            get_tool_format(args.tool_call_parser)
        except ValueError as err:
            raise SystemExit(f"treerl serve: --tool-call-parser: {err}") from None
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    check_device(args.device, "--device")
    ServerThread.check_address(args.host, args.port)  # before the model loads: a busy port is one line now
    api_key, limits, root = security_options(args)
    rollout = serving_rollout_config(config, overrides, args)  # before the model loads too
    model, tokenizer, version = load_for_serving(config, overrides, args.weights, args.device, args.dtype,
                                                 trust=args.trust_checkpoint, lora=args.lora)
    engine = build_rollout_engine(rollout, model, version=version)
    options = ServeOptions(model_name=args.model_name, default_max_tokens=args.max_tokens, max_rows=args.max_rows,
                           idle_timeout_s=args.idle_timeout_s,
                           tool_call_parser=args.tool_call_parser, history_tokens=args.history_tokens,
                           limits=limits, weights_root=None if root is None else str(root))
    server = ServerThread(make_state(engine, tokenizer, options), host=args.host, port=args.port, api_key=api_key)
    freeze_startup_objects()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    server.start()
    print(f"treerl serve: listening on {server.url} (model {args.model_name!r}, weight version {version}; "
          f"{'API key required' if api_key else 'no API key'}; reloads from {root or 'nowhere'})",
          file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5) and server.thread.is_alive():
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
    return 0


def serving_rollout_config(config: str | None, overrides: list[str], args) -> RolloutConfig:
    """The served engine's ``rollout`` section: the config's (``rollout.max_batch_tokens``,
    ...), with ``--prefix-cache-tokens`` as ``rollout.prefix_cache_tokens`` (neither set:
    ``rollout.max_batch_tokens``: a running batch's worth of conversations kept between turns) and ``--prefill-chunk-tokens`` as
    ``rollout.prefill_chunk_tokens`` and ``--kv-cache-dtype`` as ``rollout.kv_cache_dtype`` when given (checked as the keys are);
    ``keep_stream_buffers`` off: a server's streams end when idle, their arenas are not kept."""
    cfg = Config.from_yaml(config, overrides)
    if args.prefix_cache_tokens is None and cfg.rollout.prefix_cache_tokens is None:
        # (session 14, 64 agents x 6 turns on an H200: 65,536 tokens evicted whole conversations, 269k prompt
        # tokens computed; 131,072: 135k, +15% tokens/s)
        cfg.rollout.prefix_cache_tokens = cfg.rollout.max_batch_tokens
    for option, key, value in (("--prefix-cache-tokens", "rollout.prefix_cache_tokens", args.prefix_cache_tokens),
                               ("--prefill-chunk-tokens", "rollout.prefill_chunk_tokens", args.prefill_chunk_tokens),
                               ("--kv-cache-dtype", "rollout.kv_cache_dtype", getattr(args, "kv_cache_dtype", None))):
        if value is not None:
            try:
                cfg.set(key, value)
            except ConfigError as err:
                raise ConfigError(f"{option}: {err}") from None
    cfg.rollout.keep_stream_buffers = False
    return cfg.rollout


def security_options(args) -> tuple[str | None, ServeLimits, Path | None]:
    """``treerl serve``'s API key (``--api-key``, else ``TREERL_API_KEY``), limits and weights
    root (``--weights-root``, else :func:`~treerl.serve.weights.default_weights_root`)."""
    from ..config import ConfigError

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise ConfigError(f"the API key is empty (--api-key or {API_KEY_ENV}): give a non-empty key, or none")
    given = {"max_n": ("--max-n", args.max_n), "max_tokens": ("--max-tokens-limit", args.max_tokens_limit),
             "max_body_bytes": ("--max-body-bytes", args.max_body_bytes),
             "max_prompt_chars": ("--max-prompt-chars", args.max_prompt_chars),
             "max_queued": ("--max-queued", args.max_queued)}
    for option, value in given.values():
        if value is not None and value < 1:
            raise ConfigError(f"{option} must be >= 1, got {value}")
    limits = ServeLimits(**{name: value for name, (_, value) in given.items()})
    if args.weights_root is not None:
        root = Path(args.weights_root).resolve()
        if not root.is_dir():
            raise ConfigError(f"--weights-root {args.weights_root}: not a directory")
    else:
        root = default_weights_root(args.weights)
    return api_key, limits, root


__all__ = ["ServerThread", "ServeOptions", "make_state", "serve", "load_for_serving"]
