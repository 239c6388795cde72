"""What a checkpointed region keeps: its keep space, reduced to a Pareto front.

Selective checkpointing may keep any node k of a RECOMPUTE region (`CheckpointPolicy.MUST_SAVE`):
its outputs stay in the SAC cache from the forward until the rerun reaches k, which then
runs nothing for it (`simulate`). That changes only the lives of k's own outputs and k's
rerun step, so over a window of the chain (`accounting.profile_parts`) keeping a set K is
keeping nothing plus one term per node of K (`KeepSpace.parts`; the tests hold it to
`profile_parts` and `simulate`):

1. the live bytes at each slot add up (`KeepSpace.delta`: positive while the cache holds
   what the rerun would make later, negative at k's rerun step by the temporaries it no
   longer allocates);
2. the bytes held past the end of the forward add up (`KeepSpace.residue`), and so does the
   rerun time saved (k's forward time, and that of the steps the rerun then skips: F9,
   `KeepSpace.reach`; nodes the early-stopped rerun never runs save none and only hold
   memory, so they are left out), except where one candidate lies in another's reach, or a
   step is skipped only when several are kept (`frame.skip_covers`: q, k and v copies that
   all feed on one projection): such candidates form a group whose every subset is priced
   as a whole (`KeepSpace.groups`, up to `GROUP_MAX` members);
3. the SAC policy's overhead is paid once, whatever K is (`Problem.checkpoint_overhead_ms`).

So a solver needs per region only the keep sets on the Pareto front of (bytes held past
the forward, rerun time saved) (`pareto_front`): any other set is matched or beaten on both
by a point of the front, and its live bytes are nowhere below that point's floor
(`KeepSpace.floor_for`: keeping nothing plus, slot by slot, the least any set holding as
many bytes past the forward can add), which a lower-bound pass pairs with each point. Kept
outputs read after the window (`KeepSpace.exports`) change what the next window receives,
so subsets of those nodes get their own fronts (`choices`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from solvers.accounting import Context, WindowParts, profile_parts
from solvers.frame import FrameRules, dead_steps, may_skip, skip_covers
from solvers.front import bucket_ends, pareto
from solvers.problem import Problem

__all__ = ["CAP_LEVELS", "CAP_POINTS", "FRONT_POINTS", "GROUP_MAX", "MAX_EXPORTS", "KeepChoice",
           "KeepSpace", "choices", "front_of", "pareto_front", "under_caps"]

MAX_EXPORTS = 4  # up to this many exporting candidates, every subset of them is offered
# candidates whose reaches overlap are priced together up to this many (every subset); in a
# larger group each is priced alone with its whole reach: never below what it saves with
# the others (the lower-bound pass's need), while real options are priced exactly
GROUP_MAX = 6
# least keep sets per skipped step, and candidates per set, followed before every candidate
# is priced with every step a rerun may skip (`_reach`): past this, no group is exact anyway
COVERS_MAX = 32
Option = tuple[int, float, tuple[int, ...]]  # a keep set's (residue bytes, ms saved, items)
FRONT_POINTS = 256  # fronts larger than this are thinned to this many memory buckets
CAP_LEVELS = 4  # `under_caps`: caps on the local peak tried per region
CAP_POINTS = 16  # ... and the sets kept per cap


@dataclass(frozen=True, eq=False)
class KeepSpace:
    """The keep sets of region `[x, y)` inside window `[a0, b0)`, as per-node terms.

    `nodes` are the candidates: keepable nodes the rerun runs. Per candidate: `residue`
    (bytes it adds to those held past the forward), `exports` (storages read after the
    window that it then holds past the forward), `saved_ms` (the rerun time it saves, its
    reach's included), `reach` (the steps the rerun may skip for it, F9: alone, or kept
    with others) and a row of `delta` (what it adds to each slot of `base.local`).
    `floor`: `base.local` plus every negative term, below which no keep set's slots go.
    `groups`: candidates whose reaches overlap (one lies in another's, or a step needs
    several), each with the steps every subset of it skips (`skips`, keyed by the subset's
    sorted candidate indices); `exact` False where a larger group's candidates are priced
    alone (`GROUP_MAX`), each with its whole reach.
    """

    base: WindowParts
    nodes: tuple[int, ...]
    residue: tuple[int, ...]
    exports: tuple[frozenset[int], ...]
    saved_ms: tuple[float, ...]
    delta: np.ndarray
    floor: np.ndarray
    reach: tuple[frozenset[int], ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    skips: Mapping[tuple[int, ...], frozenset[int]] = field(default_factory=dict)
    group_saved_ms: Mapping[tuple[int, ...], float] = field(default_factory=dict)
    exact: bool = True  # False: a group over GROUP_MAX, priced alone (savings an upper bound)

    @classmethod
    def analyse(cls, ctx: Context, a0: int, b0: int, x: int, y: int,
                external: frozenset[int] = frozenset(),
                skip: frozenset[int] = frozenset()) -> KeepSpace | None:
        """Per-node terms of region `[x, y)` in window `[a0, b0)` (`profile_parts`'s
        `external` and `skip`); None when the region never reruns."""
        p = ctx.p
        info = ctx.region(x, y)
        if not info.packs:
            return None
        base = profile_parts(ctx, a0, b0, [info], external, skip)
        nodes, residue, exports, chains, deltas = [], [], [], [], []
        for k in info.rules.run_steps(x):  # F6: those its rerun takes from the cache
            if p.can_keep(k):
                one = profile_parts(ctx, a0, b0, [ctx.region(x, y, [k])], external, skip)
                nodes.append(k)
                residue.append(one.residue_bytes - base.residue_bytes)
                exports.append(one.held_out - base.held_out)
                chains.append(dead_steps(p, info.rules, x, {k}))
                deltas.append(one.local - base.local)
        delta = (np.stack(deltas) if deltas
                 else np.zeros((0, len(base.local)), dtype=np.int64))
        reach = _reach(p, info.rules, x, nodes, chains)
        overlapping = _overlapping(nodes, reach)
        groups = tuple(g for g in overlapping if len(g) <= GROUP_MAX)
        skips = {subset: dead_steps(p, info.rules, x, {nodes[i] for i in subset})
                 for g in groups for subset in _subsets(g)}
        space = cls(base, tuple(nodes), tuple(residue), tuple(exports), (), delta,
                    base.local + np.minimum(delta, 0).sum(axis=0), tuple(reach), groups, skips,
                    exact=len(groups) == len(overlapping))
        return space.at_times(p.fwd_time_ms)

    def at_times(self, fwd_time_ms: Sequence[float], shift: int = 0) -> KeepSpace:
        """This space with each candidate's saving from `fwd_time_ms`, its nodes moved by
        `shift` (an identical block elsewhere in the chain: the same structure, its own
        times)."""
        def ms(nodes: Iterable[int]) -> float:
            return float(sum(fwd_time_ms[i + shift] for i in nodes))

        return replace(self, saved_ms=tuple(ms((k, *steps)) for k, steps in
                                            zip(self.nodes, self.reach, strict=True)),
                       group_saved_ms={subset: ms((*(self.nodes[i] for i in subset), *skipped))
                                       for subset, skipped in self.skips.items()})

    def saved_for(self, chosen: Iterable[int]) -> float:
        """The rerun time keeping candidates `chosen` (indices) saves: each one's own and
        its reach's, a group's subset priced as a whole."""
        idx = set(chosen)
        total = sum(self.saved_ms[i] for i in idx if i not in self._grouped)
        for g in self.groups:
            subset = tuple(i for i in g if i in idx)
            if subset:
                total += self.group_saved_ms[subset]
        return total

    def units(self, among: Iterable[int] | None = None) -> list[list[Option]]:
        """The candidates (`among`, default all) as independent units for a front: a
        candidate alone, or a group's every nonempty subset (of those among them)."""
        pick = set(range(len(self.nodes)) if among is None else among)
        out: list[list[Option]] = [[(self.residue[i], self.saved_ms[i], (i,))]
                                   for i in sorted(pick) if i not in self._grouped]
        for g in self.groups:
            members = tuple(i for i in g if i in pick)
            if members:
                out.append([(sum(self.residue[i] for i in sub), self.saved_for(sub), sub)
                            for sub in _subsets(members)])
        return out

    @cached_property
    def _grouped(self) -> frozenset[int]:
        return frozenset(i for g in self.groups for i in g)

    def parts(self, chosen: Iterable[int]) -> WindowParts:
        """The window's parts when the region keeps candidates `chosen` (indices), without
        the SAC overhead in `time_ms` (the solver adds the rerun time by position)."""
        idx = list(chosen)
        b = self.base
        return WindowParts(b.local + self.delta[idx].sum(axis=0), b.g_index,
                           b.residue_bytes + sum(self.residue[i] for i in idx),
                           b.held_out.union(*(self.exports[i] for i in idx)), b.time_ms)

    def choice(self, chosen: Iterable[int]) -> KeepChoice:
        """The real keep option of candidates `chosen`."""
        idx = tuple(sorted(set(chosen)))
        return KeepChoice(idx, sum(self.residue[i] for i in idx), self.saved_for(idx), True,
                          frozenset().union(*(self.exports[i] for i in idx)))

    def floor_parts(self, residue_bytes: int, held_out: frozenset[int]) -> WindowParts:
        """Parts no keep set holding at least `residue_bytes` more past the forward beats,
        at any slot (`floor_for`)."""
        b = self.base
        return WindowParts(self.floor_for(residue_bytes), b.g_index,
                           b.residue_bytes + residue_bytes, b.held_out | held_out, b.time_ms)

    def floor_for(self, residue_bytes: int) -> np.ndarray:
        """Per slot, at most what any keep set adding at least `residue_bytes` past the
        forward leaves live: `base.local` plus, slot by slot, the least the candidates'
        terms can add while their residues cover `residue_bytes` (a fractional cover,
        cheapest per byte first: a relaxation, so never above a real set's)."""
        cost, weight, before, lowers, local = self._by_ratio
        if not len(weight):
            return self.floor
        taken = np.clip((residue_bytes - before) / weight, 0.0, 1.0)
        # past the cover, what only lowers a slot (a rerun temporary saved) is taken too;
        # whole (not taken * cost + (1 - taken) * cost, whose rounding made the floor of a
        # larger residue one byte below a smaller one's)
        added = np.where(lowers, cost, taken * cost).sum(axis=0)
        return local + np.floor(added).astype(np.int64)

    @cached_property
    def _by_ratio(self) -> tuple[np.ndarray, ...]:
        """The terms of candidates with a residue, per slot in ascending order of term per
        residue byte, their residues in that order, the residues before each, where a term
        only lowers its slot, and `base.local` with what the candidates without a residue
        lower (`floor_for`'s parts that do not depend on the residue asked)."""
        paid = np.asarray(self.residue) > 0
        cost = self.delta[paid].astype(float)
        weight = np.asarray(self.residue, dtype=float)[paid]
        order = np.argsort(cost / weight[:, None], axis=0, kind="stable")
        cost, weight = np.take_along_axis(cost, order, axis=0), weight[order]
        free = np.minimum(self.delta[~paid], 0).sum(axis=0)
        return cost, weight, np.cumsum(weight, axis=0) - weight, cost < 0, \
            self.base.local + free


class KeepChoice(NamedTuple):
    """One keep option: candidate indices kept (none for an optimistic corner of a thinned
    front, `real=False`), the bytes it adds past the forward, the rerun time it saves, and
    the storages it hands on to the next window."""

    chosen: tuple[int, ...]
    residue_bytes: int
    saved_ms: float
    real: bool
    exported: frozenset[int]


def pareto_front(residue: Sequence[int], saved_ms: Sequence[float], *,
                 max_points: int = FRONT_POINTS, optimistic: bool = False
                 ) -> tuple[list[tuple[int, float, tuple[int, ...]]], bool]:
    """The subsets of items (`residue[i]` bytes, `saved_ms[i]`) on the front of least
    bytes and most time saved, as (bytes, ms, items) in ascending bytes; and whether it
    was thinned.

    Exact (a 0/1 knapsack's Pareto front, item by item) until it exceeds `max_points`;
    then it is thinned to one point per memory bucket: the bucket's real point saving the
    most (`optimistic=False`) or its corner of least bytes and most time saved, beaten by
    no subset of the bucket (`optimistic=True`: a lower bound, items meaningless).

    >>> [(r, s) for r, s, _ in pareto_front([4, 1, 2], [3.0, 1.0, 1.0])[0]]
    [(0, 0.0), (1, 1.0), (3, 2.0), (4, 3.0), (5, 4.0), (7, 5.0)]
    """
    units = [[(r, s, (i,))] for i, (r, s) in enumerate(zip(residue, saved_ms, strict=True))]
    return front_of(units, max_points=max_points, optimistic=optimistic)


def front_of(units: Sequence[Sequence[Option]], *, max_points: int = FRONT_POINTS,
             optimistic: bool = False) -> tuple[list[Option], bool]:
    """`pareto_front` over units of which a keep set takes at most one option each (a
    candidate, or one subset of a group: `KeepSpace.units`)."""
    front: list[Option] = [(0, 0.0, ())]
    thinned = False
    for options in units:
        useful = [o for o in options if o[1] > 0]
        if not useful:
            continue
        front = pareto(front + [(fr + r, fs + s, tuple(sorted((*items, *more))))
                                for fr, fs, items in front for r, s, more in useful],
                       cost=lambda e: e[0], loss=lambda e: -e[1])
        if len(front) > max_points:
            thinned = True
            front = _thin(front, max_points, optimistic)
    return front, thinned


def _thin(front: list[tuple], buckets: int, optimistic: bool) -> list[tuple]:
    """One entry per memory bucket of a front of (bytes, ms, items, ...) tuples (see
    `pareto_front`)."""
    first, last = bucket_ends([e[0] for e in front], buckets)
    # times grow along the front: a bucket's last point saves the most
    return [(front[f][0], front[la][1], ()) if optimistic else front[la]
            for f, la in zip(first.tolist(), last.tolist(), strict=True)]


def under_caps(space: KeepSpace, outside: np.ndarray | None = None, levels: int | None = None,
               max_points: int | None = None) -> list[tuple[int, ...]]:
    """Real keep sets (candidate indices) for tight budgets: per cap on the window's peak
    (`base.local` plus `outside`, the bytes outside the window per slot, e.g. gradients),
    from keeping nothing's up to the highest a front point reaches, the sets of a (bytes,
    time) front built only from sets within the cap (`max_points` per cap; ties go to
    the lower peak).

    A front point may keep an output that waits in the cache through the rerun's peak; at a
    budget that binds there, a set off the front fits where it does not. Which sets these
    are is a heuristic (a set over the cap is dropped, its supersets with it); the lower
    bound does not rest on it (`KeepSpace.floor_for`)."""
    levels, max_points = levels or CAP_LEVELS, max_points or CAP_POINTS
    local = space.base.local + (0 if outside is None else outside)

    def peak(vec: np.ndarray) -> int:
        return int((local + vec).max(initial=0))

    base = peak(np.zeros_like(local))
    front, _ = pareto_front(space.residue, space.saved_ms)
    top = max((peak(space.delta[list(items)].sum(axis=0)) for _, _, items in front),
              default=base)
    out: list[tuple[int, ...]] = []
    for q in range(levels):
        cap = base + (top - base) * q // levels
        states: list[tuple[int, float, tuple[int, ...], np.ndarray, int]] = [
            (0, 0.0, (), np.zeros_like(local), base)]
        for i, (r, ms) in enumerate(zip(space.residue, space.saved_ms, strict=True)):
            if ms <= 0:
                continue
            grown = [(sr + r, sm + ms, (*items, i), vec + space.delta[i])
                     for sr, sm, items, vec, _ in states]
            grown = [(*g, pk) for g in grown if (pk := peak(g[3])) <= cap]
            states = pareto(states + grown, cost=lambda e: (e[0], -e[1], e[4]),
                            loss=lambda e: -e[1])
            if len(states) > max_points:
                states = _thin(states, max_points, False)
        out.extend(e[2] for e in states if e[2])
    return out


def choices(space: KeepSpace, *, optimistic: bool = False, max_points: int | None = None,
            also: Iterable[Iterable[int]] = ()) -> tuple[list[KeepChoice], bool]:
    """The keep options of `space`, and whether a front was thinned.

    Real options (`optimistic=False`): per subset of the exporting candidates and the
    groups they are in (every subset up to `MAX_EXPORTS` of them; beyond, none, each one
    and all), the front of the others (`front_of`), each point with that subset; then
    `also`, further real sets (candidate indices): a front point beats each on bytes and
    time but may peak higher inside the window (its outputs wait longer in the cache), so
    the policies people write by hand are offered as they are.

    Optimistic options (the lower bound): one front over every candidate, each point
    handing on every storage any candidate exports (`KeepChoice.exported`): the next
    window then counts none of them, and this one only those its point keeps, so no real
    set's accounting goes below; corners (`real=False`) where the front was thinned.
    """
    points = max_points or FRONT_POINTS
    if optimistic:
        everything = frozenset().union(*space.exports)
        front, thinned = front_of(space.units(), max_points=points, optimistic=True)
        return [KeepChoice(items, r, s, not thinned, everything) for r, s, items in front
                if items or thinned], thinned
    # a group with an exporting member is enumerated with the exporting candidates
    exporting = {i for i, e in enumerate(space.exports) if e and space.saved_ms[i] > 0}
    exporting |= {i for g in space.groups if exporting.intersection(g) for i in g}
    plain = [i for i, e in enumerate(space.exports) if not e and i not in exporting]
    front, thinned = front_of(space.units(plain), max_points=points)
    fixed_pool = sorted(exporting)
    subsets = ([c for n in range(len(fixed_pool) + 1)
                for c in itertools.combinations(fixed_pool, n)]
               if len(fixed_pool) <= MAX_EXPORTS else
               [(), *((i,) for i in fixed_pool), tuple(fixed_pool)])
    out = [space.choice((*fixed, *items))
           for fixed in subsets for _, _, items in front if fixed or items]
    offered = {c.chosen for c in out}
    for extra in also:
        chosen = tuple(sorted(set(extra)))
        if chosen and chosen not in offered:
            offered.add(chosen)
            out.append(space.choice(chosen))
    return out, thinned


def _reach(p: Problem, rules: FrameRules, start: int, nodes: Sequence[int],
           chains: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """Per candidate, the steps its keeping may skip: those it skips alone (its chain) and
    those a least keep set holding it and others skips (F9, `skip_covers`); every step a
    rerun may skip where the sets are too many to follow (`COVERS_MAX`)."""
    covers = skip_covers(p, rules, start, nodes, COVERS_MAX)
    if covers is None:
        skippable = may_skip(p)
        anything = frozenset(i for i in rules.run_steps(start) if skippable[i])
        return [chain | anything for chain in chains]
    joint: dict[int, set[int]] = {}
    for step, sets in covers.items():
        for members in sets:
            if len(members) > 1:
                for k in members:
                    joint.setdefault(k, set()).add(step)
    return [chain | joint.get(k, set()) for k, chain in zip(nodes, chains, strict=True)]


def _overlapping(nodes: Sequence[int], chains: Sequence[frozenset[int]]
                 ) -> tuple[tuple[int, ...], ...]:
    """Candidates (indices) whose kept node plus reach overlap another's, grouped (the
    connected ones together); those alone are left out."""
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, (k, chain) in enumerate(zip(nodes, chains, strict=True)):
        for node in (k, *chain):
            j = owner.setdefault(node, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        groups.setdefault(root(i), []).append(i)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def _subsets(members: Sequence[int]) -> list[tuple[int, ...]]:
    """Every nonempty subset of `members`, each sorted."""
    return [c for n in range(1, len(members) + 1)
            for c in itertools.combinations(sorted(members), n)]
