"""treerl.serve: the rollout engine as an OpenAI-compatible HTTP server (``treerl serve``).

- :mod:`~treerl.serve.loop`: :class:`EngineLoop`, one continuous batch fed by many clients;
- :mod:`~treerl.serve.app`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/health``, ``/update_weights_from_disk``), token ids / logprobs / versions in responses;
  its parts: :mod:`~treerl.serve.state` (what the handlers share), :mod:`~treerl.serve.requests`
  (requests checked, turned into prompts and settings, submitted), :mod:`~treerl.serve.choices`
  (completions -> choices and bodies), :mod:`~treerl.serve.streaming` (server-sent events);
- :mod:`~treerl.serve.chat`: chat messages -> prompt ids (the whole conversation to the chat
  template), replies -> assistant messages; :mod:`~treerl.serve.tools`: tool-call formats
  (``--tool-call-parser``); :mod:`~treerl.serve.history`: token-exact histories;
- :mod:`~treerl.serve.server`: :class:`ServerThread` (uvicorn) and the ``treerl serve`` command;
- :mod:`~treerl.serve.weights`: checkpoints in and out of a serving engine (reloads checked);
- :mod:`~treerl.serve.security`: the API key and the HTTP-level limits (:class:`~treerl.serve.security.Guard`);
- :mod:`~treerl.serve.limits`: :class:`~treerl.serve.limits.ServeLimits`, what one request may cost;
- :mod:`~treerl.serve.client`: :func:`in_process_client`, the same API without a socket.

Needs the ``serve`` extra (fastapi, uvicorn); the agent clients need ``openai``.
"""

from .client import in_process_client
from .loop import EngineLoop
from .server import ServeOptions, ServerThread, make_state

__all__ = ["in_process_client", "EngineLoop", "ServeOptions", "ServerThread", "make_state"]
