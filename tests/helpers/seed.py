"""The session seed: random (fresh inputs every run), printed in the report header and in
every failure; set ``TREERL_TEST_SEED`` to reproduce a run."""

from __future__ import annotations

import os
import random

SESSION_SEED = int(os.environ.get("TREERL_TEST_SEED", random.SystemRandom().randrange(2**31)))
