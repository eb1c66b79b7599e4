"""The ``treerl serve`` processes of the command-line tests (tests/serve/test_serve.py's checkpoint
server, tests/serve/test_serve_tools.py's Hugging Face model dir with the hermes parser), started
together when the first test of tests/serve/ starts: each spends its first ~9 s importing torch
and treerl and loading its model, which then overlaps the in-process serve tests. Only the
processes whose test was collected are started; each test waits for its own "listening on"
line, drives it and stops it with SIGTERM. Whatever is still running at the end is killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.processes import kill_leftovers

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_TEST = "test_treerl_serve_command_serves_a_checkpoint_until_sigterm"
MODEL_DIR_TEST = "test_treerl_serve_command_parses_tool_calls_of_a_hugging_face_model_dir"


def _serve(weights: Path, *options: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen([sys.executable, "-m", "treerl.cli", "serve", "--weights", str(weights), "--port", "0",
                             *options], stderr=subprocess.PIPE, text=True, env=env)


def _checkpoint_server(tmp_path: Path) -> subprocess.Popen:
    """A checkpoint (version 7, a math_jsonl run's config) of the tiny served model, served as ``ckpt``."""
    from helpers.models import tiny_model
    from helpers.serve import served_config
    from treerl.checkpoint import save_checkpoint
    from treerl.config import Config
    from treerl.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    model = tiny_model(**served_config(tok))
    cfg = Config.from_dict({"task": {"name": "math_jsonl", "kwargs": {"path": "x.jsonl"}}})
    save_checkpoint(tmp_path / "checkpoints", 1, model, tok, {"config": cfg.to_dict(), "version": 7})
    return _serve(tmp_path, "--model-name", "ckpt")


def _model_dir_server(tmp_path: Path) -> subprocess.Popen:
    """The tool-calling tiny Qwen3 of ``helpers.chat`` saved as a Hugging Face model dir, served
    with the hermes parser, histories off and 8 tokens per request."""
    from helpers.chat import chat_tokenizer, tool_call_model

    tok = chat_tokenizer()
    tool_call_model(tok).save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    return _serve(tmp_path, "--tool-call-parser", "hermes", "--history-tokens", "0", "--max-tokens", "8")


@pytest.fixture(scope="session", autouse=True)
def serve_commands(request, tmp_path_factory):
    """{test name: its started ``treerl serve`` Popen} for the collected command-line tests."""
    collected = {item.name for item in request.session.items}
    procs = {}
    try:
        for name, start in ((CHECKPOINT_TEST, _checkpoint_server), (MODEL_DIR_TEST, _model_dir_server)):
            if name in collected:
                procs[name] = start(tmp_path_factory.mktemp("serve-command"))
        yield procs
    finally:
        kill_leftovers(procs.values())
