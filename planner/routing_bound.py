"""Profiles at forced routings, for a plan that holds for every routing (`solvers.routing`).

A step whose routed experts loop over the experts a batch's tokens went to is profiled
again at balanced counts (the profile the solvers plan on) and once per other expert with
tokens moved to it from expert 0: ``E`` profiles in all, none of them depending on what the
router computes (on the fake process group its weights are placeholders).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from planner.sharding import Sharding, rank_problem
from profiles.routing import balanced_counts, moved_counts, routed_experts, routing_forced
from profiles.schema import GraphProfile
from solvers.from_profile import problem_from_profile
from solvers.routing import RoutingError, RoutingSpread, problem_shift

log = logging.getLogger(__name__)

MAX_EXPERTS = 16  # a bound costs a profile and a replay per expert of a layer


def routing_bound(model: nn.Module, profile_again: Callable[..., GraphProfile],
                  sharding: Sharding | None, progress: bool = False
                  ) -> tuple[GraphProfile, RoutingSpread] | None:
    """The step profiled at balanced counts and how its problem moves with the routing
    (each profile with a progress bar when ``progress``);
    None where no bound can be made (experts not routed by an argument, layers of other
    sizes, more than `MAX_EXPERTS` experts, too few tokens to move one and keep every
    expert hit, or a step that changes otherwise with the counts): the plan then says it
    holds for the profiled routing."""
    found = routed_experts(model)
    if len({routed.experts for routed in found}) != 1:
        log.info("%s: no routed experts module takes the routing as an argument "
                 "(profiles.routing.ROUTING_ARGUMENTS): no bound over routings",
                 type(model).__name__)
        return None
    with routing_forced(found, balanced_counts):
        base = profile_again(progress=progress)
    calls = {call for routed in found for call in routed.calls}
    if len(calls) != 1:
        log.info("%s: routed layers of other token counts %s: no bound over routings",
                 type(model).__name__, sorted(calls))
        return None
    ((tokens, top_k),) = calls
    experts = found[0].experts
    if experts > MAX_EXPERTS:
        log.info("%s: %d experts per layer, more than the %d a bound profiles for: no "
                 "bound over routings", type(model).__name__, experts, MAX_EXPERTS)
        return None
    counts = balanced_counts(tokens, top_k, experts)
    step = min(counts[0] - 1, tokens - max(counts[1:]))
    if step < 1:
        log.info("%s: %d tokens to %d of %d experts leave none to move: no bound over "
                 "routings", type(model).__name__, tokens, top_k, experts)
        return None
    problem = rank_problem(problem_from_profile(base), sharding)
    shifts = []
    log.info("bounding %s's memory over every routing: %d more profiles",
             type(model).__name__, experts - 1)
    try:
        for to in range(1, experts):
            with routing_forced(found, lambda t, k, e, to=to: moved_counts(
                    balanced_counts(t, k, e), to, step)):
                moved = profile_again(progress=progress)
            shifts.append(problem_shift(problem, rank_problem(problem_from_profile(moved),
                                                              sharding)))
    except RoutingError as error:
        log.info("no bound over routings: %s", error)
        return None
    layers = sum(1 for m in model.modules() if any(isinstance(m, r.cls) for r in found))
    return base, RoutingSpread(tokens=tokens, top_k=top_k, experts=experts,
                               base_counts=counts, step=step, shifts=shifts, layers=layers)
