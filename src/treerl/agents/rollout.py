"""The trainer's agent rollout: run ``async def agent(client, problem) -> reward`` episodes
against a served policy, record their calls, and return training sequences.

Backends (``rollout.backend``):

- ``embedded`` (default): the trainer's own :class:`~treerl.rollout.RolloutEngine` behind
  treerl serve's app, called in process (an ASGI transport: no socket, same API);
- ``serve``: the same app on a loopback port (``treerl serve`` inside the trainer; agents
  talk HTTP to it);
- ``remote``: any OpenAI-compatible server at ``rollout.server_url`` (``treerl serve``;
  vLLM / SGLang untested). After each optimizer step the trainer writes its weights under
  ``OUT/weights_for_server/`` and, before the next rollout, asks the server to load them
  (``POST /update_weights_from_disk``): the server must read the trainer's file system
  (under its ``--weights-root``).

API keys: a ``remote`` server started with ``--api-key`` is called with the key in the
environment variable ``TREERL_API_KEY`` (not a config key: configs are saved into run
directories and checkpoints); the ``serve`` backend's loopback server gets a random key of
its own, which only this process knows.

Each episode gets its own ``openai.AsyncOpenAI`` client whose transport records its calls
(:mod:`treerl.agents.record`). All episodes of a step run concurrently on one event loop,
so their calls join one continuous batch. An episode whose agent raises, returns a bad
reward or runs past ``task.agent_timeout_s`` is reported on stderr and dropped from the
step (metrics ``agent/failed_episodes``, ``agent/timeouts``); the step goes on with the
others (if every episode fails, the step fails with the first error).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..config import ConfigError, RolloutConfig, TaskConfig
from ..tasks.base import Problem, Task, _short
from ..tasks.env import ChatFormat
from .episode import EpisodeReward, as_reward, episode_sequences, exact_turn_share
from ..serve.client import IN_PROCESS_URL, asgi_transport, http_module
from ..serve.security import API_KEY_ENV
from .record import EpisodeLog, recording_transport

BACKENDS = ("embedded", "serve", "remote")
Agent = Callable[[Any, Problem], Awaitable[Any]]


class AgentError(RuntimeError):
    """Every episode of a step failed."""


def load_agent(spec: str) -> Agent:
    """``module:function`` -> the function (an ``async def``)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"task.agent: expected module:function (e.g. treerl.agents.calculator:agent), got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ConfigError(f"task.agent: cannot import {module!r} ({err})") from None
    except AttributeError:
        raise ConfigError(f"task.agent: module {module!r} has no {name!r}") from None
    if not asyncio.iscoroutinefunction(fn) and not asyncio.iscoroutinefunction(getattr(fn, "__call__", None)):
        raise ConfigError(f"task.agent: {spec} must be an async function: async def {name}(client, problem) -> reward")
    return fn


class TaskAgent:
    """A single-turn task as an agent (``rollout.backend=remote`` without ``task.agent``): a
    token-id completion of the task's prompt, scored by the task's reward."""

    def __init__(self, task: Task, tokenizer: Any):
        self.task, self.tokenizer = task, tokenizer
        self.format = ChatFormat.for_tokenizer(tokenizer)

    async def __call__(self, client: Any, problem: Problem) -> float:
        prompt = self.format.prompt_ids(self.tokenizer, problem.prompt)
        r = await client.completions.create(model="treerl", prompt=prompt, stop=list(self.task.stop) or None)
        ids = r.choices[0].model_extra["token_ids"]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.task.reward(problem.prompt, text, **problem.reward_fields())


@dataclass
class EpisodeResult:
    problem: Problem
    group: int
    log: EpisodeLog = field(default_factory=EpisodeLog)
    reward: EpisodeReward | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class AgentRollout:
    """Episodes of ``task_cfg.agent`` (or :class:`TaskAgent`) through ``rollout.backend``.
    ``engine``: the trainer's rollout engine (served by the embedded and serve backends; its
    ``version`` is the policy's); ``model``: the policy (remote: its weights are pushed, written
    under ``weights_root``). (``async.enabled=true`` is refused by the config's validation.)"""

    def __init__(self, rollout: RolloutConfig, task_cfg: TaskConfig, engine: Any, tokenizer: Any, task: Task,
                 max_new_tokens: int, model: Any = None, *, weights_root: str | Path = "weights_for_server"):
        from ..distributed.data_parallel import launched

        r = rollout
        if launched():
            raise ConfigError("task.agent and rollout.backend=serve/remote run in one synchronous process: "
                              "they do not work under torchrun yet")
        if r.backend not in BACKENDS:
            raise ConfigError(f"rollout.backend: unknown {r.backend!r}; choose one of {', '.join(BACKENDS)}")
        if task_cfg.agent:
            self.agent = load_agent(task_cfg.agent)
        elif task.max_turns > 1:
            raise ConfigError(f"rollout.backend={r.backend} with the multi-turn task {task.name!r} needs an agent: "
                              f"set task.agent=module:function")
        else:
            self.agent = TaskAgent(task, tokenizer)
        if task_cfg.agent_timeout_s <= 0:
            raise ConfigError("task.agent_timeout_s must be > 0")
        self.timeout_s = task_cfg.agent_timeout_s
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.backend, self.model_name = r.backend, r.server_model
        self.defaults = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_tokens": max_new_tokens}
        self.state = self.server = None
        self.weights_root = Path(weights_root)
        self.api_key: str | None = None  # sent as 'Authorization: Bearer KEY' (remote: TREERL_API_KEY)
        self._pushed_version: int | None = None
        self.failures: list[EpisodeResult] = []  # of the last generate call
        self._metrics: dict[str, float] = {}
        if r.tool_call_parser is not None:
            if r.backend == "remote":
                raise ConfigError("rollout.tool_call_parser is a setting of the served policy: with rollout.backend="
                                  "remote start the server with --tool-call-parser and leave it unset")
            from ..serve.tools import get_tool_format

            try:
                get_tool_format(r.tool_call_parser)
            except ValueError as err:
                raise ConfigError(f"rollout.tool_call_parser: {err}") from None
        if r.backend == "remote":
            if not r.server_url:
                raise ConfigError("rollout.backend=remote needs rollout.server_url (e.g. http://127.0.0.1:8000/v1)")
            self.base_url = r.server_url.rstrip("/")
            self.api_key = os.environ.get(API_KEY_ENV) or None
        else:
            from ..rollout import PrefixCache
            from ..serve import ServeOptions, ServerThread, make_state
            from ..serve.security import new_api_key

            if engine.prefix_cache is None:  # an agent's next turn extends its previous prompt
                engine.prefix_cache = PrefixCache(1 << 16)
            self.state = make_state(engine, tokenizer, ServeOptions(model_name=self.model_name,
                                                                    default_max_tokens=max_new_tokens,
                                                                    tool_call_parser=r.tool_call_parser))
            if r.backend == "serve":
                self.api_key = new_api_key()
                self.server = ServerThread(self.state, api_key=self.api_key).start()
                self.base_url = self.server.url
            else:
                self.base_url = IN_PROCESS_URL
        # the server thread and engine loop stop when this object goes (or with close())
        self._finalizer = weakref.finalize(self, _shutdown, self.server, self.state)

    # ----------------------------------------------------------------- weights
    def push_weights(self, model: Any, version: int) -> None:
        """Remote backend: write the weights and have the server load them (once per
        version; called before a rollout)."""
        if self.backend != "remote" or self._pushed_version == version:
            return
        from ..serve.weights import save_weights

        path = save_weights(model, self.weights_root, version)
        http = http_module()
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        with http.Client(timeout=600, headers=self._auth_headers()) as client:
            resp = client.post(f"{root}/update_weights_from_disk",
                               json={"model_path": str(path.resolve()), "version": version})
        if resp.status_code != 200:
            raise RuntimeError(f"the rollout server at {root} did not load the weights {path}: "
                               f"HTTP {resp.status_code} {resp.text[:300]}")
        self._pushed_version = version

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ----------------------------------------------------------------- rollout
    def generate(self, problems: list[Problem], n: int, greedy: bool = False) -> list[dict]:
        """``n`` episodes per problem; returns the fields of the trainer's samples (group =
        problem index, episode = index among the episodes kept). ``greedy`` (evaluation):
        temperature 0 is forced, and a failed or empty episode is kept as one untrainable
        placeholder with its reward (0 when failed), so that it counts."""
        t0 = time.perf_counter()
        if self.model is not None:
            self.push_weights(self.model, self.engine.version)
        results = asyncio.run(self._run_all(problems, n, greedy))
        if self.state is not None:
            self.state.loop.drain()  # no stream may run on the shared model while it trains
        failed = [r for r in results if r.error is not None]
        self.failures = failed
        for r in failed[:3]:
            err = r.error
            print(f"treerl: agent episode on problem {_short(r.problem.prompt)} failed after {r.seconds:.1f} s "
                  f"({type(err).__name__}: {err}); dropped from this step", file=sys.stderr)
        if len(failed) > 3:
            print(f"treerl: ... and {len(failed) - 3} more failed agent episodes", file=sys.stderr)
        if failed and len(failed) == len(results) and not greedy:
            err = failed[0].error
            raise AgentError(f"every agent episode of the step failed; the first: {type(err).__name__}: {err}\n"
                             + "".join(traceback.format_exception(err))) from err
        out: list[dict] = []
        episode = 0
        for r in results:
            seqs = [] if r.error is not None else episode_sequences(r.log.calls, r.reward)
            if not seqs and not greedy:
                continue
            if not seqs:  # evaluation only: counts the episode's reward, never trained
                reward = 0.0 if r.reward is None else r.reward.total
                seqs = [dict(token_ids=[0, 0], loss_mask=[False], behaviour_logprobs=[0.0], versions=[0],
                             reward=reward, call=0, choice=0)]
            whole = None if r.reward is None else r.reward.total + sum(r.reward.turns.values())
            for s in seqs:
                out.append(dict(token_ids=s["token_ids"], loss_mask=s["loss_mask"],
                                behaviour_logprobs=s["behaviour_logprobs"], versions=s["versions"],
                                reward=whole if greedy and whole is not None else s["reward"], group=r.group, episode=episode,
                                completion=f"call {s['call']} choice {s['choice']}"))
            episode += 1
        self._metrics = {
            "agent/episodes": float(len(results)), "agent/failed_episodes": float(len(failed)),
            "agent/timeouts": float(sum(isinstance(r.error, TimeoutError) for r in failed)),
            "agent/calls": float(sum(len(r.log.calls) for r in results)),
            "agent/exact_turn_share": _mean([exact_turn_share(r.log.calls) for r in results]),
            "agent/rollout_s": time.perf_counter() - t0,
        }
        return out

    def pop_metrics(self) -> dict[str, float]:
        """The last training rollout's metrics (once)."""
        out, self._metrics = self._metrics, {}
        return out

    async def _run_all(self, problems: list[Problem], n: int, greedy: bool) -> list[EpisodeResult]:
        import openai

        http = http_module()
        if self.backend == "embedded":
            inner = asgi_transport(self.state)
        else:
            inner = http.AsyncHTTPTransport()
        force = {"temperature": 0.0} if greedy else {}
        results = [EpisodeResult(p, g) for g, p in enumerate(problems) for _ in range(n)]

        async def one(r: EpisodeResult) -> None:
            transport = recording_transport(inner, r.log, model=self.model_name, defaults=self.defaults,
                                            force=force, standard_logprobs=self.backend == "remote",
                                            default_version=self._pushed_version or 0)
            client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=2,
                                        http_client=http.AsyncClient(transport=transport, timeout=self.timeout_s))
            t = time.perf_counter()
            try:
                r.reward = as_reward(await asyncio.wait_for(self.agent(client, r.problem), self.timeout_s))
            except asyncio.TimeoutError:
                r.error = TimeoutError(f"the agent ran past task.agent_timeout_s={self.timeout_s:g} s")
            except Exception as err:  # noqa: BLE001 - reported and counted, the step goes on
                r.error = err
            r.seconds = time.perf_counter() - t

        try:
            await asyncio.gather(*(one(r) for r in results))
        finally:
            await inner.aclose()
        return results

    def close(self) -> None:
        self._finalizer()


def _mean(shares: list[float | None]) -> float:
    """Mean over the episodes that have continuations (1.0 when none has)."""
    known = [s for s in shares if s is not None]
    return sum(known) / len(known) if known else 1.0


def _shutdown(server: Any, state: Any) -> None:
    if server is not None:
        server.stop()
    elif state is not None:
        state.loop.stop()
