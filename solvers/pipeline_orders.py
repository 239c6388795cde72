"""The order in which torch's pipeline schedules run one rank's passes (torch 2.14,
``torch/distributed/pipelining/schedules.py``), without the no-ops that align ranks.

A pass is ``(kind, chunk, microbatch)``: "F" forward, "B" full backward, and under a
split backward "I" (the input's gradient) and later "W" (the weights'). ``chunk`` is the
rank's model chunk (torch's local stage). ``tests/test_pipeline.py`` compares each order
with torch's own ``_calculate_single_rank_operations`` on every rank of 2 to 4 ranks.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

__all__ = ["ChunkAction", "Pass", "dualpipev", "gpipe", "interleaved", "one_f_one_b", "zbv"]

Pass = Literal["F", "B", "I", "W"]
ChunkAction = tuple[Pass, int, int]  # pass, the rank's chunk, microbatch


def gpipe(m: int) -> list[ChunkAction]:
    """``ScheduleGPipe``: every forward, then every backward."""
    return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]


def one_f_one_b(m: int, p: int, r: int) -> list[ChunkAction]:
    """``Schedule1F1B``: ``min(m, p - r)`` forwards, then a backward and a forward in turn."""
    warmup = min(m, p - r)
    actions: list[ChunkAction] = [("F", 0, j) for j in range(warmup)]
    for j in range(m):
        actions.append(("B", 0, j))
        if warmup + j < m:
            actions.append(("F", 0, warmup + j))
    return actions


def interleaved(m: int, p: int, r: int, v: int, split: bool) -> list[ChunkAction]:
    """``ScheduleInterleaved1F1B`` (``split``: ``ScheduleInterleavedZeroBubble``) on rank
    ``r`` of ``p`` with ``v`` chunks, chunk ``c`` the pipeline's stage ``c·p + r``. With
    ``q`` microbatches per round (``m // max(1, m // p)``) the rank runs
    ``w = min((v − 1)·q + k·(p − 1 − r), m·v)`` forwards (k = 2; 1 when split), then one
    forward and one backward in turn, then the backwards left; its ``k``-th forward runs
    chunk ``(k // q) mod v``, its ``k``-th backward chunk ``v − 1 − (k // q) mod v``, each
    on that chunk's next microbatch. Split, each backward is an "I", and from the rank's
    ``r``-th on each is followed by the oldest pending "W"; the rest come last."""
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + (1 if split else 2) * (p - 1 - r), total)
    forwards, backwards = [0] * v, [0] * v
    pending: deque[tuple[int, int]] = deque()  # input passes awaiting their weights'

    def forward(k: int) -> list[ChunkAction]:
        chunk = (k // per_round) % v
        forwards[chunk] += 1
        return [("F", chunk, forwards[chunk] - 1)]

    def backward(k: int) -> list[ChunkAction]:
        chunk = v - 1 - (k // per_round) % v
        backwards[chunk] += 1
        if not split:
            return [("B", chunk, backwards[chunk] - 1)]
        pending.append((chunk, backwards[chunk] - 1))
        weight: list[ChunkAction] = [("W", *pending.popleft())] if k >= r else []
        return [("I", chunk, backwards[chunk] - 1), *weight]

    actions = [a for k in range(warmup) for a in forward(k)]
    for k in range(total - warmup):
        actions += forward(warmup + k) + backward(k)
    actions += [a for k in range(total - warmup, total) for a in backward(k)]
    return actions + [("W", *left) for left in pending]


class _Counts:
    """A rank's passes so far, chunk by chunk; the next microbatch of each kind."""

    def __init__(self) -> None:
        self.actions: list[ChunkAction] = []
        self.next = {(kind, c): 0 for kind in "FIW" for c in (0, 1)}
        self.pending: deque[tuple[int, int]] = deque()  # "I" done, "W" not

    def add(self, kind: Pass, chunk: int) -> None:
        """The chunk's next forward, input pass or full backward; a full backward counts
        as its input pass and its weights' pass."""
        j = self.next["I" if kind == "B" else kind, chunk]
        self.actions.append((kind, chunk, j))
        self.next["I" if kind == "B" else kind, chunk] = j + 1
        if kind == "I":
            self.pending.append((chunk, j))

    def weight(self) -> None:
        """The oldest pending weights' pass, if any."""
        if self.pending:
            self.actions.append(("W", *self.pending.popleft()))

    def input_and_weight(self, chunk: int) -> None:
        """The chunk's next input pass, its weights' pass right after."""
        j = self.next["I", chunk]
        self.actions += [("I", chunk, j), ("W", chunk, j)]
        self.next["I", chunk] = j + 1


def zbv(m: int, p: int, r: int) -> list[ChunkAction]:
    """``ScheduleZBVZeroBubble`` on rank ``r`` of ``p``: chunk 0 is stage ``r``, chunk 1
    stage ``2p − 1 − r`` (a V). Planned for ``max(2p − 1, m)`` microbatches, then those
    past ``m`` left out, as torch does."""
    n = max(2 * p - 1, m)
    run = _Counts()
    for _ in range(2 * (p - r) - 1):
        run.add("F", 0)
    for _ in range(r):
        run.add("F", 1)
        run.add("F", 0)
    for _ in range(p - r):
        run.add("F", 1)
        run.input_and_weight(1)
    while run.next["F", 1] < run.next["F", 0] or run.next["F", 0] < n:
        if run.next["F", 0] < n:
            run.add("F", 0)
        run.input_and_weight(0)
        run.add("F", 1)
        run.input_and_weight(1)
    weights = [run.next["I", 0], run.next["I", 1]]  # the cool-down's weights, by chunk
    for _ in range(r):
        run.add("I", 0)
        run.add("I", 1)
    for _ in range(p - r):
        run.add("I", 0)
        run.actions.append(("W", 0, weights[0]))
        weights[0] += 1
    run.actions += [("W", 1, j) for j in range(weights[1], run.next["I", 1])]
    run.actions += [("W", 0, j) for j in range(weights[0], run.next["I", 0])]
    return [a for a in run.actions if a[2] < m]


def dualpipev(m: int, p: int, r: int) -> list[ChunkAction]:
    """``ScheduleDualPipeV`` on rank ``r`` of ``p`` (chunks as :func:`zbv`; ``m ≥ 2p``):
    forwards, then overlapped pairs (a forward of one chunk, a full backward of the other:
    torch runs the two in turn), and from the middle of the cool-down split backwards whose
    weights' passes fill the gaps."""
    run = _Counts()
    for _ in range(2 * (p - r - 1)):
        run.add("F", 0)
    for _ in range(r + 1):
        run.add("F", 0)
        run.add("F", 1)
    for _ in range(p - r - 1):
        run.add("I", 1)
        run.weight()
        run.add("F", 1)
    for _ in range(m - 2 * p + r + 1):
        run.add("F", 0)  # overlapped with chunk 1's backward, except once on the last rank
        run.add("B", 1)
        run.add("F", 1)
        run.add("B", 0)
    for _ in range(p - r - 1):
        run.add("B", 1)
        run.add("F", 1)
        run.add("B", 0)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        run.add("I" if split else "B", 1)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        run.add("I" if split else "B", 0)
    for _ in range(p - r - 1):
        run.weight()
        run.add("I" if split else "B", 0)
    for _ in range(r + 1):
        run.weight()
    return run.actions
