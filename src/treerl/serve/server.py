"""Running the API: :class:`ServerThread` (uvicorn in a background thread on a socket bound
up front, so the port is known and connections queue before the server starts) and
:func:`serve` (the ``treerl serve`` command: build the engine, serve until interrupted)."""

from __future__ import annotations

import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import Config, ConfigError
from ..rollout import RolloutEngine
from .app import ServeState, create_app
from .loop import EngineLoop
from .weights import load_weights_into


@dataclass
class ServeOptions:
    """Settings of a served engine."""

    model_name: str = "treerl"
    default_max_tokens: int = 256  # when a request sets no max_tokens (capped by the context)
    max_rows: int | None = 256  # rows of the running batch (None: as the K/V budget allows)
    idle_timeout_s: float = 1.0  # a running batch ends after this long without work
    prefix_cache_tokens: int = 0  # the engine's prefix cache (0: off)


def make_state(engine: RolloutEngine, tokenizer: Any, options: ServeOptions | None = None) -> ServeState:
    """An :class:`EngineLoop` over ``engine`` and the handlers' state (weights reload included)."""
    o = options or ServeOptions()
    loop = EngineLoop(engine, decode=tokenizer, max_rows=o.max_rows, idle_timeout_s=o.idle_timeout_s)
    return ServeState(loop, tokenizer, model_name=o.model_name, default_max_tokens=o.default_max_tokens,
                      load_weights=lambda path, version: load_weights_into(engine, path, version))


class ServerThread:
    """``treerl serve``'s app on ``host:port`` (0: an ephemeral port, see :attr:`port`) in a
    daemon thread. ``stop(force=True)`` drops in-flight connections (their clients get a
    connection error) instead of letting them finish."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.state = state
        self.sock = self._bind(host, port)
        self.sock.listen(1024)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="treerl-serve", daemon=True)

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        """A socket bound to ``host:port``; an invalid or busy address is one :class:`ConfigError` line."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
                     device: str, dtype: str | None) -> tuple[torch.nn.Module, Any, int]:
    """The model, tokenizer and weight version to serve: from a treerl checkpoint / run
    directory or a Hugging Face model directory (``weights``), else built from a config
    (its ``model`` section; random weights unless ``model.path``)."""
    from ..checkpoint import META
    from ..models import build_model, load_model
    from ..tasks import get_task
    from ..tasks.tokenizer import CharTokenizer

    cfg = Config.from_yaml(config_path, overrides)
    if weights is not None:
        from .weights import weights_dir

        model_dir = weights_dir(weights)
        root = model_dir.parent if (model_dir.parent / META).is_file() else None
        if root is not None:
            from ..checkpoint import load_state

            state = load_state(root)
            cfg = Config.from_dict(state["config"])
            version = int(state.get("version", 0))
        else:
            version = 0
        model = load_model(model_dir, dtype=dtype or cfg.model.dtype, device=device)
        tok_dir = root / "tokenizer" if root is not None else model_dir
        if CharTokenizer.is_saved_in(tok_dir):
            tokenizer = CharTokenizer.from_pretrained(tok_dir)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        return model, tokenizer, version
    m = cfg.model
    if m.path:
        from transformers import AutoTokenizer

        return (load_model(m.path, dtype=dtype or m.dtype, device=device),
                AutoTokenizer.from_pretrained(m.path, local_files_only=True), 0)
    task = get_task(cfg.task.name, **cfg.task.kwargs)
    tokenizer = task.tokenizer() if task.alphabet else CharTokenizer()
    extra = dict(tokenizer.hf_config_kwargs(), vocab_size=tokenizer.vocab_size, **m.overrides)
    model = build_model(m.family, m.shape, dtype=dtype or m.dtype, seed=cfg.train.seed, device=device, **extra)
    return model, tokenizer, 0


def serve(args) -> int:
    """``treerl serve``: serve until SIGINT/SIGTERM."""
    import signal

    from ..preflight import check_device

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        config, overrides = None, [config, *overrides]
    check_device(args.device, "--device")
    ServerThread.check_address(args.host, args.port)  # before the model loads: a busy port is one line now
    model, tokenizer, version = load_for_serving(config, overrides, args.weights, args.device, args.dtype)
    rollout = Config.from_yaml(config, overrides).rollout.engine_kwargs()  # rollout.max_batch_tokens, ...
    if args.prefill_chunk_tokens is not None:
        rollout["prefill_chunk_tokens"] = args.prefill_chunk_tokens
    engine = RolloutEngine(model, version=version, prefix_cache_tokens=args.prefix_cache_tokens, **rollout)
    options = ServeOptions(model_name=args.model_name, default_max_tokens=args.max_tokens, max_rows=args.max_rows,
                           prefix_cache_tokens=args.prefix_cache_tokens, idle_timeout_s=args.idle_timeout_s)
    server = ServerThread(make_state(engine, tokenizer, options), host=args.host, port=args.port)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    server.start()
    print(f"treerl serve: listening on {server.url} (model {args.model_name!r}, weight version {version})",
          file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5) and server.thread.is_alive():
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
    return 0


__all__ = ["ServerThread", "ServeOptions", "make_state", "serve", "load_for_serving"]
