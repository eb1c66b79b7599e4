"""Every example config parses and runs (shortened to a couple of small steps: 2 SFT steps of
8 sequences, 2 RL steps of 2 prompts)."""

from pathlib import Path

import pytest

from treerl.config import Config
from treerl.run import train

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.stem for p in EXAMPLES}
    assert {"demo_sorting", "math_jsonl", "calculator_multiturn"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(path.parents[1])  # examples name data files relative to the repository
    cfg = Config.from_yaml(path, ["sft.steps=2", "sft.batch_size=8", "train.steps=2", "train.eval_problems=4",
                                  "train.eval_every=0", "rollout.prompts_per_step=2", "train.progress=false",
                                  "train.tensorboard=false", f"train.out_dir={tmp_path}"])
    result = train(cfg)
    assert (tmp_path / "metrics.jsonl").is_file() and result["checkpoint"]
