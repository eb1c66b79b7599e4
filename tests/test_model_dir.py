"""A bad ``model.path`` is one clear line naming what is wrong (never a hub traceback):
missing, a file, no config.json, broken config.json, no model_type, an unsupported
architecture (the supported ones are named), no weights, no tokenizer, damaged weights."""

import json

import pytest

from treerl.cli import main
from treerl.model_dir import ModelDirError, check_model_dir
from treerl.models import build_model, load_model

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, vocab_size=40)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    build_model("qwen3", "tiny", dtype="float32", **TINY).save_pretrained(d)
    (d / "tokenizer.json").write_text("{}")
    return d


def _copy(good_dir, tmp_path):
    import shutil

    dst = tmp_path / "model"
    shutil.copytree(good_dir, dst)
    return dst


def _without_config(d):
    (d / "config.json").unlink()


def _broken_config(d):
    (d / "config.json").write_text('{"model_type": "qwen3",')


def _no_model_type(d):
    (d / "config.json").write_text(json.dumps({"hidden_size": 32}))


def _gpt2(d):
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))


def _no_weights(d):
    for f in d.glob("*.safetensors"):
        f.unlink()


def _no_tokenizer(d):
    (d / "tokenizer.json").unlink()


CASES = {
    "missing directory": (None, "does not exist; treerl loads local Hugging Face model directories only"),
    "a file, not a directory": ("file", "is a file, not a directory"),
    "no config.json": (_without_config, "has no config.json"),
    "broken config.json": (_broken_config, "config.json is not valid JSON (line 1"),
    "config.json without model_type": (_no_model_type, "has no model_type; treerl supports qwen3, qwen2, llama"),
    "unsupported architecture": (_gpt2, "GPT2LMHeadModel model (model_type 'gpt2'), which treerl does not support; "
                                        "supported model types: qwen3, qwen2, llama"),
    "no weights": (_no_weights, "has no weights"),
    "no tokenizer": (_no_tokenizer, "has no tokenizer files"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_with_a_bad_model_path_is_one_clear_line(case, good_dir, tmp_path, capsys):
    damage, message = CASES[case]
    if damage is None:
        path = tmp_path / "no" / "such" / "Qwen3-0.6B"
    elif damage == "file":
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"x")
    else:
        path = _copy(good_dir, tmp_path)
        damage(path)
    code = main(["train", f"model.path={path}", f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("treerl train: error: model.path:") and message in err, err
    assert "Repo id" not in err and "Traceback" not in err


def test_a_hub_id_is_refused_as_a_missing_local_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "model.path=Qwen/Qwen3-0.6B"]) == 2
    err = capsys.readouterr().err
    assert "directory 'Qwen/Qwen3-0.6B' does not exist" in err and "local" in err, err


def test_load_model_checks_too_and_names_damaged_weights(good_dir, tmp_path):
    assert load_model(good_dir, dtype="float32").config.model_type == "qwen3"
    with pytest.raises(ModelDirError, match="has no config.json"):
        load_model(tmp_path)
    d = _copy(good_dir, tmp_path)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:20])
    with pytest.raises(ModelDirError, match=r"model directory .* could not be loaded: \w+"):
        load_model(d, dtype="float32")


def test_a_good_directory_passes(good_dir):
    assert check_model_dir(good_dir, tokenizer=True)["model_type"] == "qwen3"
