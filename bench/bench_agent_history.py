"""Tree ratio of a tool-calling agent with and without token-exact histories (CPU, seconds).

A tiny Qwen3 with a byte-level BPE tokenizer and a ChatML template that renders tools (the
test setup of ``tests/helpers/chat.py``) is served by ``treerl serve``'s app with the ``hermes``
tool-call parser, once with token-exact histories (``history_tokens`` > 0) and once without
(0). ``--episodes`` agents, one problem each (no sharing between episodes), run ``--turns``
calls each through the ``openai`` client (in process): every reply's tool calls are answered
with a tool message, a reply without one with a user message. Each call's prompt +
completion is a training sequence; the episode's sequences form one prefix tree. Reported per
model and setting: flat tokens, unique tree tokens, their ratio, the share of later calls
whose prompt extends an earlier call's prompt + completion (``exact_turn_share``), and the
server's history counters.

Models: ``tool-call`` — weights that make every turn emit the same tool call in a
non-canonical tokenization (the way a sampled BPE model writes text its tokenizer would
encode otherwise; deterministic); ``random`` — random weights sampled at temperature 1 (BPE
text that re-tokenizes differently; replies that hold special tokens are rendered otherwise by
the template and cannot be kept, with or without the record).

    PYTHONPATH=src python bench/bench_agent_history.py
    PYTHONPATH=src python bench/bench_agent_history.py --calculator runs/agent_calculator --episodes 32

``--calculator RUN_DIR``: the calculator agent example (character tokenizer, ``tag`` format) on
a trained run instead, ``--group`` sampled episodes per held-out problem, recorded by the
trainer's client: success, tree ratio and exact turns with and without the record.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from helpers.chat import TOOLS, chat_tokenizer, tool_call_model  # noqa: E402

from treerl import PrefixTree  # noqa: E402
from treerl.agents.episode import exact_turn_share  # noqa: E402
from treerl.agents.record import CallRecord, RecordedChoice  # noqa: E402
from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine  # noqa: E402
from treerl.serve import ServeOptions, in_process_client, make_state  # noqa: E402

CITIES = ["Paris", "London", "Berlin", "Rome", "Madrid", "Oslo", "Vienna", "Prague"]


async def episode(client, k: int, turns: int, max_tokens: int, temperature: float) -> list[CallRecord]:
    messages = [{"role": "user", "content": f"What is the weather in {CITIES[k % len(CITIES)]} on day {k}?"}]
    calls = []
    for t in range(turns):
        r = await client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS,
                                                 max_tokens=max_tokens, temperature=temperature)
        c = r.choices[0]
        calls.append(CallRecord(t, r.model_extra["prompt_token_ids"],
                                [RecordedChoice(c.model_extra["token_ids"], c.model_extra["token_logprobs"],
                                                c.model_extra["token_versions"])]))
        messages.append(c.message.model_dump(exclude_none=True))
        if c.message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": tc.id, "content": f"sunny, {20 + t} C"}
                         for tc in c.message.tool_calls]
        else:
            messages.append({"role": "user", "content": "and tomorrow?"})
    return calls


def run(model, tok, args, history_tokens: int, temperature: float) -> dict:
    state = make_state(RolloutEngine(model), tok, ServeOptions(default_max_tokens=args.max_tokens,
                                                               tool_call_parser="hermes",
                                                               history_tokens=history_tokens))

    async def main():
        client = in_process_client(state)
        try:
            return await asyncio.gather(*(episode(client, k, args.turns, args.max_tokens, temperature)
                                          for k in range(args.episodes)))
        finally:
            await client.close()

    torch.manual_seed(args.seed)
    try:
        episodes = asyncio.run(main())
    finally:
        state.loop.stop()
    seqs = [torch.tensor(c.prompt_ids + c.choices[0].token_ids) for calls in episodes for c in calls]
    tree = PrefixTree.from_sequences(seqs)
    shares = [s for s in (exact_turn_share(calls) for calls in episodes) if s is not None]
    return {"flat": tree.num_flat_tokens, "unique": tree.num_tree_tokens,
            "ratio": tree.num_flat_tokens / tree.num_tree_tokens, "exact_turn_share": sum(shares) / len(shares),
            "history": state.chat.stats()["history"], "tool_calls": state.chat.stats()["tool_calls"]}


def calculator(args) -> None:
    """The calculator agent (``treerl.agents.calculator``) on a trained checkpoint, through the
    trainer's recording client, with and without token-exact histories."""
    import openai

    from treerl.agents.calculator import agent
    from treerl.agents.record import EpisodeLog, recording_transport
    from treerl.serve.client import IN_PROCESS_URL, asgi_transport, http_module
    from treerl.serve.server import load_for_serving
    from treerl.tasks import get_task

    model, tok, _ = load_for_serving(None, [], args.calculator, "cpu", None)
    task = get_task("calculator", digits=2)
    import random

    problems = [task.sample(random.Random(10_000 + k)) for k in range(args.episodes)]
    print(f"calculator agent, {args.calculator}: {args.episodes} problems x {args.group} episodes, temperature "
          f"{args.temperature}")
    for label, tokens in (("exact", 1 << 22), ("template", 0)):
        state = make_state(RolloutEngine(model), tok, ServeOptions(default_max_tokens=24, tool_call_parser="tag",
                                                                   history_tokens=tokens))
        http = http_module()

        async def one(problem, log):
            transport = recording_transport(asgi_transport(state), log, model="treerl",
                                            defaults={"temperature": args.temperature, "max_tokens": 24}, force={},
                                            standard_logprobs=False, default_version=0)
            client = openai.AsyncOpenAI(base_url=IN_PROCESS_URL, api_key="x",
                                        http_client=http.AsyncClient(transport=transport))
            try:
                return await agent(client, problem)
            finally:
                await client.close()

        async def all_episodes():
            logs = [EpisodeLog() for _ in range(len(problems) * args.group)]
            rewards = await asyncio.gather(*(one(problems[i // args.group], log) for i, log in enumerate(logs)))
            return logs, rewards

        torch.manual_seed(args.seed)
        try:
            logs, rewards = asyncio.run(all_episodes())
        finally:
            state.loop.stop()
        seqs = [torch.tensor(c.prompt_ids + ch.token_ids) for log in logs for c in log.calls for ch in c.choices]
        tree = PrefixTree.from_sequences(seqs)
        shares = [s for s in (exact_turn_share(log.calls) for log in logs) if s is not None]
        h = state.chat.stats()["history"]
        print(f"{label:10s} success {sum(rewards) / len(rewards):.3f}  flat {tree.num_flat_tokens}  unique "
              f"{tree.num_tree_tokens}  ratio {tree.num_flat_tokens / tree.num_tree_tokens:.2f}  exact turns "
              f"{sum(shares) / max(1, len(shares)):.2f}  server: turns {h['turns']} exact {h['exact']} "
              f"rewritten {h['rewritten']} unknown {h['unknown']}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calculator", metavar="RUN_DIR", help="instead: the calculator agent on this trained run")
    p.add_argument("--group", type=int, default=4, help="--calculator: episodes per problem")
    p.add_argument("--temperature", type=float, default=1.0, help="--calculator: sampling temperature")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.calculator:
        return calculator(args)
    tok = chat_tokenizer()
    models = {"tool-call": (tool_call_model(tok, context=2048), 0.0),
              "random": (build_model("qwen3", "tiny", vocab_size=len(tok), max_position_embeddings=2048,
                                     eos_token_id=tok.eos_token_id, seed=args.seed), 1.0)}
    print(f"{args.episodes} episodes x {args.turns} calls, max_tokens {args.max_tokens}; one tree per batch")
    print(f"{'model':10s} {'histories':10s} {'flat':>7s} {'unique':>7s} {'ratio':>6s} {'exact turns':>11s}  "
          f"server: turns exact rewritten unknown, calls parsed")
    for name, (model, temperature) in models.items():
        for label, tokens in (("exact", 1 << 22), ("template", 0)):
            r = run(model, tok, args, tokens, temperature)
            h = r["history"]
            print(f"{name:10s} {label:10s} {r['flat']:7d} {r['unique']:7d} {r['ratio']:6.2f} "
                  f"{r['exact_turn_share']:11.2f}  {h['turns']:5d} {h['exact']:5d} {h['rewritten']:9d} "
                  f"{h['unknown']:7d}  {r['tool_calls']['calls']:5d}", flush=True)


if __name__ == "__main__":
    main()
