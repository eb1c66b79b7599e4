"""The built-in agent example: a calculator tool, called through the ``openai`` client's
function calling (``tools=``, the reply's ``tool_calls``).

The problem is an arithmetic expression (:class:`~treerl.tasks.calculator_env.CalculatorTask`).
The model calls the tool ``calc(expression)``; the agent evaluates it and sends the value back
as a tool message (``<result>VALUE</result>``, with the call's ``tool_call_id``); the model then
answers ``<answer>VALUE</answer>``. Reward 1 for a correct answer given after at least one
tool call, else 0.

The tiny model of the example has treerl's character tokenizer (no chat template): the
served policy writes and reads calls in the ``tag`` format (``rollout.tool_call_parser: tag``:
a call is ``<calc>37*48</calc>``), so the conversation's tokens are those of the calculator
environment's expert episodes, and ``sft.steps`` warm up on the same token sequences the agent
later produces. A model with a chat template (Qwen2.5 / Qwen3) would use ``hermes`` and the
same agent. Train it with ``treerl train examples/agent_calculator.yaml``.
"""

from __future__ import annotations

import json
import re

from ..tasks.arith import ExpressionError, evaluate, format_number
from ..tasks.base import Problem
from ..tasks.calculator_env import parse_answer

MAX_TURNS = 3
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "The value of an arithmetic expression (integers, + - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    """The tool: the value of ``expression``, or ``error``."""
    try:
        return format_number(evaluate(expression).value)
    except ExpressionError:
        return "error"


def _run(call) -> str:
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        args = None
    if call.function.name != "calc" or not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return "<result>error</result>"
    return f"<result>{calculator(args['expression'])}</result>"


async def agent(client, problem: Problem) -> float:
    """One episode: at most ``MAX_TURNS`` model calls."""
    messages = [{"role": "user", "content": problem.prompt}]
    called = False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="treerl", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            called = True
            messages += [{"role": "tool", "tool_call_id": c.id, "content": _run(c)} for c in message.tool_calls]
            continue
        m = _ANSWER.search(message.content or "")
        answer = parse_answer(m[1]) if m else None
        return 1.0 if called and answer is not None and answer == evaluate(problem.prompt).value else 0.0
    return 0.0
