"""Agent workflows: an `async def agent(client, problem)` written against the `openai`
client is recorded call by call; an episode's calls form one prefix tree; the trainer
trains on it through the embedded, served (loopback) and remote backends; failing and
hanging agents are dropped and counted."""

from __future__ import annotations

import textwrap

import pytest
import torch

from helpers.configs import AGENT_RUN, make_trainer, run_overrides
from treerl import PrefixTree
from treerl.agents import AgentError, EpisodeReward, episode_sequences
from treerl.agents.record import CallRecord, RecordedChoice
from treerl.config import ConfigError



def agent_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:agent"


# --------------------------------------------------------------- episode -> tree
def _call(index, prompt, *completions, version=0):
    return CallRecord(index, list(prompt), [RecordedChoice(list(c), [-0.5] * len(c), [version] * len(c))
                                            for c in completions])


def test_episode_calls_become_one_prefix_tree():
    p0 = [1, 3, 10, 11, 4]
    c0 = [20, 21, 2]
    p1 = p0 + c0 + [5, 30, 4]  # the next turn extends call 0's prompt + completion
    calls = [
        _call(0, p0, c0),
        _call(2, p1 + [3, 31, 4], [40, 2]),  # concurrent with call 1: branches after p1
        _call(1, p1, [22, 2], [23, 24, 2]),  # n = 2: two choices branch
    ]
    seqs = episode_sequences(calls, EpisodeReward(1.0, {1: 0.5, 2: -0.25}))
    assert [(s["call"], s["choice"]) for s in seqs] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    for s in seqs:
        L = len(s["token_ids"])
        assert len(s["loss_mask"]) == len(s["behaviour_logprobs"]) == len(s["versions"]) == L - 1
    # each sequence trains exactly its own completion
    assert seqs[0]["token_ids"] == p0 + c0 and seqs[0]["loss_mask"] == [False] * 4 + [True] * 3
    assert seqs[3]["token_ids"] == p1 + [3, 31, 4, 40, 2] and sum(seqs[3]["loss_mask"]) == 2
    # reward to go along the branch: call 0 carries the whole return; calls 1 and 2 both extend p1
    assert [s["reward"] for s in seqs] == [1.25, 1.25, 1.25, 0.75]
    tree = PrefixTree.from_sequences([torch.tensor(s["token_ids"]) for s in seqs])
    assert tree.num_tree_tokens == len(p1) + 2 + 3 + 5  # p1 once (call 0 inside it), then the branches
    assert tree.num_flat_tokens == sum(len(s["token_ids"]) for s in seqs)
    with pytest.raises(ValueError, match="turn rewards for calls"):
        episode_sequences(calls, EpisodeReward(1.0, {7: 1.0}))


# ----------------------------------------------------------------- training
TREE_AGENT = """
    import asyncio
    async def agent(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        r = await client.chat.completions.create(model="treerl", messages=messages)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "tool", "content": "7"}]
        # concurrent calls branch (one with n = 2 candidate actions)
        await asyncio.gather(client.chat.completions.create(model="treerl", messages=messages, n=2),
                             client.chat.completions.create(model="treerl", messages=messages + [
                                 {"role": "user", "content": "1"}]))
        return float(len(r.choices[0].message.content) % 2)
"""


@pytest.mark.parametrize("backend", ["embedded", "serve"])
def test_agent_episodes_train_as_prefix_trees(tmp_path, monkeypatch, backend):
    spec = agent_module(tmp_path, monkeypatch, f"tree_agent_{backend}", TREE_AGENT)
    trainer = make_trainer(tmp_path, f"task.agent={spec}", f"rollout.backend={backend}")
    try:
        metrics = trainer.step()
        samples = trainer.last_samples
        assert metrics["agent/episodes"] == 4 and metrics["agent/failed_episodes"] == 0
        assert metrics["agent/calls"] == 4 * 3 and len(samples) == 4 * 4 and len({s.episode for s in samples}) == 4
        assert metrics["tree/tree_tokens"] < metrics["tree/flat_tokens"]
        # recorded behaviour logprobs are the policy's (version 0, before the update):
        # an independent tree forward of the weights that sampled them agrees
        assert all(set(s.versions) == {0} for s in samples)
        seqs = [torch.tensor(s.token_ids) for s in samples]
        old = make_trainer(tmp_path, f"task.agent={spec}")  # same seed: the initial weights
        try:
            logprobs = old.engine.logprobs(PrefixTree.from_sequences(seqs))
        finally:
            old.sampler.agents.close()
        for s, lp in zip(samples, logprobs):
            mask = torch.tensor(s.loss_mask)
            assert torch.allclose(lp[mask].double(), torch.tensor(s.behaviour_logprobs).double()[mask], atol=1e-4)
        assert trainer.evaluate(4)["eval/accuracy"] >= 0  # greedy episodes through the same backend
    finally:
        trainer.sampler.agents.close()


FAILING_AGENT = """
    import asyncio, itertools
    counter = itertools.count()
    async def agent(client, problem):
        k = next(counter)
        if k % 4 == 1:
            raise ValueError(f"boom in episode {k}")
        if k % 4 == 2:
            await asyncio.Event().wait()  # hangs
        r = await client.completions.create(model="treerl", prompt=problem.prompt)
        return 0.5 * (k % 2)
"""


def test_agent_that_raises_or_hangs_is_dropped_and_counted(tmp_path, monkeypatch, capsys):
    spec = agent_module(tmp_path, monkeypatch, "failing_agent", FAILING_AGENT)
    trainer = make_trainer(tmp_path, f"task.agent={spec}", "task.agent_timeout_s=1.0", "rollout.group_size=4")
    try:
        metrics = trainer.step()  # 8 episodes: 2 raise, 2 hang past the timeout; the step goes on
        assert metrics["agent/episodes"] == 8 and metrics["agent/failed_episodes"] == 4
        assert metrics["agent/timeouts"] == 2
        assert len({s.episode for s in trainer.last_samples}) == 4
        err = capsys.readouterr().err
        assert "ValueError: boom in episode 1" in err and "TimeoutError" in err and "dropped from this step" in err
        assert trainer.step_count == 1
    finally:
        trainer.sampler.agents.close()


def test_every_episode_failing_fails_the_step_with_the_error(tmp_path, monkeypatch):
    spec = agent_module(tmp_path, monkeypatch, "raising_agent", """
        async def agent(client, problem):
            raise KeyError("no tool named calc")
    """)
    trainer = make_trainer(tmp_path, f"task.agent={spec}")
    try:
        with pytest.raises(AgentError, match="every agent episode of the step failed.*no tool named calc"):
            trainer.step()
    finally:
        trainer.sampler.agents.close()


def test_remote_backend_pushes_the_weights_before_each_rollout(tmp_path):
    from treerl.rollout import RolloutEngine
    from treerl.serve import ServeOptions, ServerThread, make_state
    from treerl.serve.server import load_for_serving

    # the "remote" server: the same architecture with other random weights, another model name
    model, tok, _ = load_for_serving(None, run_overrides(None, *AGENT_RUN, "train.seed=5", task=None, layers=None), None,
                                     "cpu", None)
    engine = RolloutEngine(model)
    server = ServerThread(make_state(engine, tok, ServeOptions(model_name="policy", weights_root=str(tmp_path)))).start()
    trainer = make_trainer(tmp_path, "rollout.backend=remote", f"rollout.server_url={server.url}",
                           "rollout.server_model=policy")
    try:
        trainer.step()  # pushes version 0 (the trainer's initial weights), rolls out, updates
        assert engine.version == 0 and trainer.sampler.rollout.version == 1
        samples = trainer.sampler.generate(trainer.sampler.next_problems(2), 2)  # pushes version 1 first
        assert engine.version == 1
        for (k, a), b in zip(engine.model.state_dict().items(), trainer.model.state_dict().values()):
            assert torch.equal(a, b), k
        assert all(set(s.versions) == {1} for s in samples)
        logprobs = trainer.engine.logprobs(PrefixTree.from_sequences([torch.tensor(s.token_ids) for s in samples]))
        for s, lp in zip(samples, logprobs):
            mask = torch.tensor(s.loss_mask)
            assert torch.allclose(lp[mask].double(), torch.tensor(s.behaviour_logprobs).double()[mask], atol=1e-4)
        assert len(list((tmp_path / "run" / "weights_for_server").glob("v*"))) == 2  # the newest kept
    finally:
        trainer.sampler.agents.close()
        server.stop()


@pytest.mark.parametrize("override, message", [
    ("task.agent=no_such_module_xyz:agent", "task.agent: cannot import 'no_such_module_xyz'"),
    ("task.agent=treerl.agents.calculator", "task.agent: expected module:function"),
    ("task.agent=treerl.agents.calculator:nope", "has no 'nope'"),
    ("task.agent=treerl.agents.calculator:calculator", "must be an async function"),
    ("rollout.backend=grpc", "rollout.backend: unknown 'grpc'"),
    ("rollout.backend=remote", "rollout.backend=remote needs rollout.server_url"),
    ("task.agent_timeout_s=0", "task.agent_timeout_s: 0.0 is not allowed; allowed: > 0"),
    ("rollout.tool_call_parser=nope", "rollout.tool_call_parser: unknown tool-call parser 'nope'"),
    ("rollout.tool_call_parser=tag", "with rollout.backend=remote start the server with --tool-call-parser"),
])
def test_bad_agent_settings_are_one_line_config_errors(tmp_path, override, message):
    extra = ["task.agent=treerl.agents.calculator:agent"] if "timeout" in override or "parser" in override else []
    if override == "rollout.tool_call_parser=tag":
        extra.append("rollout.backend=remote")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_trainer(tmp_path, *extra, override)


def test_run_summary_shows_tree_tokens_and_agent_episodes():
    from treerl.metrics import summary

    rows = [{"step": 1, "tree/flat_tokens": 300, "tree/tree_tokens": 100, "agent/episodes": 8, "agent/failed_episodes": 1},
            {"step": 2, "tree/flat_tokens": 500, "tree/tree_tokens": 100, "agent/episodes": 8, "agent/failed_episodes": 0}]
    text = summary(rows, 3.0)
    assert "flat 800   unique 200   (4.00x)" in text and "agent episodes (training)      16, failed 1" in text


# ------------------------------------------------------------ tool calling
def test_exact_turn_share_counts_calls_that_extend_a_produced_completion():
    from treerl.agents import exact_turn_share

    p0, c0 = [1, 3, 10, 4], [20, 21, 2]
    exact = _call(1, p0 + c0 + [5, 7, 4], [9, 2])
    rewritten = _call(2, p0 + [20, 22, 2, 5, 7, 4], [9, 2])  # the template re-rendered call 0's reply
    assert exact_turn_share([_call(0, p0, c0), exact]) == 1.0
    assert exact_turn_share([_call(0, p0, c0), exact, rewritten]) == 0.5
    assert exact_turn_share([_call(0, p0, c0), _call(1, [1, 3, 11, 4], [2])]) is None  # nothing continues


class ScriptedClient:
    """``client.chat.completions.create`` answering from a script of messages (openai types)."""

    def __init__(self, *replies):
        from types import SimpleNamespace

        self.replies, self.requests = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, **request):
        from openai.types.chat import ChatCompletion

        self.requests.append(request)
        message, finish = self.replies.pop(0)
        return ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "treerl",
                                              "choices": [{"index": 0, "message": message, "finish_reason": finish}]})


def test_calculator_agent_calls_the_tool_and_answers_with_its_result():
    import asyncio

    from treerl.agents.calculator import TOOLS, agent
    from treerl.tasks.base import Problem

    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "12*3+1"}'}}]}
    client = ScriptedClient((call, "tool_calls"), ({"role": "assistant", "content": "<answer>37</answer>"}, "stop"))
    assert asyncio.run(agent(client, Problem("12*3+1", "37"))) == 1.0
    assert all(r["tools"] == TOOLS for r in client.requests)
    history = client.requests[1]["messages"]
    assert history[1]["tool_calls"][0]["function"] == call["tool_calls"][0]["function"]
    assert history[2] == {"role": "tool", "tool_call_id": "call_1", "content": "<result>37</result>"}
    # an answer without a tool call, a wrong answer, a bad call: 0
    no_call = ScriptedClient(({"role": "assistant", "content": "<answer>37</answer>"}, "stop"))
    assert asyncio.run(agent(no_call, Problem("12*3+1", "37"))) == 0.0
    bad = dict(call, tool_calls=[dict(call["tool_calls"][0], function={"name": "calc", "arguments": "{"})])
    client = ScriptedClient((bad, "tool_calls"), ({"role": "assistant", "content": "<answer>36</answer>"}, "stop"))
    assert asyncio.run(agent(client, Problem("12*3+1", "37"))) == 0.0
    assert client.requests[1]["messages"][2]["content"] == "<result>error</result>"


def test_calculator_agent_trains_through_the_served_tool_parser(tmp_path):
    # random weights rarely write a call; the step shows the served policy takes tools= (without
    # rollout.tool_call_parser every request would get a 400 and the step would fail)
    trainer = make_trainer(tmp_path, "task.name=calculator", "task.agent=treerl.agents.calculator:agent",
                           "rollout.tool_call_parser=tag", "rollout.backend=serve")
    try:
        metrics = trainer.step()
        assert metrics["agent/failed_episodes"] == 0 and metrics["agent/calls"] >= 4
        assert 0 <= metrics["agent/exact_turn_share"] <= 1
        stats = trainer.sampler.agents.state.chat.stats()
        assert stats["tool_calls"]["replies"] == metrics["agent/calls"]
    finally:
        trainer.sampler.agents.close()
