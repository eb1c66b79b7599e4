"""treerl.agents: train agents written against an OpenAI-style client.

``async def agent(client, problem) -> reward`` (``client``: ``openai.AsyncOpenAI``; ``problem``:
:class:`~treerl.tasks.base.Problem`) runs once per episode; every model call it makes is
recorded (prompt and completion token ids, behaviour logprobs, weight versions) and the
episode becomes one prefix tree of per-call training sequences
(:mod:`~treerl.agents.episode`). Configure with ``task.agent=module:function``; see
:mod:`~treerl.agents.rollout` for the backends and :mod:`~treerl.agents.calculator` for an
example.
"""

from .episode import EpisodeReward, episode_sequences, exact_turn_share
from .record import CallRecord, EpisodeLog, RecordedChoice
from .rollout import AgentError, AgentRollout, load_agent

__all__ = ["AgentRollout", "AgentError", "EpisodeReward", "episode_sequences", "exact_turn_share", "load_agent", "CallRecord",
           "EpisodeLog", "RecordedChoice"]
