"""Schedules: the node order cut into consecutive STORE / RECOMPUTE regions.

A RECOMPUTE region is one `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` call
on its `target`: a module call, or an op range of a module's traced forward. Its decisions
are data (`solvers.decision`): `saves` maps some of its own nodes (nodes not inside a child;
a child has its own `saves`) to their `Decision`: `Decision.KEEP`
(`CheckpointPolicy.MUST_SAVE`, selective checkpointing), or, for a top-level checkpoint
inside an offloaded call, `Decision.OFFLOAD` (saved as KEEP is, then moved to the host by
the call's hooks); a node it does not name is recomputed (`Decision.RECOMPUTE`).
`children` are checkpoints nested inside it. `Schedule.decisions` says every node's
decision, offloads included.

`Schedule.offloads` name module calls whose saved activations go to host memory: every
tensor saved for backward while the call runs outside a checkpoint (`solvers.offload` says
which storages that is) is copied to the host during the forward (its device side let go
at the end of the call named by its `release`) and prefetched back when the backward
reaches the output of the call named by its `prefetch`; so are the outputs its top-level
checkpoints save as OFFLOAD, one by one, while the ones they KEEP stay on the device.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from solvers.decision import CHECKPOINT_DEFAULT, RULES, Decision

__all__ = ["RECOMPUTE", "STORE", "Mode", "ModuleCall", "Offload", "OpRange", "Region",
           "Schedule", "ScheduleError"]

Mode = Literal["store", "recompute"]
STORE: Mode = "store"
RECOMPUTE: Mode = "recompute"


class ScheduleError(ValueError):
    """A schedule is malformed or does not fit its problem."""


class ModuleCall(BaseModel):
    """A region's target: one call of the module at `path` ('' is the model itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["module"] = "module"
    path: str


class OpRange(BaseModel):
    """A region's target: consecutive segments of the traced forward of the module at
    `path` (`profiles.traced`), from fx node `first` through fx node `last`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["ops"] = "ops"
    path: str
    first: str
    last: str


Target = Annotated[ModuleCall | OpRange, Field(discriminator="kind")]


class Region(BaseModel):
    """Nodes `start..stop-1`, stored or recomputed.

    `keep=` is shorthand for `saves={node: Decision.KEEP}`; `.keep` reads back the nodes it
    saves (KEEP, or OFFLOAD: saved, then moved), `decision(node)` any node's. A `saves`
    entry of RECOMPUTE says what leaving the node out says, and is dropped.

    >>> Region(0, 3, "recompute", keep=[1]).describe()
    'R[0:3 keep=1]'
    >>> Region(0, 3, "recompute", saves={1: "keep", 2: "recompute"}).saves
    {1: <Decision.KEEP: 'keep'>}
    >>> Region(0, 3, "recompute", saves={1: "keep", 2: "offload"}).describe()
    'R[0:3 keep=1 offload=2]'
    >>> outer = Region(0, 6, "recompute", children=[Region(2, 4, "recompute")])
    >>> [r.describe() for r in outer.walk()]
    ['R[0:6 (R[2:4])]', 'R[2:4]']
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int
    stop: int
    mode: Mode = STORE
    saves: dict[int, Decision] = {}
    target: Target | None = None
    children: tuple[Region, ...] = ()

    def __init__(self, start: int | None = None, stop: int | None = None,
                 mode: Mode = STORE, keep: Iterable[int] = (),
                 children: Iterable[Region] = (), **data: Any) -> None:
        if start is not None:
            data["start"] = start
        if stop is not None:
            data["stop"] = stop
        data.setdefault("mode", mode)
        data.setdefault("saves", dict.fromkeys(sorted(keep), Decision.KEEP))
        data.setdefault("children", tuple(children))
        super().__init__(**data)

    def __hash__(self) -> int:
        return hash((self.start, self.stop, self.mode, frozenset(self.saves.items()),
                     self.target, self.children))

    @field_validator("saves", mode="after")
    @classmethod
    def _decided(cls, saves: dict[int, Decision]) -> dict[int, Decision]:
        """Saves in node order, without RECOMPUTE (a node not named is recomputed). Where
        OFFLOAD may stand the schedule checks (`Schedule`: a top-level checkpoint inside an
        offloaded call, whose hooks move it)."""
        return {k: saves[k] for k in sorted(saves) if saves[k] is not CHECKPOINT_DEFAULT}

    @model_validator(mode="after")
    def _validate(self) -> Region:
        if not 0 <= self.start < self.stop:
            raise ScheduleError(f"region [{self.start}, {self.stop}) is empty or negative.")
        if self.mode == STORE and (self.saves or self.children or self.target):
            raise ScheduleError(
                f"STORE region [{self.start}, {self.stop}) has saves/children/a target; only "
                f"RECOMPUTE regions are checkpoints, decide what they save or nest others."
            )
        pos = self.start
        for c in self.children:
            if c.mode != RECOMPUTE:
                raise ScheduleError(f"child [{c.start}, {c.stop}) must be a RECOMPUTE region.")
            if c.start < pos or c.stop > self.stop:
                raise ScheduleError(
                    f"child [{c.start}, {c.stop}) of region [{self.start}, {self.stop}) must lie "
                    f"inside it, sorted and not overlapping its siblings."
                )
            pos = c.stop
        for k in self.saves:
            if not self.start <= k < self.stop:
                raise ScheduleError(f"saved node {k} is outside region [{self.start}, "
                                    f"{self.stop}).")
            if any(c.start <= k < c.stop for c in self.children):
                raise ScheduleError(
                    f"saved node {k} lies in a child region; put it in that child's saves."
                )
        return self

    @property
    def keep(self) -> frozenset[int]:
        """The nodes whose outputs this region saves rather than reruns (`Decision.KEEP`, and
        `Decision.OFFLOAD`: saved the same way, then moved by the offload hooks)."""
        return frozenset(k for k, save in self.saves.items() if not RULES[save].reruns)

    def offloaded(self) -> frozenset[int]:
        """The nodes whose saved outputs the offload hooks move (`Decision.OFFLOAD`)."""
        return frozenset(k for k, save in self.saves.items() if RULES[save].copies)

    def decision(self, node: int) -> Decision:
        """What this region does with one of its own nodes' outputs (not a child's)."""
        return self.saves.get(node, CHECKPOINT_DEFAULT)

    def with_targets(self, target_of: Mapping[tuple[int, int], ModuleCall | OpRange]
                     ) -> Region:
        """This region with every RECOMPUTE region's target looked up by its span."""
        children = tuple(c.with_targets(target_of) for c in self.children)
        target = target_of.get((self.start, self.stop)) if self.is_recompute else None
        return self.model_copy(update={"target": target, "children": children})

    @property
    def is_recompute(self) -> bool:
        """True for a checkpointed region."""
        return self.mode == RECOMPUTE

    def walk(self) -> Iterator[Region]:
        """This region and its descendants, pre-order."""
        yield self
        for c in self.children:
            yield from c.walk()

    def describe(self) -> str:
        """Compact text, e.g. `R[0:3 keep=1 (R[1:2])]`."""
        if not self.is_recompute:
            return f"S[{self.start}:{self.stop}]"
        parts = [f"R[{self.start}:{self.stop}"]
        on_device, moved = self.keep - self.offloaded(), self.offloaded()
        if on_device:
            parts.append(" keep=" + ",".join(map(str, sorted(on_device))))
        if moved:
            parts.append(" offload=" + ",".join(map(str, sorted(moved))))
        if self.children:
            parts.append(" (" + " ".join(c.describe() for c in self.children) + ")")
        return "".join(parts) + "]"


class Offload(BaseModel):
    """One module call (nodes `start..stop-1`) whose saved activations go to host memory.

    `prefetch` is the span of the call whose output's gradient issues their copy back (the
    backward of its last node; a later call than this one); None: when first needed.
    `release` is the span of the call at whose end (its forward hook) the copies out are
    waited for and their device side let go: one that ends with or after this one, so the
    copies can run beside its compute; None: this call's own end.

    >>> Offload(start=0, stop=4, target=ModuleCall(path="h.0"), prefetch=(8, 12)).describe()
    'O[0:4 h.0 <-8:12]'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int
    stop: int
    target: ModuleCall | None = None
    prefetch: tuple[int, int] | None = None
    prefetch_target: ModuleCall | None = None
    release: tuple[int, int] | None = None
    release_target: ModuleCall | None = None

    @model_validator(mode="after")
    def _validate(self) -> Offload:
        if self.release is not None and self.release[1] < self.stop:
            raise ScheduleError(
                f"offload [{self.start}, {self.stop}) is released at the end of "
                f"{list(self.release)}, which ends before it: its copies out are waited for "
                "at the end of a call that ends with it or later.")
        if not 0 <= self.start < self.stop:
            raise ScheduleError(f"offload [{self.start}, {self.stop}) is empty or negative.")
        if self.prefetch is not None and not self.start < self.prefetch[1] - 1:
            raise ScheduleError(
                f"offload [{self.start}, {self.stop}) is prefetched at the output of "
                f"{list(self.prefetch)}, which ends before it: a prefetch is issued by a "
                "call that the backward reaches first, one that ends later in the forward.")
        return self

    def with_targets(self, target_of: Mapping[tuple[int, int], ModuleCall | OpRange]
                     ) -> Offload:
        """The same offload, its call and its prefetch's and release's calls looked up by
        their spans."""
        def call(span: tuple[int, int] | None) -> ModuleCall | None:
            target = None if span is None else target_of.get(span)
            return target if isinstance(target, ModuleCall) else None

        return self.model_copy(update={"target": call((self.start, self.stop)),
                                       "prefetch_target": call(self.prefetch),
                                       "release_target": call(self.release)})

    def describe(self) -> str:
        """Compact text, e.g. `O[0:4 h.0 <-8:12]` (prefetched at 8:12's output; `->4:8`:
        released at 4:8's end)."""
        name = f" {self.target.path or '<model>'}" if self.target is not None else ""
        fetch = f" <-{self.prefetch[0]}:{self.prefetch[1]}" if self.prefetch else ""
        free = f" ->{self.release[0]}:{self.release[1]}" if self.release else ""
        return f"O[{self.start}:{self.stop}{name}{fetch}{free}]"


def _inside(region: Region, offloads: Iterable[Offload]) -> bool:
    """Whether ``region`` runs inside one of the offloaded calls (whose hooks move what it
    saves as OFFLOAD)."""
    return any(o.start <= region.start and region.stop <= o.stop for o in offloads)


class Schedule(BaseModel):
    """Consecutive top-level regions covering nodes 0..n-1 in order, and the module calls
    whose saved activations are offloaded (disjoint, in node order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    regions: tuple[Region, ...]
    offloads: tuple[Offload, ...] = ()

    @model_validator(mode="after")
    def _validate(self) -> Schedule:
        if not self.regions:
            raise ScheduleError("a schedule needs at least one region.")
        pos = 0
        for r in self.regions:
            if r.start != pos:
                raise ScheduleError(
                    f"region [{r.start}, {r.stop}) should start at {pos}: top-level regions "
                    f"must be consecutive and cover every node from 0."
                )
            pos = r.stop
        self._validate_offloads()
        return self

    def _validate_offloads(self) -> None:
        pos = 0
        for o in self.offloads:
            if o.start < pos or max(o.stop, *(o.prefetch or (0,)),
                                    *(o.release or (0,))) > self.n_nodes:
                raise ScheduleError(
                    f"offload [{o.start}, {o.stop}) overlaps the one before it or ends past "
                    f"node {self.n_nodes}: offloaded calls are disjoint, in node order.")
            pos = o.stop
        for top in self.regions:
            for region in top.walk():
                moved = sorted(region.offloaded())
                if moved and (region is not top or not _inside(top, self.offloads)):
                    raise ScheduleError(
                        f"nodes {moved} of checkpoint [{region.start}, {region.stop}) are "
                        "offloaded, which only a top-level checkpoint inside an offloaded "
                        "call does (its call's hooks move them): offload the call around it "
                        "(Schedule.with_offloads), or keep them (Decision.KEEP).")

    @property
    def n_nodes(self) -> int:
        """Number of nodes covered."""
        return self.regions[-1].stop

    @classmethod
    def store_all(cls, n: int) -> Schedule:
        """No checkpointing."""
        return cls(regions=(Region(0, n, STORE),))

    @classmethod
    def from_segments(
        cls,
        n: int,
        recompute: Iterable[tuple[int, int] | Region],
        *,
        keep: Iterable[int] = (),
    ) -> Schedule:
        """Recompute the given `(start, stop)` segments (or Regions), store the gaps.

        `keep` lists nodes saved by selective checkpointing; each goes to the segment holding
        it.

        >>> Schedule.from_segments(6, [(0, 3)]).describe()
        'R[0:3] S[3:6]'
        >>> Schedule.from_segments(8, [(5, 8), (1, 3)], keep=[6]).describe()
        'S[0:1] R[1:3] S[3:5] R[5:8 keep=6]'
        """
        keep_set = set(keep)
        segs: list[Region] = []
        for seg in sorted(recompute, key=lambda s: s.start if isinstance(s, Region) else s[0]):
            if isinstance(seg, Region):
                segs.append(seg)
            else:
                a, b = seg
                segs.append(Region(a, b, RECOMPUTE, keep={k for k in keep_set if a <= k < b}))
        regions: list[Region] = []
        pos = 0
        for r in segs:
            if r.start > pos:
                regions.append(Region(pos, r.start, STORE))
            regions.append(r)
            pos = r.stop
        if pos < n:
            regions.append(Region(pos, n, STORE))
        covered = {k for r in segs for k in range(r.start, r.stop)}
        if keep_set - covered:
            raise ScheduleError(f"kept nodes {sorted(keep_set - covered)} are not recomputed.")
        return cls(regions=tuple(regions))

    @classmethod
    def from_modes(cls, modes: Sequence[Mode]) -> Schedule:
        """One top-level region per run of equal consecutive modes (no keep, no nesting).

        >>> Schedule.from_modes(["store", "recompute", "recompute", "store"]).describe()
        'S[0:1] R[1:3] S[3:4]'
        """
        regions: list[Region] = []
        start = 0
        for i in range(1, len(modes) + 1):
            if i == len(modes) or modes[i] != modes[start]:
                regions.append(Region(start, i, modes[start]))
                start = i
        return cls(regions=tuple(regions))

    def with_targets(self, target_of: Mapping[tuple[int, int], ModuleCall | OpRange]
                     ) -> Schedule:
        """The same schedule, each RECOMPUTE region's and offload's target looked up by its
        span."""
        return self.model_copy(update={
            "regions": tuple(r.with_targets(target_of) for r in self.regions),
            "offloads": tuple(o.with_targets(target_of) for o in self.offloads)})

    def with_offloads(self, offloads: Iterable[Offload | tuple[int, int]], *,
                      move_keeps: bool | Collection[int] = True) -> Schedule:
        """The same regions, offloading the given calls (Offloads or `(start, stop)` spans,
        prefetched when first needed). With ``move_keeps`` the top-level checkpoints inside
        them move what they keep (KEEP becomes OFFLOAD), or only the nodes it lists; else
        their saves stay as they are (a choice per node). Outside every offloaded call,
        OFFLOAD becomes KEEP.

        >>> Schedule.store_all(6).with_offloads([(0, 2), Offload(start=2, stop=4,
        ...                                      prefetch=(4, 6))]).describe()
        'S[0:6] O[0:2] O[2:4 <-4:6]'
        >>> Schedule.from_segments(6, [(1, 4)], keep=[2]).with_offloads([(0, 5)]).describe()
        'S[0:1] R[1:4 offload=2] S[4:6] O[0:5]'
        >>> Schedule.from_segments(6, [(1, 4)], keep=[2, 3]).with_offloads(
        ...     [(0, 5)], move_keeps={3}).describe()
        'S[0:1] R[1:4 keep=2 offload=3] S[4:6] O[0:5]'
        """
        spans = tuple(o if isinstance(o, Offload) else Offload(start=o[0], stop=o[1])
                      for o in offloads)
        regions = []
        for top in self.regions:
            inside = _inside(top, spans)
            saves = {k: Decision.OFFLOAD if inside and d is Decision.KEEP and (
                         move_keeps is True or (move_keeps is not False and k in move_keeps))
                     else Decision.KEEP if not inside and d is Decision.OFFLOAD else d
                     for k, d in top.saves.items()}
            regions.append(top if saves == top.saves else top.model_copy(update={"saves": saves}))
        return Schedule(regions=tuple(regions), offloads=spans)

    def walk(self) -> Iterator[Region]:
        """All regions, pre-order."""
        for r in self.regions:
            yield from r.walk()

    def recompute_regions(self) -> list[Region]:
        """Every RECOMPUTE region, nested ones included, pre-order."""
        return [r for r in self.walk() if r.is_recompute]

    def recomputed_nodes(self) -> frozenset[int]:
        """Nodes inside some RECOMPUTE region (kept ones included).

        >>> sorted(Schedule.from_segments(6, [(1, 3), (4, 6)], keep=[5]).recomputed_nodes())
        [1, 2, 4, 5]
        """
        return frozenset(k for r in self.regions if r.is_recompute for k in range(r.start, r.stop))

    def decisions(self) -> list[Decision]:
        """Each node's `Decision`: in a checkpoint, what its innermost one decides (`saves`);
        outside checkpoints KEEP, or OFFLOAD inside an offloaded call (`solvers.offload`
        says which storages move).

        >>> s = Schedule.from_segments(6, [(1, 4)], keep=[2, 3]).with_offloads([(0, 5)])
        >>> "".join(d.value[0] for d in s.decisions())
        'oroook'
        >>> per_node = Region(1, 4, "recompute", saves={2: "offload", 3: "keep"})
        >>> s = Schedule(regions=(Region(0, 1), per_node, Region(4, 6)),
        ...              offloads=(Offload(start=0, stop=5),))
        >>> "".join(d.value[0] for d in s.decisions())
        'orokok'
        """
        decided = [Decision.KEEP] * self.n_nodes
        for o in self.offloads:
            decided[o.start:o.stop] = [Decision.OFFLOAD] * (o.stop - o.start)
        for region in self.recompute_regions():  # pre-order: the innermost decides last
            for i in range(region.start, region.stop):
                decided[i] = region.decision(i)
        return decided

    def describe(self) -> str:
        """Compact text, e.g. `R[0:2] S[2:5]` (offloads after the regions)."""
        return " ".join([r.describe() for r in self.regions]
                        + [o.describe() for o in self.offloads])
