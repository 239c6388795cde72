"""Lifetime views of a `Problem`: what keeps each storage alive in the forward (`uses`,
`readers`, `last_read`, a rerun's `rerun_read_end`), what the caller holds all step, what a
node's first forward holds beyond activations, and the gradient bytes of each backward event.
Schedule-independent; `Problem` caches each under the same name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from solvers.problem import ObservedBackward, Problem

__all__ = ["ACCUMULATION_COPIES", "GradientEvents", "caller_held", "fwd_event_bytes",
           "gradient_events", "last_read", "readers", "rerun_read_end", "storages_made",
           "uses", "uses_traced"]

# Gradient accumulation: a later reader's backward makes a fresh gradient (one copy) and
# autograd adds it into the buffer, in place when it holds the only reference to it, else
# out of place (a second copy while both live). Under a Python dispatch mode, such as
# MemTracker's, every tensor has a wrapper and the add is out of place (measured on ResNet
# joins: 0.24 % above a one-copy prediction); without one it is usually in place. Counting
# two copies errs high by one gradient at such events, never low.
ACCUMULATION_COPIES = 2


class GradientEvents(NamedTuple):
    """Per backward node j: gradient bytes live before it and made by it while it holds its
    saved tensors (see `Problem.gradient_events`)."""

    before: tuple[int, ...]
    added: tuple[int, ...]
    after: tuple[int, ...]  # live once node j's backward has run (its inputs' freed)
    # held when node j's backward first unpacks a saved tensor: what a checkpoint's rerun
    # that its unpack starts runs on top of (its gradient buffers, where it makes them
    # first: an in-place op on a view's CopySlices); `before` where not observed
    at_rerun: tuple[int, ...] = ()
    # held at node j's peak after the engine released j's saved tensors, where that is
    # above its event's gradients and temporaries: autograd sums j's fresh gradients into
    # buffers then (`release_variables` runs before `InputBuffer::add`), so that moment
    # holds none of what only j saved; 0 where the event itself is the larger
    released: tuple[int, ...] = ()

    def event(self, j: int) -> int:
        """Gradient bytes in backward event j's peak (its saved tensors still held)."""
        return self.before[j] + self.added[j]

    def releases(self, j: int) -> bool:
        """Whether node j's moment after its release can be above its event
        (`released`): the one place that says when the replay and the solvers count it."""
        return bool(self.released) and self.released[j] > 0


def uses(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """Per node, the storages it keeps alive up to itself: its inputs, those the program
    holds until it (`storage_release`), and the arguments of a module call it ends (the
    caller holds them while the call runs). Lifetimes follow these; what a node computes
    from, and what a checkpoint saves, follow `inputs`."""
    return _uses(problem, frozenset())


def uses_traced(problem: Problem, owners: Iterable[tuple[int, int]]
                ) -> tuple[tuple[int, ...], ...]:
    """`uses` when the calls spanning ``owners`` run as their fx traces (a plan
    checkpoints op ranges of them): a traced forward drops each of its values at its
    last use, as fx's generated code does, where the forward's Python locals lived
    until it returned. So a storage the call itself made (by its own ops, or returned
    to it by a child call) and the program held to no later than the call's end is
    held by its readers only."""
    owners = set(owners)
    if not owners:
        return problem.uses
    dropped: set[int] = set()
    release = problem.storage_release or []
    for call in problem.traced_calls or ():
        if (call.start, call.stop) not in owners:
            continue
        for s in storages_made(problem, call.start, call.stop):
            inside = next((c for c in call.children if c[0] <= problem.storage_producer[s]
                           < c[1]), None)
            if release[s] < call.stop and (inside is None or release[s] >= inside[1]):
                dropped.add(s)
    return _uses(problem, frozenset(dropped))


def storages_made(problem: Problem, start: int, stop: int) -> list[int]:
    """The storages nodes ``[start, stop)`` make."""
    return [s for i in range(start, stop) for s in problem.outputs[i]]


def _uses(problem: Problem, unheld: frozenset[int]) -> tuple[tuple[int, ...], ...]:
    """`uses`, the program's holds of ``unheld`` storages left out."""
    if problem.storage_release is None and not problem.module_spans:
        return problem.inputs
    held: list[list[int]] = [list(x) for x in problem.inputs]
    ends = [(s, node) for s, node in enumerate(problem.storage_release or ())
            if s not in unheld]
    ends += [(s, span.stop - 1) for span in problem.module_spans or () for s in span.inputs
             if span.kind == "call"]
    for s, node in ends:
        if problem.storage_producer[s] < node < problem.n_nodes and s not in held[node]:
            held[node].append(s)
    return tuple(tuple(x) for x in held)


def readers(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """Per storage, the nodes that keep it alive in forward (`uses`), ascending."""
    return problem.invert(problem.uses)


def last_read(problem: Problem) -> tuple[int, ...]:
    """Per storage, the last node that keeps it alive in forward (-1: none does)."""
    return tuple(c[-1] if c else -1 for c in problem.readers)


def rerun_read_end(problem: Problem, s: int, i: int, stop: int) -> int:
    """In a rerun of nodes up to `stop` (exclusive), the last step that keeps storage s
    made at node i alive: its last use there, or the rerun's last step when it is used
    past the early stop (the rerun's program holds it until it stops); -1 when nothing
    after i uses it. (`simulate` finds the same by replaying; accounting reads it here.)"""
    later = [c for c in problem.readers[s] if c > i]
    if later and later[-1] >= stop:
        return stop - 1
    return later[-1] if later else -1


def caller_held(problem: Problem) -> frozenset[int]:
    """Storages the caller holds for the whole step: the loss's outputs (not those its
    own backward saves) and those with `storage_release == n_nodes`."""
    n = problem.n_nodes
    held = set(problem.outputs[n - 1]) - set(problem.saved[n - 1])
    if problem.storage_release is not None:
        held |= {s for s, r in enumerate(problem.storage_release) if r >= n}
    return frozenset(held)


def fwd_event_bytes(problem: Problem) -> tuple[int, ...]:
    """What node i's first forward holds beyond the activations live then: its
    temporaries and `fwd_runtime_bytes` (a parallel runtime's, gradients freed after the
    forward; a rerun holds only the temporaries: it runs in the backward, whose events count
    the runtime)."""
    runtime = problem.fwd_runtime_bytes or [0] * problem.n_nodes
    return tuple(t + r for t, r in zip(problem.fwd_temp_bytes, runtime, strict=True))


def gradient_events(problem: Problem) -> GradientEvents:
    """The gradient bytes of each backward event, the same under every schedule.

    From `observed_backward` when the problem has it (its peaks include the nodes'
    temporaries, so `bwd_temp_bytes` are 0 then); else modelled: backward runs nodes in
    reverse order. The gradient of a storage appears during the
    backward of its last forward reader (in backward order, its first) and is freed
    after its producer's backward; the loss's gradient seed is held by the caller's
    ``backward()`` call until it returns. Each earlier reader makes a fresh gradient
    (during its event) that autograd then adds into the existing buffer, after the reader
    released its saved tensors: `ACCUMULATION_COPIES` of it at that moment (`released`).
    A parameter's ``.grad`` appears at the backward of its `param_grad_bytes` node and
    stays.
    """
    if problem.observed_backward is not None:  # what the engine did, not a model of it
        return _observed_events(problem.observed_backward)
    n = problem.n_nodes
    before, added, after, released = [0] * n, [0] * n, [0] * n, [0] * n
    live, grads = 0, set()
    seeds = {s for s in problem.grad_inputs[n - 1] if s in problem.caller_held}
    seeds |= {s for s in problem.outputs[n - 1] if not problem.consumers[s]}
    for j in range(n - 1, -1, -1):
        new = [s for s in problem.grad_inputs[j] if problem.storage_grad_bytes[s] > 0
               and problem.grad_consumers[s][-1] == j]
        if j == n - 1:
            new += [s for s in problem.outputs[j]
                    if problem.storage_grad_bytes[s] > 0 and not problem.consumers[s]]
        new = [s for s in dict.fromkeys(new) if s not in grads]
        before[j] = live
        made = sum(problem.storage_grad_bytes[s] for s in new) + problem.param_grad_bytes[j]
        fresh = sum(problem.storage_grad_bytes[s] for s in set(problem.grad_inputs[j])
                    if s in grads and s not in new)
        added[j] = made + fresh
        grads.update(new)
        live += made
        for s in problem.outputs[j]:
            if s in grads and s not in seeds:
                grads.discard(s)
                live -= problem.storage_grad_bytes[s]
        after[j] = live
        summed = live + ACCUMULATION_COPIES * fresh
        if fresh and summed > before[j] + added[j] + problem.bwd_temp_bytes[j]:
            released[j] = summed
    return GradientEvents(tuple(before), tuple(added), tuple(after), tuple(before),
                          tuple(released))


def _observed_events(obs: ObservedBackward) -> GradientEvents:
    """`gradient_events` as observed: a node's event holds its peak while its saved
    tensors were held (`held`, where observed), the rest comes after its release."""
    held = obs.held if obs.held is not None else obs.peak
    return GradientEvents(
        tuple(obs.before), tuple(h - b for b, h in zip(obs.before, held, strict=True)),
        tuple(obs.after), tuple(obs.unpack if obs.unpack is not None else obs.before),
        tuple(pk if pk > h else 0 for h, pk in zip(held, obs.peak, strict=True)))
