"""Helpers shared by the test files (``tests/`` is on ``sys.path`` through the rootdir
conftest, so ``from helpers.models import tiny_model``); ``conftest.py`` keeps only fixtures
and hooks. One module per topic:

- :mod:`helpers.seed`: the session seed (random per run; ``TREERL_TEST_SEED`` reproduces it);
- :mod:`helpers.models`: the one tiny-model builder and the cached model variants, forward hooks;
- :mod:`helpers.reference`: the independent per-sequence reference and the comparisons;
- :mod:`helpers.forests`: random forests (hypothesis) and forests of a fixed shape; a random loss;
- :mod:`helpers.engine`: the engine-vs-reference check shared by the engine tests;
- :mod:`helpers.rollout`: prompts, sampling settings and greedy references of the rollout tests;
- :mod:`helpers.chat`: a local chat tokenizer with a tool template and a tool-calling tiny model;
- :mod:`helpers.configs`: the one config builder of tiny training runs.
- :mod:`helpers.pool`: a rollout worker entry point that imports nothing heavy (spawned by the pool tests);
- :mod:`helpers.gloo`: how a spawned gloo worker of the data-parallel tests starts;
- :mod:`helpers.compile_runs`: the compile-cache tests' child processes (started by tests/engine/conftest.py).
"""
