"""profile_model: one training step of a model profiled as it will train
(:class:`ProfiledStep`), with the notes its plans carry about how it was profiled."""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import profiles
from planner.arguments import _as_inputs, _input_specs, _parallelism
from planner.config import PARALLEL, PROFILING, STEP, PlanConfig, shows_options
from planner.model_state import (
    _ambient_autocast,
    _model_device,
    _refuse_existing_checkpointing,
    _training_config,
    _training_mode,
    structure_fingerprint,
)
from planner.plan import InputSpec
from planner.region_calibration import calibrated_profile
from planner.routing_bound import routing_bound
from planner.runtime.install import _plan_suspended
from planner.sharding import Sharding, rank_problem
from profiles.calibrate import CPU_MEASURED
from profiles.inputs import normalize_inputs
from profiles.kernels import attention_kernels
from profiles.schema import GraphProfile
from solvers import Problem, Schedule, simulate
from solvers.from_profile import problem_from_profile
from solvers.routing import RoutingSpread, worst_routing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfiledStep:
    """One training step of a model, profiled as it will train: what :func:`solve` plans
    at any budget without profiling again (:func:`profile_model` makes it)."""

    profile: GraphProfile
    inputs: list[InputSpec]
    structure: str  # structure_fingerprint() of the model
    sharding: Sharding | None = None
    notes: tuple[str, ...] = ()
    routing: RoutingSpread | None = None  # routed experts' loops: plans bound every routing

    @property
    def unplanned_peak_bytes(self) -> int:
        """The peak of the step without checkpoints (as one rank runs it)."""
        return self.peak_of(Schedule.store_all(len(self.profile.nodes)))

    def peak_of(self, schedule: Schedule) -> int:
        """``schedule``'s peak on this step: at its worst routing, where its routed experts
        loop over the experts its tokens went to (`solvers.routing`)."""
        if self.routing is not None:
            return worst_routing(self.problem(), self.routing, schedule).peak_bytes
        return simulate(self.problem(), schedule).peak_bytes

    def problem(self) -> Problem:
        """The step as the solvers see it (per rank)."""
        return rank_problem(problem_from_profile(self.profile),
                            self.sharding)


@shows_options(STEP, PROFILING, PARALLEL)
def profile_model(model: nn.Module, example_inputs: Any = None, *,
                  config: PlanConfig | None = None, bound_routing: bool = True,
                  **options: Any) -> ProfiledStep:
    """Profile one training step of ``model`` as it will train, for :func:`solve` to plan
    at one budget or many. Options as :func:`optimize`'s: the fields of
    :class:`~planner.config.PlanConfig` of the step, profiling and parallelism.

    Whatever state the object is in, the step profiled is the training step: a plan
    already applied is taken off while profiling and put back as it was (``apply`` of the
    new plan replaces it); the ``.grad`` the model holds now do not count (the step
    starts as ``grad_accumulation`` says); a model in ``eval()`` is profiled in ``train()``
    mode, each module's mode restored after, and the plan's note says so.

    Routed experts that loop over the experts the batch's tokens went to are profiled at
    forced routings (``bound_routing``, `planner.routing_bound`): plans then hold for every
    routing; without it, for the profiled batch's.
    """
    c = PlanConfig.of(config, options, "profile_model()", (STEP, PROFILING, PARALLEL))
    parallel, ddp = _parallelism(model, c.world_size, c.sharding, c.shard_modules,
                                 c.parallelize, c.mesh_shape, c.mesh_dim_names)
    autocast = c.autocast
    _refuse_existing_checkpointing(model)
    toy_batch = example_inputs is None
    args, kwargs = normalize_inputs(model, example_inputs)
    if autocast is None:
        autocast = _ambient_autocast(_model_device(model).type)
        if autocast is not None:
            log.info("planning under the ambient torch.autocast(%s)", autocast)
    # one process on the CPU: measured op times are scaled to the calibration's steps
    # (`_calibrated`), not to a whole step the profile would time first
    on_host = parallel is None and ddp is None and _model_device(model).type == "cpu"
    with (_plan_suspended(model), _training_mode(model) as was_eval,
          _training_config(model) as cache_off):
        again = functools.partial(
            profiles.profile, model, _as_inputs(args, kwargs), loss_fn=c.loss_fn,
            optimizer=c.optimizer, autocast=autocast, timing=c.timing, device=c.device,
            execution=c.execution, grad_accumulation=c.grad_accumulation,
            zero_grad_after_forward=c.zero_grad_after_forward, parallel=parallel,
            whole_step=not on_host)
        prof = again(progress=c.progress)
        routed, routing = _routed_loops(model, prof), None
        if routed and bound_routing and \
                (bounded := routing_bound(model, again, ddp, c.progress)) is not None:
            prof, routing = bounded
        if on_host and _host_timed(model, prof):
            prof = _calibrated(model, args, kwargs, c.loss_fn, autocast, prof)
    notes = _step_notes(model, prof, args, kwargs, was_eval=was_eval, toy_batch=toy_batch,
                        cache_off=cache_off)
    notes.extend(_routing_note(model, routed, routing))
    return ProfiledStep(prof, _input_specs(args, kwargs), structure_fingerprint(model), ddp,
                        tuple(notes), routing)


def _host_timed(model: nn.Module, prof: GraphProfile) -> bool:
    """Whether the step was timed on this process's CPU (every cost host cost), where a
    region's cost is measured on the model itself (`planner.region_calibration`): its ops
    measured (their times are then the calibration's to scale), or estimated where the
    real forward took another path, with the host's checkpoint costs."""
    costs = prof.checkpoint_costs
    return _model_device(model).type == "cpu" and (
        prof.timing == "measure" or (costs is not None and costs.source == CPU_MEASURED))


def _calibrated(model: nn.Module, args: tuple, kwargs: dict,
                loss_fn: Callable[[Any], torch.Tensor] | None, autocast: torch.dtype | None,
                prof: GraphProfile) -> GraphProfile:
    """``prof`` with its step's times and, where it has blocks, its checkpoint costs
    measured on ``model`` (`planner.region_calibration`)."""
    return calibrated_profile(model, args, kwargs, loss_fn or profiles.default_loss,
                              autocast, prof)


def _step_notes(model: nn.Module, prof: GraphProfile, args: tuple, kwargs: dict, *,
                was_eval: bool, toy_batch: bool, cache_off: bool) -> list[str]:
    """What a plan's note says of how its step was profiled: a model in eval mode planned
    as it trains (also logged), the model's own toy batch, the cache turned off, CPU
    kernels standing in for a GPU's, forwards not traced."""
    notes = []
    if was_eval:
        notes.append("Planned the training step (dropout on, BatchNorm updating): the model "
                     "was in eval mode; call model.train() before training with it.")
        log.warning("%s is in eval mode; planning its training step (train() mode)",
                    type(model).__name__)
    if toy_batch:
        notes.append("Planned for the model's own example batch (a toy batch, "
                     f"{_batch_shapes(args, kwargs)}), not one it trains on: pass "
                     "example_inputs shaped like one real training batch.")
    if cache_off:
        notes.append("Profiled with config.use_cache=False (a training step keeps no cache); "
                     "apply() turns it off.")
    notes.extend(_cpu_kernels_for_a_gpu(prof))
    notes.extend(_untraced_note(prof))
    return notes


_ROUTED = re.compile(r"moe|expert", re.IGNORECASE)


def _routed_loops(model: nn.Module, prof: GraphProfile) -> Counter[str]:
    """Routed experts whose ops depend on the routing (a loop over the experts a batch's
    tokens went to, found by its ``nonzero``), by module type."""
    routed: Counter[str] = Counter()
    for call in prof.module_calls:
        try:
            name = type(model.get_submodule(call.path)).__name__
        except AttributeError:
            continue
        if _ROUTED.search(name) and any("nonzero" in node.target and node.module == call.path
                                        for node in prof.nodes[call.start:call.stop]):
            routed[name] += 1  # the module whose own forward loops (not those around it)
    return routed


def _routing_note(model: nn.Module, routed: Counter[str],
                  routing: RoutingSpread | None) -> list[str]:
    """What a plan's note says of routed experts that loop over the routed ones: bounded
    over every routing, or (where no bound could be made) the profiled routing's (also
    logged)."""
    if not routed:
        return []
    which = ", ".join(f"{name} x{n}" for name, n in routed.items())
    if routing is not None:
        return [f"Routed experts ({which}) run the experts the batch's tokens went to: the "
                f"plan holds for every routing of {routing.tokens} tokens to "
                f"{routing.top_k} of {routing.experts} experts (a bound from "
                f"{routing.experts} profiles at forced routings, solvers.routing)."]
    log.warning("%s routes tokens to experts by their values (%s): the plan is exact for "
                "the profiled batch's routing; another batch's may peak otherwise",
                type(model).__name__, which)
    return [f"Routed experts ({which}) run the experts the batch's tokens went to: memory "
            "is the profiled batch's routing's, and another batch's may peak otherwise "
            "(docs/limitations.md): plan with a margin."]


def _batch_shapes(args: tuple, kwargs: dict) -> str:
    named = [*enumerate(args), *kwargs.items()]
    return ", ".join(f"{name} {list(v.shape)}" for name, v in named
                     if isinstance(v, torch.Tensor)) or "no tensors"


_OPTIONAL = r"argument '([^']*)' is optional"
_OPTIONAL_ANY = "<optional arguments>"
UNTRACED_LINES = 6  # module types the note names per reason; the rest are counted


def _untraced_note(prof: GraphProfile) -> list[str]:
    """Which modules offer module-call regions only (their forward is not traced, or not
    as it ran): one sentence per reason, naming the module types it holds for (optional
    arguments, the usual reason in Hugging Face models, are one reason whatever their
    names); nothing when every one traced."""
    by_reason: dict[str, Counter[str]] = {}
    optional: dict[str, None] = {}  # argument names, in order met
    for call in prof.module_calls:
        if call.untraced:
            found = re.search(_OPTIONAL, call.untraced)
            if found:
                optional[found.group(1)] = None
            reason = re.sub(_OPTIONAL, _OPTIONAL_ANY, call.untraced)
            by_reason.setdefault(reason, Counter())[call.module_type] += 1
    if not by_reason:
        return []
    traced = sum(1 for call in prof.module_calls if call.traced)
    names = ", ".join(repr(name) for name in optional)
    lines = []
    for reason, kinds in sorted(by_reason.items(), key=lambda kv: -sum(kv[1].values())):
        reason = reason.replace(_OPTIONAL_ANY, f"argument {names} is optional"
                                if len(optional) == 1 else f"arguments {names} are optional")
        named = [f"{kind} ({count} call{'s' * (count > 1)})"
                 for kind, count in kinds.most_common(UNTRACED_LINES)]
        more = len(kinds) - UNTRACED_LINES
        lines.append(f"{', '.join(named)}{f' and {more} more types' if more > 0 else ''}: "
                     f"{reason}.")
    return [f"Op ranges inside a forward (torch.fx): {traced} module calls traced; these "
            "offer module-call regions only: " + " ".join(lines)]


def _cpu_kernels_for_a_gpu(prof: GraphProfile) -> list[str]:
    """A note when real CPU tensors stood in for a GPU: attention and dropout ran the CPU's
    kernels, which save other tensors than the GPU's fused ones (``profiles.kernels``).
    The plan's note says it (``summary()``); the log only at INFO, as the CLI estimates
    for an H100 by default."""
    if prof.execution != "real" or prof.timing != "estimate" or not prof.for_gpu:
        return []
    targets = [node.target for node in prof.nodes]
    kernels = attention_kernels(targets)
    cpu_only = [k for k in kernels if k in ("flash_cpu", "math")]
    if "aten.bernoulli_.float" in targets:
        cpu_only.append("dropout as bernoulli_ noise")
    if not cpu_only:
        return []
    log.info("%s was profiled on real CPU tensors for %s: its attention/dropout ran the "
             "CPU's kernels", prof.model_name, prof.device)
    return [f"Profiled on real CPU tensors for {prof.device}: {', '.join(cpu_only)} ran as "
            f"on the CPU, where {prof.device} runs fused kernels that save less. Build the "
            "model on the meta device to profile the GPU's kernels."]
