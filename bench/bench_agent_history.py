"""Tree ratio of a tool-calling agent with and without token-exact histories (CPU, seconds).

A tiny Qwen3 with a byte-level BPE tokenizer and a ChatML template that renders tools (the
test setup of ``tests/chat_util.py``) is served by ``treerl serve``'s app with the ``hermes``
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
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from chat_util import TOOLS, chat_tokenizer, tool_call_model  # noqa: E402

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
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
