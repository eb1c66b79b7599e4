"""Multi-turn episodes: chained sequences, loss masks on exactly the action tokens, aligned
behaviour logprobs, rewards, limits; the calculator environment."""

import math
import random

import pytest

from treerl.tasks import (
    AdditionTask,
    CalculatorEnv,
    CalculatorTask,
    ChatFormat,
    CharTokenizer,
    Environment,
    EpisodeRunner,
    Problem,
    RewardError,
    SingleTurnEnv,
    run_episode,
    run_episodes,
    scripted_policy,
)

CALC = CalculatorTask()
TOK = CharTokenizer()  # the full printable alphabet: lets scripted policies write free text


def counting_policy(actions, tokenizer, start=-0.5):
    """Scripted actions whose logprobs are distinct per token (start, start-0.01, ...) to check alignment."""
    queue, counter = list(actions), [0]

    def policy(context):
        ids = tokenizer.encode(queue.pop(0)) + [tokenizer.eos_token_id]
        lps = [start - 0.01 * (counter[0] + i) for i in range(len(ids))]
        counter[0] += len(ids)
        return ids, lps

    return policy


def check_chain(ep, action_token_ids, all_logprobs):
    """Every invariant of an episode's sequences, from the policy's outputs alone."""
    seqs = ep.sequences
    for a, b in zip(seqs, seqs[1:]):
        assert len(a.token_ids) < len(b.token_ids) and b.token_ids[: len(a.token_ids)] == a.token_ids
    position = 0
    for k, (s, ids, lps) in enumerate(zip(seqs, action_token_ids, all_logprobs)):
        L = len(s.token_ids)
        assert len(s.loss_mask) == L - 1 and len(s.behaviour_logprobs) == L - 1
        assert s.turn == k and s.token_ids[s.action_start :] == ids
        # mask element t refers to token t + 1: exactly this turn's action tokens
        trained = [t + 1 for t, m in enumerate(s.loss_mask) if m]
        assert trained == list(range(L - len(ids), L))
        assert [s.behaviour_logprobs[t - 1] for t in trained] == lps
        assert s.reward == ep.reward
        position = L
    # full_sequence marks every action once, logprobs identical to the last sequence
    if seqs:
        full = ep.full_sequence()
        assert full.token_ids == seqs[-1].token_ids
        expected = [False] * (position - 1)
        for s in seqs:
            for t in range(s.action_start, len(s.token_ids)):
                expected[t - 1] = True
        assert full.loss_mask == expected
        assert sum(full.loss_mask) == sum(len(x) for x in action_token_ids)


def test_calculator_expert_episode():
    p = Problem("37*48+5", "1781")
    tok = CALC.tokenizer()  # the task's own small alphabet
    policy = counting_policy(CALC.expert_actions(p), tok)
    recorded = []

    def spy(context):
        ids, lps = policy(context)
        recorded.append((list(context), ids, lps))
        return ids, lps

    ep = run_episode(CALC.make_env(), p, spy, tok, max_turns=4)
    assert (ep.reward, ep.done, ep.truncated, ep.num_turns) == (1.0, True, False, 2)
    assert ep.actions == ["<calc>37*48+5</calc>", "<answer>1781</answer>"]
    assert ep.observations[:2] == ["37*48+5", "<result>1781</result>"]
    assert ep.turn_rewards == [0.0, 1.0]
    assert [s.turn_reward for s in ep.sequences] == [0.0, 1.0]
    check_chain(ep, [r[1] for r in recorded], [r[2] for r in recorded])
    # exact layout
    T = tok
    first = [T.bos_token_id, T.user_token_id, *T.encode("37*48+5"), T.assistant_token_id]
    assert recorded[0][0] == first
    obs = [T.tool_token_id, *T.encode("<result>1781</result>"), T.assistant_token_id]
    assert recorded[1][0] == ep.sequences[0].token_ids + obs
    assert ep.sequences[0].token_ids == first + T.encode("<calc>37*48+5</calc>") + [T.eos_token_id]
    # behaviour logprobs are zero off the action tokens
    s = ep.sequences[1]
    action_positions = set(range(ep.sequences[0].action_start, len(ep.sequences[0].token_ids))) | set(
        range(s.action_start, len(s.token_ids)))
    for t, lp in enumerate(s.behaviour_logprobs):
        assert (lp != 0.0) == ((t + 1) in action_positions)


@pytest.mark.parametrize(
    "actions, reward, turns, observation",
    [
        (["<answer>1781</answer>"], 0.0, 1, None),  # right, but no calculator call
        (["<calc>1+1</calc>", "<answer>1781</answer>"], 1.0, 2, "<result>2</result>"),  # any call counts
        (["<calc>37*48+5</calc>", "<answer>1780</answer>"], 0.0, 2, "<result>1781</result>"),
        (["I think <calc>7/2</calc> more", "<answer>1781</answer>"], 1.0, 2, "<result>7/2</result>"),
        (["<calc>3/0</calc>", "<calc>37*48+5</calc>", "<answer>1781</answer>"], 0.5, 3, "<result>error</result>"),
        (["<calc>import os</calc>", "<answer>1781</answer>"], 0.5, 2, "<result>error</result>"),
        (["hello"], -0.5, 1, None),  # malformed: ends the episode
        (["<answer>lots</answer>"], -0.5, 1, None),
    ],
)
def test_calculator_rewards(actions, reward, turns, observation):
    env = CalculatorEnv(malformed_penalty=0.5)
    ep = run_episode(env, Problem("37*48+5"), scripted_policy(actions, TOK), TOK, max_turns=4)
    assert ep.reward == pytest.approx(reward)
    assert ep.turn_rewards[-1] == pytest.approx(1.0 if reward > 0 else -0.5 if reward < 0 else 0.0)
    assert ep.num_turns == turns and ep.done and not ep.truncated
    if observation is not None:
        assert ep.observations[1] == observation


def test_calculator_penalty_accumulates_and_require_call_off():
    env = CalculatorEnv(malformed_penalty=0.25, require_call=False)
    ep = run_episode(env, Problem("2*3"), scripted_policy(["<calc>(</calc>", "<answer>6</answer>"], TOK), TOK)
    assert ep.turn_rewards == [-0.25, 1.0] and ep.reward == 0.75
    ep = run_episode(env, Problem("2*3"), scripted_policy(["<answer>6</answer>"], TOK), TOK)
    assert ep.reward == 1.0
    with pytest.raises(RuntimeError, match="before reset"):
        CalculatorEnv().step("<answer>6</answer>")


def test_max_turns_truncation():
    p = Problem("2*3")
    ep = run_episode(CALC.make_env(), p, scripted_policy(["<calc>2*3</calc>"] * 10, TOK), TOK, max_turns=3)
    assert ep.truncated and ep.truncation == "max_turns" and not ep.done
    assert ep.num_turns == 3 and ep.reward == 0.0
    assert all(s.reward == 0.0 for s in ep.sequences)
    ids = TOK.encode("<calc>2*3</calc>") + [TOK.eos_token_id]
    check_chain(ep, [ids] * 3, [[0.0] * len(ids)] * 3)


def test_max_total_tokens_truncation_cuts_the_action():
    p = Problem("2*3")
    actions = ["<calc>2*3</calc>", "<answer>6</answer>"]
    full = run_episode(CALC.make_env(), p, scripted_policy(actions, TOK), TOK)
    total = len(full.sequences[-1].token_ids)
    for budget in range(2, total + 1):
        ep = run_episode(CALC.make_env(), p, scripted_policy(actions, TOK), TOK, max_total_tokens=budget)
        assert all(len(s.token_ids) <= budget for s in ep.sequences)
        if budget == total:
            assert ep.done and not ep.truncated and ep.reward == 1.0
            continue
        assert ep.truncated and ep.truncation == "max_total_tokens" and ep.reward == 0.0
        # sequences are prefixes of the untruncated episode's, masks cover only real action tokens
        for s in ep.sequences:
            assert full.sequences[-1].token_ids[: len(s.token_ids)] == s.token_ids
            assert s.loss_mask[s.action_start - 1 :] == [True] * (len(s.token_ids) - s.action_start)
            assert not any(s.loss_mask[: s.action_start - 1])
    # a first observation over the budget: no sequences at all
    ep = run_episode(CALC.make_env(), Problem("1+2+3+4+5"), scripted_policy(actions, TOK), TOK, max_total_tokens=5)
    assert ep.sequences == [] and ep.truncated
    with pytest.raises(ValueError, match="no sequences"):
        ep.full_sequence()


def test_single_turn_env_matches_task_reward_and_prompt_ids():
    task = AdditionTask(digits=2)
    tok = task.tokenizer()
    for p in task.train_problems(20):
        for completion in (p.answer, "0"):
            ep = run_episode(task.make_env(), p, scripted_policy([completion], tok), tok)
            assert isinstance(task.make_env(), SingleTurnEnv) and isinstance(task.make_env(), Environment)
            assert ep.num_turns == 1 and ep.done
            assert ep.reward == task.reward(p.prompt, completion)
            s = ep.sequences[0]
            assert s.token_ids[: s.action_start] == ChatFormat.for_tokenizer(tok).prompt_ids(tok, p.prompt)


def test_batched_runs_equal_sequential_runs():
    problems = CALC.train_problems(6, seed=4)
    rng = random.Random(0)
    scripts = [rng.choice([CALC.expert_actions(p), ["<calc>1</calc>"] * 5, ["oops"]]) for p in problems]
    sequential = [run_episode(CALC.make_env(), p, scripted_policy(a, TOK), TOK, max_turns=3)
                  for p, a in zip(problems, scripts)]
    policies = {}

    def batch_policy(contexts):
        out = []
        for c in contexts:
            key = tuple(c[: c.index(TOK.assistant_token_id)])  # the first observation identifies the episode
            out.append(policies[key](c))
        return out

    for p, a in zip(problems, scripts):
        key = tuple(ChatFormat.for_tokenizer(TOK).prompt_ids(TOK, p.prompt)[:-1])
        policies[key] = scripted_policy(a, TOK)
    batched = run_episodes([CALC.make_env() for _ in problems], problems, batch_policy, TOK, max_turns=3)
    for a, b in zip(sequential, batched):
        assert a.sequences == b.sequences and a.reward == b.reward and a.truncation == b.truncation


def test_policy_and_env_errors_are_clear():
    p = Problem("2*3")
    with pytest.raises(ValueError, match="empty action"):
        run_episode(CALC.make_env(), p, lambda c: ([], []), TOK)
    with pytest.raises(ValueError, match="2 action tokens but 1 behaviour"):
        run_episode(CALC.make_env(), p, lambda c: ([7, 8], [0.0]), TOK)
    with pytest.raises(ValueError, match="finite"):
        run_episode(CALC.make_env(), p, lambda c: ([7], [float("nan")]), TOK)

    class NanEnv:
        def reset(self, problem):
            return problem.prompt

        def step(self, action):
            return "", float("nan"), True

    with pytest.raises(RewardError, match=r"NanEnv.*'2\*3'.*nan"):
        run_episode(NanEnv(), p, scripted_policy(["x"], CharTokenizer()), CharTokenizer())
    runner = EpisodeRunner(CALC.make_env(), p, TOK)
    runner.act(*scripted_policy(["no tags"], TOK)(runner.context))
    with pytest.raises(RuntimeError, match="finished"):
        runner.act([5], [0.0])


class RandomEnv:
    """Random observations (possibly empty), random rewards, random ends."""

    def __init__(self, rng):
        self.rng = rng

    def reset(self, problem):
        return problem.prompt

    def step(self, action):
        obs = "".join(self.rng.choice("abc ") for _ in range(self.rng.randint(0, 6)))
        return obs, self.rng.choice([0.0, 0.5, -1.0]), self.rng.random() < 0.2


class PlainTokenizer:
    """A Hugging Face-like tokenizer without chat markers or bos (exercises the plain ChatFormat)."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("tokenizer", [CharTokenizer(), PlainTokenizer()], ids=["char", "plain"])
def test_random_episodes_keep_every_invariant(seed, tokenizer):
    rng = random.Random(seed)
    env = RandomEnv(rng)
    actions, logprobs = [], []

    def policy(context):
        ids = tokenizer.encode("".join(rng.choice("xyz") for _ in range(rng.randint(1, 5))))
        lps = [-rng.random() - 1e-3 for _ in ids]
        actions.append(ids)
        logprobs.append(lps)
        return ids, lps

    budget = rng.choice([12, 40, 1000])
    ep = run_episode(env, Problem("p" + "q" * rng.randint(0, 3)), policy, tokenizer,
                     max_turns=rng.randint(1, 6), max_total_tokens=budget)
    cut = [ids[: len(s.token_ids) - s.action_start] for ids, s in zip(actions, ep.sequences)]
    check_chain(ep, cut, [lp[: len(c)] for lp, c in zip(logprobs, cut)])
    assert ep.reward == pytest.approx(math.fsum(ep.turn_rewards))
    assert ep.done != ep.truncated
    assert len(ep.turn_rewards) == ep.num_turns


def test_empty_first_context_is_an_error():
    with pytest.raises(ValueError, match="first context is empty"):
        run_episode(SingleTurnEnv(AdditionTask()), Problem(""), lambda c: ([1], [0.0]), PlainTokenizer())
