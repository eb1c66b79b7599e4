"""CharTokenizer: ids, round trips, errors, save/load, coverage of the built-in tasks."""

import json
import random

import pytest

from treerl.tasks import DEFAULT_ALPHABET, SPECIAL_TOKENS, CharTokenizer, get_task


def test_layout_and_special_ids():
    tok = CharTokenizer("abc")
    assert tok.vocab_size == len(SPECIAL_TOKENS) + 3 == len(tok)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.user_token_id,
                tok.assistant_token_id, tok.tool_token_id}) == 6
    assert tok.encode("cab") == [8, 6, 7]
    assert tok.encode("ab", add_special_tokens=True) == [1, 6, 7]
    assert tok.encode("ab", add_eos=True) == [6, 7, 2]
    assert tok.hf_config_kwargs() == {"vocab_size": 9, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    assert tok("ab") == {"input_ids": [6, 7]}


def test_round_trip_random_strings_with_specials():
    tok = CharTokenizer()
    rng = random.Random(0)
    pieces = list(DEFAULT_ALPHABET) + list(SPECIAL_TOKENS) + ["<|", "|>", "<|nope|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.convert_ids_to_tokens(ids) == [tok.decode([i]) for i in ids]


def test_specials_are_single_tokens_and_skippable():
    tok = CharTokenizer("xy<|>")
    ids = tok.encode("<|bos|>x<|eos|>y<|pad|>")
    assert ids == [1, tok.encode("x")[0], 2, tok.encode("y")[0], 0]
    assert tok.decode(ids, skip_special_tokens=True) == "xy"
    # without parsing, the marker is spelled out character by character ('e' is not in the alphabet)
    assert tok.encode("<|>", parse_special=False) == tok.encode("<") + tok.encode("|") + tok.encode(">")
    with pytest.raises(ValueError, match="'e'"):
        tok.encode("<|eos|>", parse_special=False)
    assert tok.batch_decode([[1, 2], [tok.encode("x")[0]]]) == ["<|bos|><|eos|>", "x"]


def test_unknown_character_error_names_it():
    tok = CharTokenizer("0123456789+=")
    with pytest.raises(ValueError, match=r"'é'.*position 3"):
        tok.encode("12+é4")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="twice"):
        CharTokenizer("abca")
    with pytest.raises(ValueError):
        CharTokenizer("")


def test_save_load_round_trip(tmp_path):
    tok = CharTokenizer("0123456789+=<>")
    path = tok.save_pretrained(tmp_path / "ckpt")
    assert CharTokenizer.is_saved_in(tmp_path / "ckpt")
    loaded = CharTokenizer.from_pretrained(tmp_path / "ckpt")
    assert loaded == tok
    text = "<|bos|>12+34=<|eos|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.get_vocab() == tok.get_vocab()
    data = json.loads(open(path).read())
    assert data["alphabet"] == tok.alphabet


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CharTokenizer"):
        CharTokenizer.from_pretrained(tmp_path)
    CharTokenizer("ab").save_pretrained(tmp_path)
    f = tmp_path / "treerl_char_tokenizer.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        CharTokenizer.from_pretrained(tmp_path)
    f.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a CharTokenizer"):
        CharTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["addition", "sorting", "countdown", "calculator"])
def test_task_alphabets_cover_prompts_targets_and_observations(name):
    task = get_task(name)
    tok = task.tokenizer()
    for p in task.train_problems(200) + task.eval_problems(50):
        for text in (p.prompt, task.target(p)):
            assert tok.decode(tok.encode(text)) == text
    if name == "calculator":
        for p in task.train_problems(50):
            env = task.make_env()
            assert env.reset(p) == p.prompt
            for action in task.expert_actions(p):
                tok.encode(action)
                tok.encode(env.step(action)[0])
        for obs in ("<result>-12</result>", "<result>7/2</result>", "<result>error</result>"):
            tok.encode(obs)
