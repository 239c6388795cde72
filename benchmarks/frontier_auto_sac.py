"""The "torch auto-SAC (sac_ilp)" peer of ``benchmarks/frontier.py``.

torch's own automatic selective checkpointing (``torch.distributed._tools``, needs ``pulp`` and
``pwlf``), run as torch's tests do: one training step of a fake-tensor copy of the model under
MemTracker, RuntimeEstimator and SACEstimator, ``aggregate_stats`` + ``parse_module_info``, then
``sac_milp`` picks the modules to checkpoint and the share of each one's activations to
discard, and ``get_optimal_checkpointing_policy_per_module`` (at 1 - that share) picks the ops
each of those modules keeps; each is then run under ``checkpoint(use_reentrant=False)`` with a
``create_selective_checkpoint_contexts`` policy that keeps those ops. It is solved at the
measured peak of each other peer (same-memory comparison), and our planner plans at its
measured peak in turn. ``sac_milp``'s budget is in its own memory model (parameters, gradients,
activations in GiB; not inputs nor what the loss allocates outside the model), so the budget it
gets is the target less the gap between our measured no-checkpointing peak and its own
estimate of it. torch's two runtime modes need CUDA (the cost model asserts it; the benchmark
times with CUDA events), so on CPU the estimators use a CPU port of "operator-level-benchmark"
(same fake-to-real inputs, ``time.perf_counter``); on GPU torch's own benchmark mode.

Adaptations, each recorded in the JSON rows: a module whose outputs need no gradient gets its
forward memory snapshot as its missing backward ones (as torch's test fills POST_BW); the
per-op decisions are moved onto the ops the real model runs where the fake run recorded
others (``eager_ops_not_in_sac_estimator``); a module whose per-module MILP is infeasible at
1 - share (ops it must save) keeps just those (``widened_modules``); and where SAC refuses a
kept output that an in-place op then changes, the run is redone with
``allow_cache_entry_mutation=True`` (gradients still compared bit for bit).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from frontier_measure import (
    GIB,
    TIME_UP,
    Runner,
    autocast_context,
    default_loss,
    distinct_peaks,
    grads_match,
    split_inputs,
)
from torch import nn
from torch.utils._pytree import tree_map, tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner import zoo

AUTO_SAC = "torch auto-SAC (sac_ilp)"


# --------------------------------------------------------- torch's estimators


def auto_sac_not_run() -> str | None:
    """Why torch's auto-SAC (``sac_ilp`` + ``SACEstimator``) cannot run here, or None."""
    try:
        from torch.distributed._tools import sac_ilp  # noqa: F401
    except ImportError as error:
        if "pulp" in str(error):
            return "not run: torch's sac_ilp needs pulp, which is not installed (pip install pulp)"
        return f"not run: torch.distributed._tools.sac_ilp does not import ({error})"
    try:
        import pwlf  # noqa: F401
    except ImportError as error:
        return (f"not run: torch's SACEstimator needs pwlf to fit its trade-off curves "
                f"(pip install pwlf): {error}")
    return None


def _cpu_operator_benchmark(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
    """RuntimeEstimator's "operator-level-benchmark" for CPU tensors (torch's times with CUDA
    events): the fake op's result, and the milliseconds the op takes on real inputs made like
    torch's (``rand_like`` for floating point, ``ones_like`` otherwise); 1 warm-up, mean of 2.
    Ops that cannot run on such inputs count 0 ms, as torch counts ops it cannot benchmark."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._runtime_estimation import _FLOAT_TYPES, _VIEW_OPS

    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    if func._overloadpacket in _VIEW_OPS:
        return out, 0.0
    fake_mode = RuntimeEstimator.fake_mode

    def real(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and fake_mode.is_our_fake(t):
            make = torch.rand_like if t.dtype in _FLOAT_TYPES else torch.ones_like
            return make(t, device=t.fake_device)
        return t

    try:
        with no_dispatch():
            real_args, real_kwargs = tree_map(real, (args, kwargs))
            func(*real_args, **real_kwargs)
            began = time.perf_counter()
            for _ in range(2):
                func(*real_args, **real_kwargs)
            ms = (time.perf_counter() - began) * 1e3 / 2
    except Exception:  # e.g. an op that needs meaningful data
        ms = 0.0
    return out, ms


class AutoSACStats(NamedTuple):
    """What torch's estimators measured on one training step, ready for ``sac_milp``."""

    graph: Any  # ilp_utils.Graph
    sac_stats: dict[str, Any]  # module fqn -> SACStats
    model_peak_bytes: int  # sac_milp's own estimate of the peak without checkpointing
    estimate_mode: str
    collect_s: float
    filled: list[str]  # modules given their POST_FW snapshot as backward ones (see below)


def _fill_backward_snapshots(mem_tracker: Any) -> list[str]:
    """A module whose outputs need no gradient (Llama's rotary embedding) has no backward,
    so MemTracker takes no backward snapshots of it, which aggregate_stats reads; as torch's
    test_sac_ilp fills in missing POST_BW snapshots, give it its POST_FW one. Returns the
    modules so filled."""
    from torch.distributed._tools.mem_tracker import _ModState

    filled = []
    for mod_stats in mem_tracker.memory_tracking.values():
        snapshots = mod_stats.snapshots
        if _ModState.PRE_BW not in snapshots and _ModState.POST_FW in snapshots:
            for state in (_ModState.PRE_BW, _ModState.PEAK_BW):
                snapshots[state] = [copy.deepcopy(snapshots[_ModState.POST_FW][-1])]
            filled.append(mod_stats.mod_fqn)
    return filled


def _fake_copy(zm: zoo.ZooModel) -> tuple[nn.Module, tuple, dict, Any]:
    """``zm.model`` with fake parameters and buffers, its inputs as fake tensors, and the
    fake mode (which converts the real targets the loss functions close over)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for t in [*zm.model.parameters(), *zm.model.buffers()]:
        fake = fake_mode.from_tensor(t.detach())
        memo[id(t)] = (nn.Parameter(fake, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else fake)
    model = copy.deepcopy(zm.model, memo)  # same modules, fake parameters and buffers
    args, kwargs = split_inputs(zm.example_inputs)
    args, kwargs = tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))
    return model, args, kwargs, fake_mode


def _run_estimators(model: nn.Module, args: tuple, kwargs: dict,
                    loss_fn: Callable[[Any], torch.Tensor], device: str,
                    autocast: torch.dtype | None, mode: str) -> tuple[Any, Any, Any, list[str]]:
    """One training step of the fake ``model`` under each of MemTracker, RuntimeEstimator
    (``mode``; on CPU our port of it) and SACEstimator: the three, and the modules given
    backward snapshots (``_fill_backward_snapshots``). Call inside the fake mode."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    cpu = device != "cuda"  # torch's estimate modes need CUDA
    mem_tracker = MemTracker()
    mem_tracker.track_external(model)
    with mem_tracker:
        with autocast_context(device, autocast):
            loss = loss_fn(model(*args, **kwargs))
        loss.backward()
    model.zero_grad(set_to_none=True)
    filled = _fill_backward_snapshots(mem_tracker)

    runtime_estimator = RuntimeEstimator()
    runtime_estimator(estimate_mode_type=mode)
    if cpu:
        runtime_estimator._estimate = _cpu_operator_benchmark
    with runtime_estimator:
        with autocast_context(device, autocast):
            loss = loss_fn(model(*args, **kwargs))
        loss.backward()
    model.zero_grad(set_to_none=True)

    sac_estimator = SACEstimator()
    sac_estimator(estimate_mode_type=mode)
    if cpu:
        sac_estimator._estimate_runtime = _cpu_operator_benchmark
    with sac_estimator, autocast_context(device, autocast):
        out = model(*args, **kwargs)
    with autocast_context(device, autocast):
        loss = loss_fn(out)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return mem_tracker, runtime_estimator, sac_estimator, filled


def collect_auto_sac_stats(zm: zoo.ZooModel, device: str,
                           autocast: torch.dtype | None = None) -> AutoSACStats:
    """Run one step of a fake-tensor copy of ``zm.model`` under torch's MemTracker,
    RuntimeEstimator and SACEstimator (as torch's test_sac_ilp does; each forward under
    ``autocast`` when given) and aggregate them."""
    import numpy as np
    from torch.distributed._tools.ilp_utils import (
        aggregate_stats,
        get_peak_memory_runtime_baseline,
        parse_module_info,
    )

    began = time.perf_counter()
    model_device = next(zm.model.parameters()).device
    model, args, kwargs, fake_mode = _fake_copy(zm)
    mode = "operator-level-benchmark"
    with torch.random.fork_rng(), fake_mode, contextlib.redirect_stdout(io.StringIO()):
        mem_tracker, runtime_estimator, sac_estimator, filled = _run_estimators(
            model, args, kwargs, zm.loss_fn or default_loss, device, autocast, mode)

    np.random.seed(0)  # pwlf fits the trade-off curves by differential evolution
    module_info = aggregate_stats(model, mem_tracker, runtime_estimator, sac_estimator,
                                  model_device)
    graph = parse_module_info(module_info)
    model_peak, _ = get_peak_memory_runtime_baseline(graph)
    return AutoSACStats(graph, dict(sac_estimator.sac_mod_stats), model_peak,
                        mode + (" (CPU port)" if device != "cuda" else ""),
                        time.perf_counter() - began, filled)


class AutoSACPlan(NamedTuple):
    ac_decisions: dict[str, float]  # module fqn -> share of its activation memory to discard
    recompute_ms: float  # sac_milp's estimate
    peak_bytes: int  # sac_milp's memory model's peak under its decisions
    policies: dict[str, tuple[list[str], list[int]]]  # fqn -> (op names, 1 save / 0 recompute)
    widened: list[str]  # modules whose per-module MILP needed a larger budget (see below)


def _forced_save_fraction(sac_stats: Any) -> float:
    """Share of a module's op memory that get_optimal_checkpointing_policy_per_module must
    save whatever the budget: in-place ops on tensors from outside the module (BatchNorm's
    running statistics), the ops in place on those, and random ops if they must be stored."""
    forced = {op for op, parent in sac_stats.inplace_ops if op == parent}
    if sac_stats.force_store_random:
        forced |= set(sac_stats.rand_ops)
    grew = True
    while grew:
        more = {op for op, parent in sac_stats.inplace_ops if parent in forced} - forced
        forced |= more
        grew = bool(more)
    total = sum(sac_stats.memory)
    return sum(sac_stats.memory[i] for i in forced) / total if total else 0.0


def sac_milp_peak(graph: Any, ac_decisions: dict[str, float]) -> int:
    """Peak bytes of ``sac_milp``'s memory model under ``ac_decisions`` (world size 1): its
    max over modules of m_i, which it bounds by the budget but does not return."""
    discarded = {}
    for node in graph.nodes:
        if (r := ac_decisions.get(node["fqn"])) is not None:  # d_i = ACM_i r_i - (ACM_i - IA_i)
            acm, ia = node["sac_memory"], node["act_fw_per_module"]
            discarded[node["fqn"]] = acm * r - (acm - ia)
    params = graph.nodes[0]["param_per_module"]
    return round(max(
        node["act_total"] + node["act_grad_per_module"] + params + node["grad_total"]
        - sum(discarded.get(f, 0.0) for f in graph.fw_post_order[:node["pos_fw_post_order"]])
        for node in graph.nodes))


def solve_auto_sac(stats: AutoSACStats, budget_bytes: float) -> AutoSACPlan | None:
    """``sac_milp`` at ``budget_bytes`` (its own memory model), then the per-module op policies
    of the modules it checkpoints; None where ``sac_milp`` finds no solution."""
    from torch.distributed._tools.sac_ilp import (
        get_optimal_checkpointing_policy_per_module,
        sac_milp,
    )

    logger = logging.getLogger("torch.distributed._tools.sac_ilp")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # its warnings and "solver failed" land in our rows
    try:
        with warnings.catch_warnings():  # PuLP 3's deprecations of the PuLP 2 API it uses
            warnings.simplefilter("ignore", DeprecationWarning)
            ac_decisions, recompute_ms, peak = sac_milp(stats.graph,
                                                        memory_budget=budget_bytes / GIB)
            if peak == -1:
                return None
            policies: dict[str, tuple[list[str], list[int]]] = {}
            widened = []
            for fqn, discard in ac_decisions.items():
                sac_stats = stats.sac_stats[fqn]
                keep = 1.0 - discard
                decisions = get_optimal_checkpointing_policy_per_module(sac_stats, keep)
                if not decisions and sac_stats.func_names:
                    # infeasible: the ops it must save already exceed 1 - discard: keep those
                    keep = min(1.0, max(keep, _forced_save_fraction(sac_stats) + 1e-9))
                    decisions = get_optimal_checkpointing_policy_per_module(sac_stats, keep)
                    widened.append(fqn)
                if len(decisions) != len(sac_stats.func_names):
                    raise RuntimeError(f"no per-module SAC policy for {fqn} at memory "
                                       f"budget {keep}")
                policies[fqn] = (list(sac_stats.func_names), decisions)
    finally:
        logger.setLevel(level)
    return AutoSACPlan(ac_decisions, recompute_ms, sac_milp_peak(stats.graph, ac_decisions),
                       policies, widened)


# ------------------------------------------------------ running its decisions


def eager_op_names(zm: zoo.ZooModel, fqns: list[str], autocast: torch.dtype | None = None
                   ) -> dict[str, list[str]]:
    """The ops (less ``OPS_TO_ALWAYS_SKIP``) that each module in ``fqns`` runs in one eager
    training-mode forward of the real model (under ``autocast`` when given: it adds casts):
    the sequence its SAC policy will be asked about.
    SACEstimator's, from the fake-tensor run, can differ (on CPU, the math SDPA with dropout
    builds its causal mask with other ops under FakeTensorMode)."""
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
    from torch.utils._python_dispatch import TorchDispatchMode

    names: dict[str, list[str]] = {f: [] for f in fqns}
    tracker = ModTracker()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func not in OPS_TO_ALWAYS_SKIP:
                for parent in tracker.parents:
                    if parent in names:
                        names[parent].append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    args, kwargs = split_inputs(zm.example_inputs)
    state = {k: v.detach().clone() for k, v in zm.model.state_dict().items()}
    device = next(zm.model.parameters()).device.type
    with torch.random.fork_rng(), tracker, Recorder(), autocast_context(device, autocast):
        zm.model(*args, **kwargs)  # output dropped: no backward
    zm.model.load_state_dict(state)  # BatchNorm's running statistics
    return names


def align_decisions(recorded: list[str], decisions: list[int], eager: list[str]
                    ) -> tuple[list[int], int]:
    """SACEstimator's per-op decisions moved onto the eager op sequence (longest matching
    blocks of op names); eager ops it did not record are recomputed. Also: how many those."""
    aligned = [0] * len(eager)
    matched = 0
    matcher = difflib.SequenceMatcher(None, recorded, eager, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            aligned[j1:j2] = decisions[i1:i2]
            matched += i2 - i1
    return aligned, len(eager) - matched


class OpListPolicy:
    """A SAC policy from per-op decisions (1 save, 0 recompute) over the module's eager op
    sequence (``eager_op_names``), consumed in order, separately in the forward and in the
    recompute; the ops SACEstimator leaves out (``OPS_TO_ALWAYS_SKIP``) are recomputed. An op
    that is not the one expected at that position is an error, not a silent misalignment."""

    def __init__(self, fqn: str, names: list[str], decisions: list[int]):
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

        self.fqn, self.names, self.decisions = fqn, names, decisions
        self.skip = OPS_TO_ALWAYS_SKIP
        self.count = {False: 0, True: 0}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in self.skip:
            return CheckpointPolicy.MUST_RECOMPUTE
        i = self.count[ctx.is_recompute]
        self.count[ctx.is_recompute] += 1
        name = func._overloadpacket.__name__
        if i >= len(self.names) or self.names[i] != name:
            expected = self.names[i] if i < len(self.names) else "no more ops"
            raise RuntimeError(f"auto-SAC policy of {self.fqn}: op {i} is {name}, "
                               f"expected {expected}")
        return (CheckpointPolicy.PREFER_SAVE if self.decisions[i]
                else CheckpointPolicy.MUST_RECOMPUTE)


def _auto_sac_contexts(fqn: str, names: list[str], decisions: list[int],
                       allow_mutation: bool) -> Any:
    return create_selective_checkpoint_contexts(OpListPolicy(fqn, names, decisions),
                                                allow_cache_entry_mutation=allow_mutation)


def _checkpointed_forward(forward: Callable[..., Any], context_fn: Callable[[], Any],
                          *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


@contextlib.contextmanager
def auto_sac_modules(model: nn.Module, policies: dict[str, tuple[list[str], list[int]]],
                     allow_mutation: bool = False) -> Iterator[None]:
    """Run each module named in ``policies`` (fqns as torch's ModTracker names them, rooted at
    the model's class name) under a non-reentrant checkpoint with its SAC policy, a fresh
    policy per call. ``forward`` is patched on the instances, as in ``checkpointed_blocks``.
    ``allow_mutation``: ``create_selective_checkpoint_contexts``'s
    ``allow_cache_entry_mutation`` (torch's per-module MILP saves an in-place op together with
    the op whose output it mutates, e.g. BatchNorm then ``relu_``; SAC refuses that by
    default)."""
    patched = []
    try:
        for fqn, (names, decisions) in policies.items():
            module = model.get_submodule(fqn.partition(".")[2])
            context_fn = functools.partial(_auto_sac_contexts, fqn, names, decisions,
                                           allow_mutation)
            module.forward = functools.partial(_checkpointed_forward, module.forward, context_fn)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def _aligned_policies(plan: AutoSACPlan, eager: dict[str, list[str]]
                      ) -> tuple[dict[str, tuple[list[str], list[int]]], dict[str, str]]:
    """The plan's per-op decisions moved onto each module's eager ops; where some eager ops
    were not in SACEstimator's record, how many ("misses/ops") by module."""
    policies, unmatched = {}, {}
    for fqn, (names, decisions) in plan.policies.items():
        aligned, misses = align_decisions(names, decisions, eager[fqn])
        policies[fqn] = (eager[fqn], aligned)
        if misses:
            unmatched[fqn] = f"{misses}/{len(aligned)}"
    return policies, unmatched


def _run_auto_sac(zm: zoo.ZooModel, runner: Runner,
                  policies: dict[str, tuple[list[str], list[int]]], fields: dict[str, Any]
                  ) -> tuple[int, float, float, dict[str, torch.Tensor]]:
    """``runner.run`` of the model under the auto-SAC policies."""
    try:
        return runner.run(zm.model, functools.partial(auto_sac_modules, zm.model, policies))
    except RuntimeError as error:
        if "has been mutated" not in str(error):
            raise
        # torch's policy keeps an output that an in-place op then changes: run it with
        # SAC's opt-in for that, and say so (the gradients are still compared)
        fields["allow_cache_entry_mutation"] = True
        return runner.run(zm.model, functools.partial(auto_sac_modules, zm.model, policies,
                                                      True))


class _Inputs(NamedTuple):
    """What torch's auto-SAC is solved from, once per model."""

    targets: list[tuple[int, list[str]]]  # the other peers' distinct peaks, with their names
    offset: int  # our measured no-checkpointing peak less sac_milp's estimate of it
    stats: AutoSACStats
    eager: dict[str, list[str]]  # module fqn -> its eager op names


def _auto_sac_inputs(zm: zoo.ZooModel, runner: Runner, device: str,
                     rows: list[dict[str, Any]]) -> _Inputs | str:
    """The peaks to solve at and torch's statistics of the model, or why it is not run."""
    none = next((r for r in rows if r["strategy"] == "none" and r.get("status") == "ok"), None)
    if none is None:
        return "not run: needs the measured peak of 'none' to calibrate sac_milp's memory model"
    targets = [(peak, names) for peak, names in distinct_peaks(
        [r for r in rows if r["kind"] == "peer" and r["strategy"] != "none"])
        if peak < 0.995 * none["peak_bytes"]]
    if not targets:
        return "not run: no other peer's peak to solve it at"
    if runner.out_of_time():
        return TIME_UP
    try:
        stats = collect_auto_sac_stats(zm, device, runner.autocast)
    except Exception as error:  # fake-tensor tracing, estimators or pwlf fits that fail
        return (f"not run: torch's estimators failed on this model: "
                f"{type(error).__name__}: {error}"[:300])
    try:
        eager = eager_op_names(zm, list(stats.sac_stats), runner.autocast)
    except Exception as error:
        return (f"not run: recording the model's eager ops failed: "
                f"{type(error).__name__}: {error}"[:300])
    # sac_milp counts parameters, gradients and activations; our measured peak also counts
    # the inputs and what the loss allocates: give it the target less that gap
    return _Inputs(targets, none["peak_bytes"] - stats.model_peak_bytes, stats, eager)


def _auto_sac_at(zm: zoo.ZooModel, runner: Runner, inputs: _Inputs, target: int,
                 names: list[str], first: bool, reference: dict[str, torch.Tensor],
                 row: Callable[..., dict[str, Any]]) -> bool:
    """torch's auto-SAC solved at ``target`` (the peak of peers ``names``), measured, its row
    written; whether it was planned (``first``: its planning time includes the estimators')."""
    stats, offset = inputs.stats, inputs.offset
    label = f"{AUTO_SAC} @ {'/'.join(names)}"
    fields: dict[str, Any] = dict(
        short=f"auto-SAC@{'/'.join(names)}", budget_bytes=target,
        sac_milp_budget_gib=(target - offset) / GIB,
        sac_milp_unmodelled_bytes=offset, sac_milp_no_ac_peak_bytes=stats.model_peak_bytes,
        estimate_mode=stats.estimate_mode, estimators_s=stats.collect_s,
        no_backward_snapshot_modules=stats.filled)
    if runner.out_of_time():
        row(label, "peer", status=TIME_UP, **fields)
        return False
    began = time.perf_counter()
    try:
        plan = solve_auto_sac(stats, target - offset)
    except Exception as error:
        row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300], **fields)
        return False
    if plan is None:
        row(label, "peer", status=f"infeasible: sac_milp found no plan within "
            f"{(target - offset) / GIB:.4f} GiB of its memory model (its no-checkpointing "
            f"peak: {stats.model_peak_bytes / GIB:.4f} GiB)", **fields)
        return False
    policies, unmatched = _aligned_policies(plan, inputs.eager)
    fields.update(
        predicted_peak_bytes=plan.peak_bytes + offset,
        planning_s=time.perf_counter() - began + (stats.collect_s if first else 0.0),
        planning_how=("estimators + sac_milp" if first else "sac_milp (stats reused)"),
        sac_milp_peak_bytes=plan.peak_bytes, sac_milp_recompute_ms=plan.recompute_ms,
        ac_decisions=plan.ac_decisions,
        saved_ops={f: f"{sum(d)}/{len(d)}" for f, (_, d) in policies.items()},
        widened_modules=plan.widened, eager_ops_not_in_sac_estimator=unmatched)
    try:
        peak, ms, base, grads = _run_auto_sac(zm, runner, policies, fields)
    except Exception as error:  # e.g. ops that differ from the recorded eager ones
        row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300], **fields)
        return True
    equal, diff = grads_match(reference, grads)
    row(label, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
        within_budget=peak <= target, peak_error=(fields["predicted_peak_bytes"] - peak) / peak,
        grads_equal=equal, grad_max_abs_diff=diff, **fields)
    return True


def auto_sac_peer(zm: zoo.ZooModel, runner: Runner, device: str, rows: list[dict[str, Any]],
                  reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]]
                  ) -> None:
    """torch's auto-SAC at the measured peak of each other peer (see the module docstring)."""
    inputs = _auto_sac_inputs(zm, runner, device, rows)
    if isinstance(inputs, str):
        row(AUTO_SAC, "peer", status=inputs)
        return
    first = True  # the first plan's planning time includes the estimators'
    for target, names in inputs.targets:
        planned = _auto_sac_at(zm, runner, inputs, target, names, first, reference, row)
        first = first and not planned
