"""The built-in agent example: a calculator tool, used through the ``openai`` client.

The problem is an arithmetic expression (:class:`~treerl.tasks.calculator_env.CalculatorTask`).
The model must call the tool, ``<calc>EXPR</calc>``; the agent evaluates it and replies
``<result>VALUE</result>`` as a tool message; the model then answers ``<answer>VALUE</answer>``.
Reward 1 for a correct answer given after at least one tool call, else 0.

Its chat layout (treerl serve's role-marker template for the character tokenizer) is the
one the calculator environment's expert episodes use, so ``sft.steps`` warm up on the same
token sequences the agent later produces. Train it with
``treerl train examples/agent_calculator.yaml``.
"""

from __future__ import annotations

import re

from ..tasks.arith import ExpressionError, evaluate, format_number
from ..tasks.base import Problem
from ..tasks.calculator_env import parse_answer

MAX_TURNS = 3
_TAG = re.compile(r"<calc>(.*?)</calc>|<answer>(.*?)</answer>", re.S)


def calculator(expression: str) -> str:
    """The tool: the value of ``expression``, or ``error``."""
    try:
        return format_number(evaluate(expression).value)
    except ExpressionError:
        return "error"


async def agent(client, problem: Problem) -> float:
    """One episode: at most ``MAX_TURNS`` model calls."""
    messages = [{"role": "user", "content": problem.prompt}]
    called = False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="treerl", messages=messages)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        m = _TAG.search(text)
        if m is None:
            return 0.0
        if m[1] is not None:
            called = True
            messages.append({"role": "tool", "tool_call_id": "calc", "content": f"<result>{calculator(m[1])}</result>"})
            continue
        answer = parse_answer(m[2])
        return 1.0 if called and answer is not None and answer == evaluate(problem.prompt).value else 0.0
    return 0.0
