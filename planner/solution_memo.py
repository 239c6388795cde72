"""Identical planning calls get identical plans: the answers of this process's solves,
by problem and options.

The solvers stop at wall-clock limits and CP-SAT's parallel search picks among ties, so two
searches of one problem may return different schedules of equal or nearly equal cost. A user
who plans the same model twice (a re-plan after `apply`, after a backward, in eval, a second
object built alike) must get the same plan both times; so the first answer is remembered
and given again, without searching (re-planning a 70B model at the same budget then costs
the time to hash its problem). A longer time limit, another budget or any other option is
another key and searches anew. Across processes, save the plan (`Plan.save`) to keep it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from threading import Lock

from planner.arguments import SolveOptions
from solvers import Problem, Solution

MEMO_SIZE = 64  # answers kept; the least recently asked go first


def problem_digest(problem: Problem) -> str:
    """A digest of everything the solvers read of ``problem``."""
    return hashlib.sha256(problem.model_dump_json().encode()).hexdigest()


class SolutionMemo:
    """The answers given so far, by (problem digest, options); least recently used first out."""

    def __init__(self, size: int = MEMO_SIZE) -> None:
        self.size = size
        self._answers: OrderedDict[tuple[str, SolveOptions], Solution] = OrderedDict()
        self._minima: OrderedDict[tuple[str, SolveOptions], Solution] = OrderedDict()
        self._lock = Lock()

    def get(self, digest: str, options: SolveOptions) -> Solution | None:
        with self._lock:
            answer = self._answers.get((digest, options))
            if answer is not None:
                self._answers.move_to_end((digest, options))
            return answer

    def put(self, digest: str, options: SolveOptions, answer: Solution) -> None:
        with self._lock:
            self._answers[(digest, options)] = answer
            self._answers.move_to_end((digest, options))
            while len(self._answers) > self.size:
                self._answers.popitem(last=False)

    def put_minimum(self, digest: str, options: SolveOptions, answer: Solution) -> None:
        """The plan an infeasible budget's error named, with ``options`` at its peak: what
        a search at that budget falls back on when it finds nothing as low
        (`minimum`)."""
        with self._lock:
            self._minima[(digest, options)] = answer
            self._minima.move_to_end((digest, options))
            while len(self._minima) > self.size:
                self._minima.popitem(last=False)

    def minimum(self, digest: str, options: SolveOptions) -> Solution | None:
        with self._lock:
            return self._minima.get((digest, options))

    def clear(self) -> None:
        with self._lock:
            self._answers.clear()
            self._minima.clear()


ANSWERS = SolutionMemo()
