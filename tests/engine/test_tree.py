"""PrefixTree against a naive pure-Python trie built independently here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.forests import forests
from treerl import PrefixTree
from treerl.engine.tree import _next_not_deeper  # (unchanged by the new build: both builds share it)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ the naive trie
class NaiveTrie:
    """A dict-of-dicts trie; tree tokens numbered in DFS preorder, children in increasing
    token order (= lexicographic order of the sequences, as PrefixTree documents)."""

    def __init__(self, seqs: list[list[int]]):
        root: dict = {}
        for s in seqs:
            node = root
            for t in s:
                node = node.setdefault(t, {})
        self.token_ids: list[int] = []
        self.position: list[int] = []
        self.parent: list[int] = []
        self.subtree_end: list[int] = []
        self.index_of: dict[tuple, int] = {}  # prefix tuple -> tree token

        def visit(children, depth, par, prefix):
            for t in sorted(children):
                i = len(self.token_ids)
                self.token_ids.append(t)
                self.position.append(depth)
                self.parent.append(par)
                self.subtree_end.append(-1)
                p = prefix + (t,)
                self.index_of[p] = i
                visit(children[t], depth + 1, i, p)
                self.subtree_end[i] = len(self.token_ids)

        visit(root, 0, -1, ())
        self.paths = [[self.index_of[tuple(s[: j + 1])] for j in range(len(s))] for s in seqs]
        n = len(self.token_ids)
        # The set of sequences through each tree token defines the nodes.
        self.seq_sets: list[set[int]] = [set() for _ in range(n)]
        for i, path in enumerate(self.paths):
            for t in path:
                self.seq_sets[t].add(i)
        self.node_start = [
            t for t in range(n) if self.parent[t] < 0 or self.seq_sets[self.parent[t]] != self.seq_sets[t]
        ]

    def ancestors_or_self(self, q: int) -> set[int]:
        out = set()
        while q >= 0:
            out.add(q)
            q = self.parent[q]
        return out


def as_input(seq: list[int], kind: str):
    """The same token ids in one of the accepted input types."""
    return {
        "list": lambda: list(seq),
        "tuple": lambda: tuple(seq),
        "np_int64": lambda: np.array(seq, dtype=np.int64),
        "np_int32": lambda: np.array(seq, dtype=np.int32),
        "np_uint16": lambda: np.array(seq, dtype=np.uint16),
        "torch_int64": lambda: torch.tensor(seq, dtype=torch.int64),
        "torch_int32": lambda: torch.tensor(seq, dtype=torch.int32),
        "torch_uint8": lambda: torch.tensor(seq, dtype=torch.uint8),
        "torch_view": lambda: torch.tensor([0] + seq + [0], dtype=torch.int64)[1:-1],  # non-zero offset
    }[kind]()


INPUT_KINDS = ["list", "tuple", "np_int64", "np_int32", "np_uint16", "torch_int64", "torch_int32", "torch_uint8", "torch_view"]


@st.composite
def forests_as_inputs(draw, **kw):
    seqs = draw(forests(**kw))
    kinds = draw(st.lists(st.sampled_from(INPUT_KINDS), min_size=len(seqs), max_size=len(seqs)))
    return seqs, [as_input(s, k) for s, k in zip(seqs, kinds)]


def check_against_naive(seqs: list[list[int]], tree: PrefixTree) -> NaiveTrie:
    naive = NaiveTrie(seqs)
    n = len(naive.token_ids)
    assert tree.num_tree_tokens == n
    assert tree.num_sequences == len(seqs)
    assert tree.num_flat_tokens == sum(map(len, seqs))
    for name in ("token_ids", "position", "parent", "subtree_end", "node_start", "node_end", "node_parent", "seq_index", "seq_offsets"):
        t = getattr(tree, name)
        assert t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu", name
    assert tree.token_ids.tolist() == naive.token_ids
    assert tree.position.tolist() == naive.position
    assert tree.parent.tolist() == naive.parent
    assert tree.subtree_end.tolist() == naive.subtree_end
    # Every sequence recovered exactly, in input order, with its own identity.
    assert tree.seq_lengths.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        path = tree.path(i)
        assert path.tolist() == naive.paths[i], f"sequence {i}"
        assert tree.sequence(i).tolist() == s
        assert tree.token_ids[path].tolist() == s
        assert tree.position[path].tolist() == list(range(len(s)))
        assert tree.parent[path].tolist() == [-1] + path[:-1].tolist()
    assert [x.tolist() for x in tree.sequences()] == seqs
    # Nodes: exactly the naive trie's maximal runs of tokens with one set of sequences.
    assert tree.node_start.tolist() == naive.node_start
    return naive


# ------------------------------------------------------------------------ properties
@SETTINGS
@given(forests_as_inputs(max_seqs=12, max_len=30))
def test_matches_naive_trie(data):
    seqs, inputs = data
    tree = PrefixTree.from_sequences(inputs)
    check_against_naive(seqs, tree)


@SETTINGS
@given(forests(max_seqs=12, max_len=30))
def test_node_table_invariants(seqs):
    tree = PrefixTree.from_sequences(seqs)
    naive = NaiveTrie(seqs)
    start, end, nparent = tree.node_start.tolist(), tree.node_end.tolist(), tree.node_parent.tolist()
    m, n = tree.num_nodes, tree.num_tree_tokens
    # Contiguous, non-empty, covering [0, N) in order.
    assert start[0] == 0 and end[-1] == n
    assert all(e == s2 for e, s2 in zip(end[:-1], start[1:]))
    assert all(s < e for s, e in zip(start, end))
    node_of = tree.node_of_token().tolist()
    assert node_of == [k for k in range(m) for _ in range(end[k] - start[k])]
    for k in range(m):
        toks = range(start[k], end[k])
        # A node is a chain: every later token's parent is the previous token.
        assert all(tree.parent[t] == t - 1 for t in list(toks)[1:])
        # ... shared by one set of sequences ...
        sets = {frozenset(naive.seq_sets[t]) for t in toks}
        assert len(sets) == 1, f"node {k} mixes sequence sets"
        # ... and maximal: the parent node's last token has another set.
        p = tree.parent[start[k]].item()
        if p < 0:
            assert nparent[k] == -1
        else:
            assert nparent[k] == node_of[p] and end[nparent[k]] - 1 == p
            assert naive.seq_sets[p] != naive.seq_sets[start[k]], f"node {k} could be merged into its parent"
        # Subtree ends agree for all tokens of a node and enclose the node.
        assert len({tree.subtree_end[t].item() for t in toks}) == 1
        assert tree.subtree_end[start[k]] >= end[k]
    # Summary counts.
    assert tree.num_roots == len({s[0] for s in seqs})
    assert tree.num_leaves == sum(1 for k in range(m) if k not in set(nparent))
    assert tree.attention_pairs == sum(p + 1 for p in naive.position)
    assert tree.ideal_ratio == pytest.approx(sum(map(len, seqs)) / n)
    stats = tree.stats()
    assert stats["tree_tokens"] == n and stats["nodes"] == m
    assert stats["max_depth"] == max(map(len, seqs))


@settings(max_examples=60, deadline=None)
@given(forests(max_seqs=8, max_len=14))
def test_visibility_rule_is_ancestor_or_self(seqs):
    tree = PrefixTree.from_sequences(seqs)
    naive = NaiveTrie(seqs)
    n = tree.num_tree_tokens
    k = torch.arange(n)
    rule = (k[None, :] <= k[:, None]) & (k[:, None] < tree.subtree_end[None, :])  # [q, k]
    expected = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        expected[q, list(naive.ancestors_or_self(q))] = True
    assert torch.equal(rule, expected)
    # Each query sees exactly its depth + 1 keys.
    assert rule.sum(1).tolist() == [p + 1 for p in tree.position.tolist()]


@SETTINGS
@given(forests(max_seqs=10, max_len=20))
def test_unshared_layout(seqs):
    tree = PrefixTree.from_sequences(seqs, share_prefixes=False)
    lengths = [len(s) for s in seqs]
    offsets = np.cumsum([0] + lengths).tolist()
    assert tree.num_tree_tokens == tree.num_flat_tokens == offsets[-1]
    assert tree.token_ids.tolist() == [t for s in seqs for t in s]
    assert tree.position.tolist() == [j for s in seqs for j in range(len(s))]
    assert tree.parent.tolist() == [(-1 if j == 0 else offsets[i] + j - 1) for i, s in enumerate(seqs) for j in range(len(s))]
    assert tree.subtree_end.tolist() == [offsets[i + 1] for i, s in enumerate(seqs) for _ in s]
    assert tree.node_start.tolist() == offsets[:-1] and tree.node_end.tolist() == offsets[1:]
    assert tree.node_parent.tolist() == [-1] * len(seqs)
    assert tree.num_roots == tree.num_leaves == len(seqs)
    for i in range(len(seqs)):
        assert tree.path(i).tolist() == list(range(offsets[i], offsets[i + 1]))
    assert tree.ideal_ratio == 1.0
    # unshared() of a shared tree is the same layout.
    shared = PrefixTree.from_sequences(seqs)
    u = shared.unshared()
    for name in ("token_ids", "position", "parent", "subtree_end", "seq_index", "node_start", "node_parent"):
        assert torch.equal(getattr(u, name), getattr(tree, name)), name


# ------------------------------------------------------------------ worked examples
def test_worked_example_exact_layout():
    # input: 0: 5 6 7 | 1: 5 6 | 2: 5 6 7 | 3: 2 | 4: 5 9 9 1 | 5: 5 6 3
    seqs = [[5, 6, 7], [5, 6], [5, 6, 7], [2], [5, 9, 9, 1], [5, 6, 3]]
    tree = PrefixTree.from_sequences(seqs)
    # preorder: 2 | 5 6 3 7 9 9 1   (children in token order: under 6 -> 3 then 7)
    assert tree.token_ids.tolist() == [2, 5, 6, 3, 7, 9, 9, 1]
    assert tree.position.tolist() == [0, 0, 1, 2, 2, 1, 2, 3]
    assert tree.parent.tolist() == [-1, -1, 1, 2, 2, 1, 5, 6]
    assert tree.subtree_end.tolist() == [1, 8, 5, 4, 5, 8, 8, 8]
    # nodes: [2] [5] [6] [3] [7] [9 9 1]
    assert tree.node_start.tolist() == [0, 1, 2, 3, 4, 5]
    assert tree.node_end.tolist() == [1, 2, 3, 4, 5, 8]
    assert tree.node_parent.tolist() == [-1, -1, 1, 2, 2, 1]
    assert [tree.path(i).tolist() for i in range(6)] == [[1, 2, 4], [1, 2], [1, 2, 4], [0], [1, 5, 6, 7], [1, 2, 3]]
    assert tree.num_roots == 2 and tree.num_leaves == 4 and tree.num_nodes == 6


def test_duplicates_and_prefixes_keep_identity():
    seqs = [[4, 4, 4], [4, 4, 4], [4], [4, 4], [4, 4, 4, 4]]
    tree = PrefixTree.from_sequences(seqs)
    assert tree.num_tree_tokens == 4 and tree.num_nodes == 4  # a sequence ends after every token
    assert tree.path(0).tolist() == tree.path(1).tolist() == [0, 1, 2]
    assert [tree.path(i).tolist() for i in (2, 3, 4)] == [[0], [0, 1], [0, 1, 2, 3]]
    assert tree.num_leaves == 1


def test_single_sequence_and_single_tokens():
    t = PrefixTree.from_sequences([[3, 1, 2]])
    assert t.num_nodes == 1 and t.parent.tolist() == [-1, 0, 1] and t.subtree_end.tolist() == [3, 3, 3]
    t = PrefixTree.from_sequences([[7], [3], [7], [0]])
    assert t.token_ids.tolist() == [0, 3, 7] and t.parent.tolist() == [-1, -1, -1]
    assert [t.path(i).tolist() for i in range(4)] == [[2], [1], [2], [0]]
    assert t.subtree_end.tolist() == [1, 2, 3]


def test_large_random_batch_matches_naive(gen):
    """A GRPO/agentic-like batch of a few hundred sequences (the vectorised paths at scale)."""
    seqs = []
    for _ in range(20):
        prompt = torch.randint(0, 50, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
        turn = list(prompt)
        for _ in range(6):  # agentic: each turn extends the previous one
            turn = turn + torch.randint(0, 3, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
            seqs.append(turn)
        for _ in range(8):  # grpo: samples of one prompt, tiny alphabet -> deep random sharing
            seqs.append(prompt + torch.randint(0, 2, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist())
    perm = torch.randperm(len(seqs), generator=gen).tolist()
    seqs = [seqs[i] for i in perm]
    check_against_naive(seqs, PrefixTree.from_sequences([torch.tensor(s) for s in seqs]))


def test_ids_beyond_int32_and_uint8_order():
    """Lexicographic order is by integer value (not by byte or by string)."""
    seqs = [[2**40, 1], [255, 2], [256, 3], [1, 4], [2**31, 5]]
    tree = PrefixTree.from_sequences(seqs)
    assert tree.token_ids[tree.parent < 0].tolist() == [1, 255, 256, 2**31, 2**40]
    check_against_naive(seqs, tree)


# ----------------------------------------------------------------------- bad input
BAD_INPUTS = [
    # (sequences, error type, substrings of the message)
    ([[1, 2], [3], [4, 5], []], ValueError, ["sequence 3", "empty"]),
    ([[1, 2], torch.tensor([], dtype=torch.long)], ValueError, ["sequence 1", "empty"]),
    ([[1, 2], [3], torch.tensor([1.0, 2.0])], TypeError, ["sequence 2", "integers", "float32"]),
    ([[1, 2], torch.tensor([1, 2], dtype=torch.float64)], TypeError, ["sequence 1", "integers", "float64"]),
    ([[1, 2], torch.tensor([True, False])], TypeError, ["sequence 1", "integers", "bool"]),
    ([[1], [2, 3], [1, 2.5]], TypeError, ["sequence 2", "integers"]),
    ([[1], [2.0, 3.0]], TypeError, ["sequence 1", "integers"]),
    ([[1], [2, 3], np.array([1.5, 2.0])], TypeError, ["sequence 2", "integers"]),
    ([[1], ["a", "b"]], TypeError, ["sequence 1", "integers"]),
    ([[1], [2], [True, False]], TypeError, ["sequence 2", "integers", "bool"]),
    ([[1], [2], [1, None]], TypeError, ["sequence 2", "integers"]),
    ([[1], [2], "abc"], TypeError, ["sequence 2", "str"]),
    ([[1], None], TypeError, ["sequence 1"]),
    ([[1], 7], TypeError, ["sequence 1"]),
    ([[1], torch.ones(2, 3, dtype=torch.long)], ValueError, ["sequence 1", "1-D", "(2, 3)"]),
    ([[1], torch.tensor(3)], ValueError, ["sequence 1", "1-D"]),
    ([[1], [[1, 2], [3, 4]]], ValueError, ["sequence 1", "(2, 2)"]),
    ([[1, 2], [3], [4, 5, -3]], ValueError, ["sequence 2", "-3", "position 2", "negative"]),
    ([[1, 2], torch.tensor([0, -1])], ValueError, ["sequence 1", "-1", "position 1", "negative"]),
    ([], ValueError, ["no sequences"]),
    ("abc", TypeError, ["list of token sequences"]),
]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("seqs,exc,parts", BAD_INPUTS, ids=[f"bad{i}" for i in range(len(BAD_INPUTS))])
def test_bad_input_raises_naming_the_sequence(seqs, exc, parts, share):
    with pytest.raises(exc) as info:
        PrefixTree.from_sequences(seqs, share_prefixes=share)
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_bool_mixed_with_ints_is_rejected():
    with pytest.raises(TypeError, match="sequence 1"):
        PrefixTree.from_sequences([[1, 2], [3, True]])


def test_ragged_nested_sequence_names_the_sequence():
    with pytest.raises(ValueError, match="sequence 2"):
        PrefixTree.from_sequences([[1, 2], [3], [[1], [2, 3]]])


def test_float_message_quotes_the_offending_value():
    with pytest.raises(TypeError, match="2.5"):
        PrefixTree.from_sequences([[1], [1, 2.5]])


# ------------------------------------------------ the build before issue 24, as a reference
def _ref_segment_arange(lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] position within its segment: 0..len-1 for each segment in turn."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def _ref_sorted_order(arrays: list[np.ndarray]) -> np.ndarray:
    """Lexicographic order of the sequences (a prefix sorts before its extensions)."""
    keys = [a.astype(">u8").tobytes() for a in arrays]  # big-endian bytes sort like the ints
    return np.array(sorted(range(len(arrays)), key=keys.__getitem__), dtype=np.int64)


def _ref_longest_common_prefixes(flat: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """lcp[k] = common prefix length of sequences k-1 and k (lcp[0] = 0)."""
    n = len(lengths)
    lcp = np.zeros(n, dtype=np.int64)
    if n < 2:
        return lcp
    common = np.minimum(lengths[1:], lengths[:-1])  # comparable positions per pair k=1..n-1
    d = _ref_segment_arange(common)
    pair = np.repeat(np.arange(1, n), common)
    differs = flat[offsets[pair] + d] != flat[offsets[pair - 1] + d]
    lcp[1:] = common
    first_pair, first_at = np.unique(pair[differs], return_index=True)
    lcp[first_pair] = d[differs][first_at]
    return lcp


def reference_build(arrays: list[np.ndarray], share_prefixes: bool) -> dict[str, np.ndarray]:
    """The build before issue 24 (forward fills over every flat token), kept as a reference."""
    n = len(arrays)
    in_lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    order = _ref_sorted_order(arrays) if share_prefixes else np.arange(n, dtype=np.int64)
    lengths = in_lengths[order]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate([arrays[k] for k in order])
    lcp = _ref_longest_common_prefixes(flat, lengths, offsets) if share_prefixes else np.zeros(n, np.int64)

    # Every flat position (k, d) of the sorted sequences: new tokens are d >= lcp[k].
    depth = _ref_segment_arange(lengths)
    seq_of = np.repeat(np.arange(n), lengths)
    is_new = depth >= lcp[seq_of]
    tree_of_flat = np.cumsum(is_new) - 1  # valid where is_new
    # A shared position (k, d) is the tree token of the last sequence <= k that created
    # depth d: a forward fill within each depth, in (depth, k) order. The first entry of
    # each depth is always new, so the fill never crosses depths.
    by_depth = np.argsort(depth, kind="stable")
    marks = np.where(is_new[by_depth], np.arange(len(flat)), 0)
    last_new = np.maximum.accumulate(marks)
    tree_of_flat[by_depth] = tree_of_flat[by_depth][last_new]

    token_ids = flat[is_new]
    position = depth[is_new]
    prev_flat = np.concatenate([[0], tree_of_flat[:-1]])
    parent = np.where(depth > 0, prev_flat, -1)[is_new]
    num_tokens = len(token_ids)

    # Nodes: a token starts one at a root, after a branch point, or after a sequence end.
    children = np.bincount(parent[parent >= 0], minlength=num_tokens)
    ends_here = np.zeros(num_tokens, dtype=bool)
    ends_here[tree_of_flat[offsets[1:] - 1]] = True
    safe_parent = np.maximum(parent, 0)
    starts = (parent < 0) | (children[safe_parent] != 1) | ends_here[safe_parent]
    node_start = np.flatnonzero(starts)
    node_end = np.append(node_start[1:], num_tokens)
    node_of = np.cumsum(starts) - 1
    node_parent = np.where(parent[node_start] >= 0, node_of[safe_parent[node_start]], -1)
    next_outside = _next_not_deeper(position[node_start])
    node_subtree_end = np.append(node_start, num_tokens)[next_outside]
    subtree_end = node_subtree_end[node_of]

    # Gather maps in input order.
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    in_seq = np.repeat(np.arange(n), in_lengths)
    in_depth = _ref_segment_arange(in_lengths)
    seq_index = tree_of_flat[offsets[rank[in_seq]] + in_depth]
    seq_offsets = np.concatenate([[0], np.cumsum(in_lengths)])

    return dict(token_ids=token_ids, position=position, parent=parent, subtree_end=subtree_end,
                node_start=node_start, node_end=node_end, node_parent=node_parent, seq_index=seq_index,
                seq_offsets=seq_offsets)


@SETTINGS
@given(forests(max_seqs=16, max_len=40), st.booleans())
def test_build_equals_the_forward_fill_build(seqs, share):
    """The per-sequence build (slice copies) gives every array of the build it replaced."""
    from treerl.engine.tree import _validated_arrays

    tree = PrefixTree.from_sequences(seqs, share_prefixes=share)
    ref = reference_build(_validated_arrays(seqs), share)
    for name, want in ref.items():
        assert np.array_equal(getattr(tree, name).numpy(), want), name


@pytest.mark.parametrize("workload", ["grpo", "agentic", "tree", "episodes"])
def test_build_equals_the_forward_fill_build_on_workloads(workload):
    from treerl.devtools.workloads import SCALES, make_workload
    from treerl.engine.tree import _validated_arrays

    seqs = make_workload(workload, SCALES["small"], 1000)
    seqs += [seqs[0], seqs[1][: len(seqs[1]) // 2]]  # a duplicate and a strict prefix
    tree = PrefixTree.from_sequences(seqs)
    for name, want in reference_build(_validated_arrays(seqs), True).items():
        assert np.array_equal(getattr(tree, name).numpy(), want), name
