"""Clients of treerl serve's API: the ``openai`` package's HTTP library, and an in-process
``openai.AsyncOpenAI`` that calls the app directly (an ASGI transport: no socket, no port)."""

from __future__ import annotations

import importlib
from typing import Any

IN_PROCESS_URL = "http://treerl.in-process/v1"


def http_module():
    """The HTTP library the installed ``openai`` package is built on (``httpx`` or ``httpx2``)."""
    import openai

    return importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])


def asgi_transport(state: Any):
    """A transport that hands requests to treerl serve's app over ``state`` in process."""
    from .app import create_app

    return http_module().ASGITransport(app=create_app(state))


def in_process_client(state: Any, **kwargs: Any):
    """An ``openai.AsyncOpenAI`` whose requests go to treerl serve's app in this process
    (``state``: :func:`treerl.serve.make_state`); the same API as over HTTP. Use it in the
    event loop that awaits its calls."""
    import openai

    http = http_module()
    return openai.AsyncOpenAI(base_url=IN_PROCESS_URL, api_key="treerl",
                              http_client=http.AsyncClient(transport=asgi_transport(state)), **kwargs)
