"""solve / replan: plans from a profiled step at a budget, by the named solver or, with
offload, the joint one; the error for a budget no schedule meets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import Any

from planner.arguments import SolveOptions, _budget_arg
from planner.config import SEARCH, PlanConfig, shows_options
from planner.plan import GIB, InfeasibleBudgetError, InputSpec, Plan, SolverReport, format_bytes
from planner.profiling import ProfiledStep
from planner.runtime.offload import KEEPS_THROUGH_HOOKS
from planner.sharding import Sharding, rank_problem
from planner.solution_memo import ANSWERS, problem_digest
from profiles.progress import _bar
from profiles.schema import GraphProfile
from solvers import SOLVERS, Problem, Schedule, Solution, Status, deterministic_solver, simulate
from solvers import joint as solvers_joint
from solvers.auto import lowest_peak
from solvers.choice_bound import choice_bound
from solvers.from_profile import problem_from_profile, span_targets
from solvers.routing import RoutingSpread, routed_problem, worst_routing
from solvers.simulate import optimizer_step_peak

log = logging.getLogger(__name__)


@shows_options(SEARCH)
def solve(profiled: ProfiledStep, budget_gb: float | None = None, *,
          budget_bytes: int | None = None, config: PlanConfig | None = None,
          **options: Any) -> Plan:
    """Plan a step profiled by :func:`profile_model` at ``budget_gb`` (or ``budget_bytes``);
    call it as often as you like, each call solves without profiling. Options: the search's
    fields of :class:`~planner.config.PlanConfig` (``solver``, ``time_limit_s``,
    ``offload``, ``host_budget_gb``, ``op_ranges``, ``deterministic``), as in
    :func:`optimize`.

    >>> step = profile_model(model, batch, loss_fn=loss_fn)  # doctest: +SKIP
    >>> plans = [solve(step, budget_gb=b) for b in (4, 6, 8)]  # doctest: +SKIP
    """
    if not isinstance(profiled, ProfiledStep):
        raise TypeError(f"solve() takes what profile_model() returns, not "
                        f"{type(profiled).__name__}; for a Plan use replan(plan, budget_gb=...)")
    return solve_profiled(profiled, PlanConfig.of(config, options, "solve()", (SEARCH,))
                          .solve_options(_budget_arg(budget_gb, budget_bytes)))


def solve_profiled(profiled: ProfiledStep, options: SolveOptions) -> Plan:
    """`solve` with its options checked: the plan, with the profile's notes."""
    plan = plan_for_profile(profiled.profile, profiled.inputs, profiled.structure, options,
                            sharding=profiled.sharding, routing=profiled.routing)
    if profiled.notes:
        plan = plan.model_copy(update={"note": " ".join(filter(None, [plan.note,
                                                                      *profiled.notes]))})
    return plan


@shows_options(SEARCH)
def replan(plan: Plan, budget_gb: float | None = None, *, budget_bytes: int | None = None,
           config: PlanConfig | None = None, **options: Any) -> Plan:
    """A plan for the same model, inputs and precision at another budget (no profiling);
    options as :func:`solve`'s.

    >>> cheaper = replan(plan, budget_gb=6)  # doctest: +SKIP
    """
    solve_options = PlanConfig.of(config, options, "replan()", (SEARCH,)).solve_options(
        _budget_arg(budget_gb, budget_bytes))
    if plan.compiled is not None:
        raise ValueError(f"this plan is for a compiled step (compiled={plan.compiled.mode!r}), "
                         "whose peak is measured on the model, not replayed from the "
                         "profile: plan again with planner.optimize(model, batch, "
                         f"budget_gb=..., compiled={plan.compiled.mode!r})")
    return plan_for_profile(plan.profile, plan.inputs, plan.structure_fingerprint,
                            solve_options, sharding=plan.sharding, routing=plan.routing)


LOWEST_PEAK_SHARE = 0.25  # of the time limit, at least, for the lowest peak (infeasible)


ROUTING_ROUNDS = 6  # solves, each at the routing the last plan peaked worst at


def plan_for_profile(prof: GraphProfile, inputs: list[InputSpec], structure: str,
                     options: SolveOptions, sharding: Sharding | None = None,
                     routing: RoutingSpread | None = None) -> Plan:
    """The solving half of :func:`optimize`, for a profile already taken. With ``routing``
    the budget holds for every routing (`_plan_for_every_routing`)."""
    if routing is None:
        return _plan_at(prof, inputs, structure, options, sharding)
    return _plan_for_every_routing(prof, inputs, structure, options, sharding, routing)


def _plan_for_every_routing(prof: GraphProfile, inputs: list[InputSpec], structure: str,
                            options: SolveOptions, sharding: Sharding | None,
                            routing: RoutingSpread) -> Plan:
    """A plan whose worst routing (`solvers.routing`) fits the budget. Each round solves
    the step as it runs at the routing the last plan peaked worst at (first the profiled
    one); where that routing was solved already, at the budget less what the worst still
    adds. The lowest worst peak found is the error's plan."""
    budget_bytes, solve_at = options.budget_bytes, options.budget_bytes
    counts: tuple[int, ...] | None = None
    tried: set[tuple[tuple[int, ...] | None, int]] = set()
    best: Plan | None = None
    for _ in range(ROUTING_ROUNDS):
        tried.add((counts, solve_at))
        try:
            plan, met = _plan_at(prof, inputs, structure, options.at(solve_at), sharding,
                                 routing, counts), True
        except InfeasibleBudgetError as error:
            if error.plan is None:
                raise
            plan, met = error.plan, False
        if best is None or plan.predicted_peak_bytes < best.predicted_peak_bytes:
            best = plan
        if plan.predicted_peak_bytes <= budget_bytes:
            return plan.model_copy(update={"budget_bytes": budget_bytes})
        worst = plan.worst_routing
        at = None if list(worst.counts) == routing.base_counts else worst.counts
        if (at, solve_at) not in tried:
            counts = at
        elif met:
            solve_at -= worst.peak_bytes - budget_bytes
        else:
            break
        log.info("the worst routing peaks %s over the budget: solving at %s for counts %s",
                 format_bytes(worst.peak_bytes - budget_bytes), format_bytes(solve_at),
                 list(counts or routing.base_counts))
    raise _infeasible_for_every_routing(best, budget_bytes, prof, sharding, options)


def _infeasible_for_every_routing(plan: Plan, budget_bytes: int, prof: GraphProfile,
                                  sharding: Sharding | None,
                                  options: SolveOptions) -> InfeasibleBudgetError:
    """The error for a budget no plan found meets at every routing: the lowest worst peak
    found, and its plan (error.plan), which a budget at that peak returns."""
    peak = plan.predicted_peak_bytes
    plan = plan.model_copy(update={"budget_bytes": peak})
    problem = plan.problem()
    head = (f"No checkpointing plan of {prof.model_name} found fits "
            f"{format_bytes(budget_bytes)} at every routing of its experts: the lowest "
            f"worst-routing peak found is {format_bytes(peak, round_up=True)} ({peak} "
            f"bytes); ")
    static = problem.static_bytes + sum(problem.param_grad_bytes)
    rest = (f" Static memory alone is {format_bytes(static)}"
            f"{' per rank' if sharding else ''}. Raise the budget or shrink the batch.")
    offload = _offload_hint(problem, options)
    return InfeasibleBudgetError(
        f"{head}that plan is error.plan, and optimize(..., budget_gb=error.min_budget_gb) "
        f"returns it.{rest}{offload.format_map(_PYTHON)}", peak, None, plan,
        shell_message=f"{head}--budget-gb {peak / GIB!r} returns that plan.{rest}"
                      f"{offload.format_map(_SHELL)}")


def _plan_at(prof: GraphProfile, inputs: list[InputSpec], structure: str,
             options: SolveOptions, sharding: Sharding | None,
             routing: RoutingSpread | None = None,
             counts: tuple[int, ...] | None = None) -> Plan:
    """The plan of the profiled step at ``options``' budget; with ``routing``, solved for
    the step at ``counts`` tokens per expert (None: the profiled counts)."""
    started = perf_counter()
    profiled = rank_problem(problem_from_profile(prof, op_ranges=options.op_ranges),
                            sharding)
    problem = profiled if counts is None else routed_problem(profiled, routing, list(counts))
    budget_bytes = options.budget_bytes
    made = _PlanMaker(prof, inputs, structure, sharding, profiled, options, routing)
    unplanned = simulate(problem, Schedule.store_all(problem.n_nodes))
    if unplanned.peak_bytes <= budget_bytes:
        report = SolverReport(name="none", status=Status.OPTIMAL.value, objective_ms=0.0,
                              bound_ms=0.0, gap=0.0, solve_time_s=0.0,
                              space="every schedule (nothing is recomputed)")
        note = (f"No checkpointing needed: the unplanned step peaks at "
                f"{format_bytes(unplanned.peak_bytes)}, within the budget.")
        log.debug(note)  # the plan says it (summary, note); the CLI logs at INFO
        return made(Schedule.store_all(problem.n_nodes), budget_bytes, report, note)
    log.info("solving with %s: %d nodes, %d module calls, budget %s", options.solver,
             problem.n_nodes, len(problem.module_spans or ()), format_bytes(budget_bytes))
    # the solvers stop a little after their limit (CP-SAT's last model, the final replay),
    # and building the problem has taken time already: the solver gets what is left less a
    # margin, so that time_limit_s holds for the whole call (when a plan meets the budget)
    left = max(0.05, options.time_limit_s - _margin(options.time_limit_s)
               - _spent(options, started))
    digest = problem_digest(problem)
    solution, stopped = ANSWERS.get(digest, options), False
    if solution is None:  # identical calls get identical plans (`solution_memo`)
        solution, stopped = _searched(prof, problem, options, left, started)
        named = ANSWERS.minimum(digest, options)
        if named is not None and (solution.peak_bytes is None
                                  or solution.peak_bytes > budget_bytes):
            solution = named  # an error named this budget: its plan, if the search missed it
        ANSWERS.put(digest, options, solution)
    else:
        log.info("%s: the plan of an identical call at this budget and these options",
                 problem.name)
    if solution.peak_bytes is None or solution.peak_bytes > budget_bytes:
        at_minimum = made(solution.schedule, solution.peak_bytes, _report(solution),
                          record_offload=False)
        if routing is None:  # a bound over routings names its own minimum
            _remember_minimum(digest, options, solution, at_minimum)
        raise _infeasible(prof, problem, options, solution, at_minimum, stopped)
    report = _report(solution, options.time_limit_s)
    if options.offload and problem.host_link is not None:  # how far from any planner's
        report = report.model_copy(update={
            "any_choice_bound_ms": choice_bound(problem, budget_bytes).added_ms})
    return made(solution.schedule, budget_bytes, report)


def _remember_minimum(digest: str, options: SolveOptions, lowest: Solution,
                      at_minimum: Plan) -> None:
    """The error names ``at_minimum``'s peak as a budget that returns that plan: a search
    at that budget, stopped by its time limit, may not find one as low again (the zoo GPT
    on a loaded CI machine: 2.72 MiB found where the error had named 2.65), and then
    returns this one (FEASIBLE, no bound)."""
    if lowest.schedule is not None:
        at = options.at(at_minimum.predicted_peak_bytes)
        ANSWERS.put_minimum(digest, at, Solution(
            solver=lowest.solver, status=Status.FEASIBLE, schedule=lowest.schedule,
            budget_bytes=at.budget_bytes, objective_ms=at_minimum.recompute_ms,
            solve_time_s=lowest.solve_time_s, peak_bytes=at_minimum.predicted_peak_bytes))


def _searched(prof: GraphProfile, problem: Problem, options: SolveOptions, left: float,
              started: float) -> tuple[Solution, bool]:
    """The solvers' answer, or when they found nothing the lowest-peak schedule (which may
    not fit the budget: then it names the minimum); and whether the solvers' time limit
    stopped them before they found one (a longer search may)."""
    # the optimizer step after the backward peaks the same under every schedule: a budget
    # below it is infeasible whatever the solvers find for forward and backward
    if optimizer_step_peak(problem) <= options.budget_bytes:
        solution = _solve(problem, options, left)
    else:
        solution = Solution(solver=options.solver, status=Status.INFEASIBLE, schedule=None,
                            budget_bytes=options.budget_bytes, objective_ms=None)
    if solution.feasible and solution.schedule is not None:
        return solution, False
    # the minimum the error names is the lowest peak this search finds: with what is
    # left of the limit after a search that took all of it, only the baselines ran
    # (Inception-v3: every block's 200.4 MiB, where 5 s of CP-SAT finds 187.2)
    limit = options.time_limit_s
    left = max(LOWEST_PEAK_SHARE * limit, limit - _margin(limit) - _spent(options, started))
    lowest = lowest_peak(problem, left, deterministic=options.deterministic)
    if lowest.schedule is None or lowest.peak_bytes is None:
        raise RuntimeError(f"no schedule of {prof.model_name} could be simulated")
    return lowest, solution.status == Status.TIMED_OUT


def _spent(options: SolveOptions, started: float) -> float:
    """Seconds since ``started`` that the solvers' limit counts: none for a deterministic
    plan, whose solvers count their own work (`solvers.deterministic_solver`): a limit that
    shrank with the machine's load would give another answer on a busy machine (the zoo
    GPT tiny: CP-SAT proved its plan with 4.5 units of work on a quiet machine, not with
    the 3.6 left on a loaded one)."""
    return 0.0 if options.deterministic else perf_counter() - started


def _margin(limit: float) -> float:
    """What the solvers leave of ``limit`` for what follows them."""
    return min(0.5, max(0.05, 0.05 * limit), 0.5 * limit)


class _PlanMaker:
    """`_make_plan` with what every plan of one `plan_for_profile` call shares."""

    def __init__(self, prof: GraphProfile, inputs: list[InputSpec], structure: str,
                 sharding: Sharding | None, problem: Problem, options: SolveOptions,
                 routing: RoutingSpread | None = None) -> None:
        self.prof, self.inputs, self.structure = prof, inputs, structure
        self.sharding, self.problem, self.options = sharding, problem, options
        self.routing = routing

    def __call__(self, schedule: Schedule, budget_bytes: int, report: SolverReport,
                 note: str = "", *, record_offload: bool = True) -> Plan:
        host = self.options.host_budget_bytes if self.options.offload and record_offload \
            else None
        return _make_plan(self.prof, schedule, budget_bytes, report, self.inputs,
                          self.structure, note, self.sharding, self.problem, host,
                          self.routing)


def _solve(problem: Problem, options: SolveOptions, time_limit_s: float) -> Solution:
    """The named solver, or with offload the joint one (`solvers.joint`, the DP beneath);
    an offload plan is taken only where it adds less time than the named solver's."""
    budget_bytes = options.budget_bytes
    if not options.offload or problem.host_link is None:
        if options.offload:
            log.warning("%s: no host link is known for this device (profiles.devices): "
                        "planning without offload", problem.name)
        return _named_solver(options)(problem, budget_bytes, time_limit_s)
    started = perf_counter()
    plain = _named_solver(options)(problem, budget_bytes, time_limit_s / 2)
    left = max(0.05, time_limit_s - _spent(options, started))
    bar = _bar(range(0), "offload sets", options.progress)

    def weighed(done: int, at_most: int) -> None:
        bar.total = at_most
        bar.update(done - bar.n)

    try:  # offloaded keeps need torch to route SAC's cache through saved-tensor hooks
        joint = solvers_joint.solve(problem, budget_bytes, left,
                                    host_budget_bytes=options.host_budget_bytes,
                                    keeps_offloaded=KEEPS_THROUGH_HOOKS,
                                    deterministic=options.deterministic, on_set=weighed)
    finally:
        bar.close()
    if not joint.feasible or (plain.feasible and plain.objective_ms <= joint.objective_ms):
        return plain
    return joint


def _named_solver(options: SolveOptions) -> Callable[[Problem, int, float], Solution]:
    """``options.solver``, deterministic where the options say so."""
    return deterministic_solver(options.solver) if options.deterministic \
        else SOLVERS[options.solver]


def plan_for_schedule(prof: GraphProfile, schedule: Schedule, inputs: list[InputSpec],
                      structure: str, budget_bytes: int | None = None,
                      sharding: Sharding | None = None,
                      routing: RoutingSpread | None = None) -> Plan:
    """A plan that runs ``schedule`` (regions of ``prof``'s module calls), e.g. one made by
    hand or by another tool; its numbers come from ``simulate`` like every plan's (with
    ``routing``, a profiled step's, at its worst routing)."""
    problem = rank_problem(problem_from_profile(prof), sharding)
    timeline = simulate(problem, schedule)
    report = SolverReport(name="given", status=Status.FEASIBLE.value,
                          objective_ms=timeline.recompute_time_ms, bound_ms=None, gap=None,
                          solve_time_s=0.0)
    peak = timeline.peak_bytes if routing is None else \
        worst_routing(problem, routing, schedule).peak_bytes
    return _make_plan(prof, schedule, peak if budget_bytes is None else budget_bytes, report,
                      inputs, structure, sharding=sharding, problem=problem, routing=routing)


def _report(solution: Solution, time_limit_s: float | None = None) -> SolverReport:
    space = str(solution.space) if solution.space is not None else ""
    return SolverReport(name=solution.solver, status=solution.status.value,
                        objective_ms=solution.objective_ms, bound_ms=solution.bound_ms,
                        gap=solution.gap, solve_time_s=solution.solve_time_s, space=space,
                        time_limit_s=time_limit_s)


def _infeasible(prof: GraphProfile, problem: Problem, options: SolveOptions,
                lowest: Solution, at_minimum: Plan, stopped: bool = False
                ) -> InfeasibleBudgetError:
    """The error for a budget no schedule met: the lowest peak of any schedule found (a
    budget that yields a plan, carried as ``.plan``) and, when proven, the bound no schedule
    goes below; ``stopped``: the solvers' time limit ended their search (said, with the
    remedy)."""
    budget_bytes = options.budget_bytes
    peak = at_minimum.predicted_peak_bytes
    floor = optimizer_step_peak(problem)
    bound = lowest.min_feasible_budget_bytes
    proof = ""
    if lowest.least_peak_bytes is not None and lowest.least_peak_space is not None:
        least, space = lowest.least_peak_bytes, lowest.least_peak_space
        by = lowest.least_peak_prover or "CP-SAT"
        proof = (f" It is the least peak of {space} (proven by {by})." if least == peak else
                 f" No plan of {space} peaks below {format_bytes(least)} (proven by {by}).")
    if bound is not None and bound < peak:
        what = ("the optimizer's step" if bound == floor else
                "static memory plus the largest working set of one op")
        proof += (f" No schedule at all can peak below {format_bytes(bound)} ({what})"
                  + ("." if proof else "; plans between the two may exist that the solvers "
                     "did not find."))
    if floor and floor >= peak:
        proof += (f" It is the peak of the optimizer's step ({format_bytes(floor)}), the same "
                  "under every schedule: checkpointing cannot lower it.")
    head = (f"No checkpointing plan of {prof.model_name} fits {format_bytes(budget_bytes)}: "
            f"the lowest peak found is {format_bytes(peak, round_up=True)} ({peak} bytes, by "
            f"{lowest.solver}); ")
    if stopped:  # before what is proven: the budget is not
        proof = (f" The {options.solver} search stopped at its time limit "
                 f"({options.time_limit_s:g} s) before it found a plan within the budget or "
                 f"proved there is none: a longer one (TIME_LIMIT)"
                 + ("" if options.deterministic else
                    ", or one run to its end (DETERMINISTIC: the same answer on a busy "
                    "machine as on a quiet one),")
                 + f" may find one.{proof}")
    body = (f"{proof} Static memory alone (parameters, gradients, buffers, inputs, optimizer "
            f"state{', per rank' if at_minimum.sharding else ''}) is "
            f"{format_bytes(problem.static_bytes + sum(problem.param_grad_bytes))}.")
    offload = _offload_hint(problem, options)  # spelled twice, searched once
    python = (f"{head}that plan is error.plan, and optimize(..., budget_gb=error.min_budget_gb) "
              f"returns it.{body}{offload.format_map(_PYTHON)} Raise the budget, "
              "shrink the batch, use autocast=torch.bfloat16, or shard parameters and "
              "optimizer state.")
    shell = (f"{head}--budget-gb {peak / GIB!r} returns that plan.{body}"
             f"{offload.format_map(_SHELL)} Raise --budget-gb or shrink the "
             "batch (--set); mixed precision and sharded parameters are planned from Python "
             "(planner.optimize(..., autocast=torch.bfloat16, parallelize=...)).")
    python = python.replace("TIME_LIMIT", "time_limit_s").replace(
        "DETERMINISTIC", "deterministic=True")
    shell = shell.replace("TIME_LIMIT", "--time-limit").replace(
        "DETERMINISTIC", "--deterministic")
    return InfeasibleBudgetError(python, peak, bound if bound is not None and bound <= peak
                                 else None, at_minimum, shell_message=shell)


# how a remedy is spelled: in Python (optimize's arguments) and in the shell (the CLI's flags)
_PYTHON = {"offload": "offload=True", "host_budget": "host_budget_gb"}
_SHELL = {"offload": "--offload", "host_budget": "--host-budget-gb"}


def _offload_hint(problem: Problem, options: SolveOptions) -> str:
    """What offload could and could not do for an infeasible budget, its remedies as
    ``{offload}`` and ``{host_budget}`` (`_PYTHON` or `_SHELL` spells them)."""
    if problem.host_link is None:
        return ""
    host_budget_bytes = options.host_budget_bytes
    if not options.offload:  # on a CPU, "host" is the same memory: nothing to say
        return ("" if problem.host_link.synchronous else " {offload} may reach lower, moving "
                "saved activations to host memory.")
    chain = solvers_joint.offload_chain(problem)
    if not chain:
        return " Offload found no module call to move here."
    everything = solvers_joint.moved_bytes(problem, chain)
    if everything > host_budget_bytes:
        return (f" Offload was held back by the host budget ({format_bytes(host_budget_bytes)}"
                f"): offloading every candidate call would take "
                f"{format_bytes(everything, round_up=True)} of host memory; raise "
                "{host_budget}.")
    return (f" Offloading every candidate call ({format_bytes(everything, round_up=True)} to "
            "host memory) does not reach it either.")


def _make_plan(profile: GraphProfile, schedule: Schedule, budget_bytes: int,
               report: SolverReport, inputs: list[InputSpec], structure: str,
               note: str = "", sharding: Sharding | None = None,
               problem: Problem | None = None, host_budget_bytes: int | None = None,
               routing: RoutingSpread | None = None) -> Plan:
    """The plan of ``schedule``; each checkpoint's target is the module call of its span.
    ``problem``: the plan's own (``rank_problem`` of the profile), when already built."""
    targets = span_targets(profile)
    missing = [r for r in [*schedule.recompute_regions(), *schedule.offloads]
               if (r.start, r.stop) not in targets]
    if missing:
        raise ValueError(f"the schedule checkpoints nodes [{missing[0].start}, "
                         f"{missing[0].stop}), which no module call or traced op range of "
                         "the profile ran")
    plan = Plan(structure_fingerprint=structure, budget_bytes=budget_bytes, note=note,
                solver=report, schedule=schedule.with_targets(targets), inputs=inputs,
                profile=profile, sharding=sharding, host_budget_bytes=host_budget_bytes,
                routing=routing)
    return plan.reusing(problem) if problem is not None else plan
