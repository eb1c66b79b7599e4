"""Row layout of one group slot of the running batch, for plain groups and tree rollouts.

A prompt's samples form a tree: ``n`` samples, and at each fork point ``t_k`` (a
completion length, ``k = 1..m``) every unfinished partial completion forks into ``f_k``
continuations. A group slot reserves the rows of the complete tree, ``L = n x f_1 x ...
x f_m`` (``params.max_leaves``), laid out so that every node's rows are consecutive:

- *level* ``k`` (``0..m``) covers completion tokens ``[t_k, t_{k+1})`` (``t_0 = 0``,
  ``t_{m+1} = max_new_tokens``) and has ``c_k = n x f_1 x ... x f_k`` nodes per group of
  ``r_k = L / c_k`` rows each; level ``m``'s nodes are single rows (a row's own tokens);
- a node's first row holds it while it is being generated (the only live row of the
  node's range); at fork ``k`` each live row ``p`` keeps its row as child 0 and its
  children ``c = 1..f_k - 1`` take the reserved rows ``p + c x r_k``;
- so row ``p`` of a group is leaf ``branch = (p // r_0, (p // r_1) % f_1, ...)``.

The K/V of level ``k < m`` (fork segments) is stored once per node, ``cap_k`` slots
(its tokens plus one trash slot for the writes of rows that are not its writer), and read
by the ``r_k`` rows below it; level ``m`` is each row's own store (paged: blocks taken as
the row grows, :mod:`~treerl.rollout.paging`). Plain groups
(``m = 0``) are the prompt store and the rows' own stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .params import SamplingParams
from .types import round_up


@dataclass(frozen=True)
class ForkLayout:
    """The layout above for ``n`` samples, fork ``points`` ``t_1 < ... < t_m`` with
    ``factors`` ``f_1..f_m``, and ``max_new`` tokens per completion."""

    n: int
    points: tuple[int, ...]
    factors: tuple[int, ...]
    max_new: int

    @classmethod
    def of(cls, params: SamplingParams) -> "ForkLayout":
        schedule = params.branch_schedule()
        return cls(params.n, tuple(schedule), tuple(schedule.values()), params.max_new_tokens)

    @property
    def depth(self) -> int:
        """``m``: fork points."""
        return len(self.points)

    @property
    def rows(self) -> int:
        """``L``: rows of a group slot (most leaves)."""
        return self.n * prod(self.factors)

    def nodes(self, k: int) -> int:
        """``c_k``: nodes of level ``k`` per group."""
        return self.n * prod(self.factors[:k])

    def rows_per_node(self, k: int) -> int:
        """``r_k``: rows below a node of level ``k``."""
        return self.rows // self.nodes(k)

    def start(self, k: int) -> int:
        """``t_k``: first completion token of level ``k``."""
        return 0 if k == 0 else self.points[k - 1]

    def end(self, k: int) -> int:
        """``t_{k+1}``: end of level ``k``'s tokens."""
        return self.points[k] if k < self.depth else self.max_new

    def segment_capacity(self, k: int) -> int:
        """Slots of a level-``k`` fork segment (``k < m``): its tokens + a trash slot."""
        return round_up(self.end(k) - self.start(k) + 1)

    def trash(self, k: int) -> int:
        """The fork segment's trash slot (written by rows that are not its writer, never read)."""
        return self.segment_capacity(k) - 1

    @property
    def own_start(self) -> int:
        """``t_m``: first completion token a row stores in its own slots."""
        return self.start(self.depth)

    @property
    def own_capacity(self) -> int:
        return round_up(self.max_new - self.own_start)

    def shared_tokens(self, prefix_capacity: int) -> int:
        """K/V token slots a group slot holds for its shared levels: prompt store + fork segments."""
        return prefix_capacity + sum(self.nodes(k) * self.segment_capacity(k) for k in range(self.depth))

    def tokens_per_group(self, prefix_capacity: int) -> int:
        """K/V token slots of one group at most: shared levels + every row's own capacity."""
        return self.shared_tokens(prefix_capacity) + self.rows * self.own_capacity

    def first_rows(self) -> list[int]:
        """Rows (in the group) of the ``n`` samples at admission."""
        r0 = self.rows_per_node(0)
        return [i * r0 for i in range(self.n)]

    def children(self, p: int, k: int) -> list[int]:
        """Rows that fork ``k`` (``1..m``) gives row ``p`` (live at level ``k - 1``) beside its own."""
        r = self.rows_per_node(k)
        return [p + c * r for c in range(1, self.factors[k - 1])]

    def depth_of(self, length: int) -> int:
        """Forks passed by a completion of ``length`` tokens (a row that stopped at or before
        a fork point was not forked there)."""
        return sum(1 for t in self.points if length > t)

    def branch(self, p: int, depth: int) -> tuple[int, ...]:
        """``Completion.branch`` of row ``p`` (in its group) after ``depth`` forks."""
        return (p // self.rows_per_node(0),) + tuple(
            (p // self.rows_per_node(k)) % self.factors[k - 1] for k in range(1, depth + 1))
