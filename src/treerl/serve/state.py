"""What the HTTP handlers of ``treerl serve`` share (:class:`ServeState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .chat import ChatRenderer
from .limits import ServeLimits
from .loop import EngineLoop
from .metrics import ServeMetrics


@dataclass
class ServeState:
    """What the handlers need. ``load_weights(path, version) -> version`` applies a
    checkpoint (see :func:`treerl.serve.weights.load_weights_into`)."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str = "treerl"
    default_max_tokens: int = 256
    load_weights: Callable[[str, int | None], int] | None = None
    chat: ChatRenderer | None = None  # prompts and replies of /v1/chat/completions (default: no tool parser)
    limits: ServeLimits = field(default_factory=ServeLimits)  # caps per request (security: n, max_tokens, chars)
    metrics: ServeMetrics = field(init=False)

    def __post_init__(self):
        if self.chat is None:
            self.chat = ChatRenderer(self.tokenizer)
        self.metrics = ServeMetrics(lambda: (self.loop.stats, self.loop.engine_stats(), self.engine.version,
                                             self.loop.busy))
        self.metrics.counters_from("chat_tool_calls", "tool-call parsing of chat replies (ToolStats)",
                                   self.chat.tool_stats.snapshot)

    @property
    def engine(self):
        return self.loop.engine
