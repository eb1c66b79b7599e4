"""Fixtures and hooks of the treerl CPU test suite; shared helpers live in the ``helpers``
package (models, the per-sequence reference, forests, rollout and chat pieces, configs).

The session seed is random (fresh inputs every run) and printed in the report header; set
``TREERL_TEST_SEED`` to reproduce a run. Hypothesis prints its own reproduction blob.
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.register_assert_rewrite("helpers")  # the helpers' asserts explain their failures as the tests' do
from helpers.seed import SESSION_SEED  # noqa: E402

# Tiny models do not gain from intra-op threads, and with a busy 2-core machine the
# OpenMP threads of 2 torch threads spin against each other (16 ms per small matmul).
torch.set_num_threads(1)


def pytest_report_header(config):
    return f"treerl test seed: TREERL_TEST_SEED={SESSION_SEED}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure report says how to rebuild the same model weights and inputs."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("treerl seed", f"reproduce with TREERL_TEST_SEED={SESSION_SEED}"))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A torch generator with a fresh seed per test (derived from the session seed)."""
    seed = (SESSION_SEED * 1_000_003 + zlib.crc32(request.node.nodeid.encode())) % (2**63)
    print(f"generator seed for {request.node.nodeid}: {seed} (session {SESSION_SEED})")
    return torch.Generator().manual_seed(seed)
