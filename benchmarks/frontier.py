"""Memory/time frontier: our plans against how people checkpoint today, in one process.

For each model, every strategy is applied to the same model and inputs, and each run's peak
memory (MemTracker on CPU, the CUDA allocator on GPU), median step time and gradients are
measured. Our plans are made at budgets equal to each peer's measured peak.

    python benchmarks/frontier.py                 # CPU mode (<= 10 min on 2 cores)
    python benchmarks/frontier.py --device cuda   # GPT-2-medium 24x1024, batch 8x1024, fp32
    python benchmarks/frontier.py --quick         # smallest sizes, for the smoke test
    python benchmarks/frontier.py --autocast bf16 # every step under torch.autocast(bfloat16)

Writes benchmarks/results/frontier-<device>[-bf16].{json,md,png} (``--out`` to change the
folder). Every number written is measured in that run (``--models``/``--peers`` for a short
run). With ``--autocast bf16`` every step (peers, ours, the interleaved no-checkpointing
steps) runs its forward under ``torch.autocast(device, torch.bfloat16)`` and our plans are
made with ``optimize(..., autocast=torch.bfloat16)``; gradients are compared with the
no-checkpointing step of the same precision.

Peer "torch.compile" (opt-in: ``--peers compile``) is the model compiled once per
``activation_memory_budget`` of ``torch._functorch.config`` (its min-cut partitioner then
recomputes in the backward to keep that share of the saved activations): inductor on CUDA,
``aot_eager_decomp_partition`` (the same partitioner, no code generation) on CPU. Compiling
reorders floating point, so its gradients are compared within a relative tolerance
(``grad_rel_error``: the largest over parameters of ||g - g_ref|| / ||g_ref||), not bit for bit.
With dropout they are not comparable: inductor draws its own masks, and on the CPU path (torch
2.14.1) a budget below 1 recomputes dropout in the backward with fresh random numbers (same
loss, gradients ~80 % off on gpt tiny); ``gpu_suite.py`` runs its model with dropout 0.

Peer "torch auto-SAC (sac_ilp)" is torch's own automatic selective checkpointing
(``torch.distributed._tools``, needs ``pulp`` and ``pwlf``), run as torch's tests do: one
training step of a fake-tensor copy of the model under MemTracker, RuntimeEstimator and
SACEstimator, ``aggregate_stats`` + ``parse_module_info``, then ``sac_milp`` picks the modules
to checkpoint and the share of each one's activations to discard, and
``get_optimal_checkpointing_policy_per_module`` (at 1 - that share) picks the ops each of those
modules keeps; each is then run under ``checkpoint(use_reentrant=False)`` with a
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

import argparse
import contextlib
import copy
import datetime
import difflib
import functools
import io
import json
import logging
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map, tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import planner
import planner.measure
from planner import zoo
from planner.api import measure_step, replan
from planner.emit import checkpointed_modules
from planner.measure import PeakTracker
from planner.plan import InfeasibleBudgetError
from solvers import Problem, Schedule, SimulationError, baselines, simulate

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("none", "every-layer", "every-2nd", "every-4th", "chen-sqrt-n", "sac-matmuls",
         "sac-linear",
         "auto-sac-milp", "rockmate")
QUICK_PEERS = ("none", "every-layer", "sac-matmuls", "auto-sac-milp", "rockmate")
# every peer in the order run ("compile" only when asked for: it compiles once per budget)
ALL_PEERS = (*PEERS[:PEERS.index("auto-sac-milp")], "compile",
             *PEERS[PEERS.index("auto-sac-milp"):])
COMPILE = "torch.compile"
COMPILE_BUDGETS = (0.5, 0.1)
# relative gradient error allowed to a compiled step, by autocast dtype (None: fp32)
GRAD_TOLERANCE: dict[torch.dtype | None, float] = {None: 1e-4, torch.bfloat16: 5e-2,
                                                   torch.float16: 1e-2}
TIME_UP = "not run: the run's time limit was reached"


# --------------------------------------------------------------------------- models


def cases(device: str, quick: bool) -> list[tuple[str, dict[str, Any]]]:
    hf = zoo.has_transformers()
    if quick:
        return [("gpt", dict(size="tiny", batch=4, device=device))]
    if device == "cuda":
        out = [("gpt", dict(size="gpt2-medium", batch=8, device=device))]
        if hf:
            out += [("hf-llama", dict(size="tiny", batch=8, seq_len=1024, device=device,
                                      hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=16, num_attention_heads=16,
                                      num_key_value_heads=16, vocab_size=32000))]
        out.append(("resnet", dict(batch=256, device=device)))
        if hf:
            out.append(("hf-gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                        batch=8, seq_len=1024, device=device)))
        return out
    # CPU: batches where activations dominate memory, small enough for 2 cores
    out = [("gpt", dict(size="small", batch=4, device=device))]
    if hf:
        out.append(("hf-llama", dict(size="tiny", batch=4, seq_len=128, device=device,
                                     num_hidden_layers=4)))
    out.append(("resnet", dict(batch=16, device=device)))
    if hf:
        out.append(("hf-gpt2", dict(n_layer=4, batch=4, seq_len=128, device=device)))
    return out


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def default_loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output


# --------------------------------------------------------------------------- peers

MATMUL_OPS = frozenset(
    op for op in (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        *(getattr(torch.ops.aten, name).default for name in (
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        ) if hasattr(torch.ops.aten, name)),
    )
)


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's "op" SAC: keep matmul and attention outputs, recompute the rest."""
    return (CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def sac_context() -> Any:
    return create_selective_checkpoint_contexts(save_matmuls_policy)


LINEAR_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def save_linear_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The one-line policy users write: keep the linear layers' outputs (``mm``,
    ``addmm``), recompute attention and everything else."""
    return (CheckpointPolicy.MUST_SAVE if op in LINEAR_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def sac_linear_context() -> Any:
    return create_selective_checkpoint_contexts(save_linear_policy)


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, prefix: str, segments: list[list[int]],
                        context_fn: Callable[[], Any] | None = None) -> Iterator[None]:
    """Run each segment of the blocks at ``prefix`` under one non-reentrant checkpoint.

    The blocks' ``forward`` is patched on the instances (no wrapper modules), so parameter
    names, hooks and ``state_dict()`` stay the model's own; restored on exit.
    """
    blocks = model.get_submodule(prefix)
    originals = {i: blocks[i].forward for s in segments for i in s}
    last_output: dict[str, Any] = {}

    def segment_forward(members: list[int], *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            out = originals[members[0]](*a, **kw)
            for i in members[1:]:
                out = originals[i](_first(out), *a[1:], **kw)
            return out

        extra = {"context_fn": context_fn} if context_fn is not None else {}
        out = checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)
        last_output["out"] = out
        return out

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        out = last_output["out"]  # the segment already ran this block
        return (args[0], *out[1:]) if isinstance(out, tuple) else args[0]

    try:
        for members in segments:
            blocks[members[0]].forward = functools.partial(segment_forward, members)
            for i in members[1:]:
                blocks[i].forward = passthrough
        yield
    finally:
        for i in originals:
            del blocks[i].forward


@contextlib.contextmanager
def hf_every_layer(model: nn.Module) -> Iterator[None]:
    with warnings.catch_warnings():  # transformers 5 renames these; the old names still work
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()


def peer_context(name: str, zm: zoo.ZooModel) -> contextlib.AbstractContextManager:
    """The context under which ``zm.model`` runs with peer strategy ``name``."""
    n = len(zm.model.get_submodule(zm.block_prefix))
    if name == "none":
        return contextlib.nullcontext()
    if name == "every-layer":
        if hasattr(zm.model, "gradient_checkpointing_enable"):
            return hf_every_layer(zm.model)
        return checkpointed_blocks(zm.model, zm.block_prefix, [[i] for i in range(n)])
    if name in ("every-2nd", "every-4th"):
        step = 2 if name == "every-2nd" else 4
        return checkpointed_blocks(zm.model, zm.block_prefix,
                                   [[i] for i in range(step - 1, n, step)])
    if name == "chen-sqrt-n":
        size = max(1, round(math.sqrt(n)))
        return checkpointed_blocks(zm.model, zm.block_prefix,
                                   [list(range(i, min(i + size, n))) for i in range(0, n, size)])
    if name in ("sac-matmuls", "sac-linear"):
        return checkpointed_blocks(zm.model, zm.block_prefix, [[i] for i in range(n)],
                                   context_fn=sac_context if name == "sac-matmuls"
                                   else sac_linear_context)
    raise KeyError(name)


def peer_not_run(name: str, device: str) -> str | None:
    """Why peer ``name`` cannot run here, or None."""
    if name == "rockmate":
        if device != "cuda":
            return "not run: no GPU (Rockmate is GPU only)"
        try:
            import rockmate  # noqa: F401
        except ImportError as error:
            return f"not run: rockmate not installed ({error})"
        return "not run: Rockmate adapter not written for this torch version"
    if name == "auto-sac-milp":
        return auto_sac_not_run()
    if name == "compile" and not hasattr(torch._functorch.config, "activation_memory_budget"):
        return (f"not run: torch {torch.__version__} has no "
                "torch._functorch.config.activation_memory_budget")
    return None


# --------------------------------------------------------------------------- torch.compile


class _CompiledRegionTracker(PeakTracker):
    """PeakTracker that lets Dynamo run compiled code under it: Dynamo runs a frame eagerly
    while a dispatch mode that does not ignore compile internals is active."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


@contextlib.contextmanager
def _compiled_code_measured(device: str) -> Iterator[None]:
    """On CPU, ``measure_step``'s PeakTracker swapped for one under which the compiled code
    runs (the warm-up step compiled it outside any mode); on CUDA the allocator measures."""
    if device == "cuda":
        yield
        return
    original = planner.measure.PeakTracker
    planner.measure.PeakTracker = _CompiledRegionTracker
    try:
        yield
    finally:
        planner.measure.PeakTracker = original


def compile_backend(device: str) -> str:
    """Inductor on CUDA; on CPU the min-cut partitioner without code generation."""
    return "inductor" if device == "cuda" else "aot_eager_decomp_partition"


def grads_rel_error(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
                    ) -> float:
    """The largest over parameters of ||g - g_ref|| / ||g_ref|| (absolute where g_ref is 0)."""
    if reference.keys() != grads.keys():
        return math.inf
    worst = 0.0
    for k, ref in reference.items():
        diff, scale = float((grads[k].float() - ref.float()).norm()), float(ref.float().norm())
        worst = max(worst, diff / scale if scale else diff)
    return worst


def compile_peer(zm: zoo.ZooModel, runner: Runner, budgets: tuple[float, ...],
                 reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]]
                 ) -> None:
    """The model under ``torch.compile`` at each ``activation_memory_budget``: compiled
    afresh per budget (``torch._dynamo.reset()``), the partition made at the warm-up step
    inside ``torch._functorch.config.patch``; then measured like the other peers."""
    backend = compile_backend(runner.device)
    tolerance = GRAD_TOLERANCE.get(runner.autocast, 5e-2)
    for budget in budgets:
        label = f"{COMPILE} (activation_memory_budget {budget:g})"
        fields: dict[str, Any] = dict(short=f"compile@{budget:g}", backend=backend,
                                      activation_memory_budget=budget)
        if runner.out_of_time():
            row(label, "peer", status=TIME_UP, **fields)
            continue
        torch._dynamo.reset()
        try:
            with torch._functorch.config.patch(activation_memory_budget=budget), \
                    _compiled_code_measured(runner.device):
                compiled = torch.compile(zm.model, backend=backend)
                began = time.perf_counter()
                runner.warm_up(compiled)  # compiles forward and backward: the partition
                fields["compile_s"] = time.perf_counter() - began
                peak, ms, base, grads = runner.run(compiled)
        except Exception as error:  # a peer failing is a result to record
            row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300],
                **fields)
            continue
        finally:
            torch._dynamo.reset()
        equal, diff = grads_match(reference, grads)
        rel = grads_rel_error(reference, grads)
        row(label, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
            grads_equal=equal, grad_max_abs_diff=diff, grad_rel_error=rel,
            grad_tolerance=tolerance, grads_close=rel <= tolerance, **fields)


# --------------------------------------------------------------------------- torch auto-SAC

AUTO_SAC = "torch auto-SAC (sac_ilp)"


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


class AutoSACStats(NamedTuple):  # NamedTuple: the smoke test loads this file unregistered
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


def collect_auto_sac_stats(zm: zoo.ZooModel, device: str,
                           autocast: torch.dtype | None = None) -> AutoSACStats:
    """Run one step of a fake-tensor copy of ``zm.model`` under torch's MemTracker,
    RuntimeEstimator and SACEstimator (as torch's test_sac_ilp does; each forward under
    ``autocast`` when given) and aggregate them."""
    import numpy as np
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import (
        aggregate_stats,
        get_peak_memory_runtime_baseline,
        parse_module_info,
    )
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    began = time.perf_counter()
    model_device = next(zm.model.parameters()).device
    # the loss functions close over real targets: let the fake mode convert them
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for t in [*zm.model.parameters(), *zm.model.buffers()]:
        fake = fake_mode.from_tensor(t.detach())
        memo[id(t)] = (nn.Parameter(fake, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else fake)
    model = copy.deepcopy(zm.model, memo)  # same modules, fake parameters and buffers
    args, kwargs = split_inputs(zm.example_inputs)
    args, kwargs = tree_map_only(torch.Tensor, fake_mode.from_tensor, (args, kwargs))
    loss_fn = zm.loss_fn or default_loss
    mode = "operator-level-benchmark"
    cpu = device != "cuda"  # torch's estimate modes need CUDA

    with torch.random.fork_rng(), fake_mode, contextlib.redirect_stdout(io.StringIO()):
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

    np.random.seed(0)  # pwlf fits the trade-off curves by differential evolution
    module_info = aggregate_stats(model, mem_tracker, runtime_estimator, sac_estimator,
                                  model_device)
    graph = parse_module_info(module_info)
    model_peak, _ = get_peak_memory_runtime_baseline(graph)
    return AutoSACStats(graph, dict(sac_estimator.sac_mod_stats), model_peak,
                        mode + (" (CPU port)" if cpu else ""), time.perf_counter() - began,
                        filled)


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


@contextlib.contextmanager
def _planned(model: nn.Module, plan: planner.Plan) -> Iterator[None]:
    """``plan`` applied around one step. A planned call checks its op stream against the
    plan on its first training call after ``apply`` (a selective-checkpoint dispatch mode
    over its ops); a training loop applies once, so that check runs on the first step only,
    here too: the timed steps do not pay it (before, every timed step did)."""
    planner.apply(model, plan)
    key = (plan.fingerprint, plan.schedule.describe())
    if key in _OPS_CHECKED:
        for wrapper in checkpointed_modules(model).values():
            wrapper.checked = True
    try:
        yield
        _OPS_CHECKED.add(key)
    finally:
        planner.remove(model)


_OPS_CHECKED: set[tuple[str, str]] = set()  # plans whose op streams were checked once


# --------------------------------------------------------------------------- measuring


def autocast_context(device: str, dtype: torch.dtype | None
                     ) -> contextlib.AbstractContextManager:
    """``torch.autocast(device, dtype)``, or nothing for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device, dtype=dtype)


def precision_name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class Runner:
    """Measures one callable module on fixed inputs: peak, gradients, median step time.

    ``autocast``: every step's forward and loss run under ``torch.autocast(dtype)``;
    ``deadline`` (a ``time.perf_counter()`` value): past it, ``out_of_time()`` says so;
    ``warmup``: untimed steps of each kind before the timed ones.
    """

    def __init__(self, zm: zoo.ZooModel, device: str, steps: int,
                 autocast: torch.dtype | None = None, deadline: float | None = None,
                 warmup: int = 2):
        self.zm, self.device, self.steps, self.warmup = zm, device, steps, warmup
        self.autocast, self.deadline = autocast, deadline
        self.autocast_name = None if autocast is None else str(autocast).removeprefix("torch.")
        self.args, self.kwargs = split_inputs(zm.example_inputs)
        self.loss_fn = zm.loss_fn or default_loss
        self.state = {k: v.detach().clone() for k, v in zm.model.state_dict().items()}
        self.names = {p: n for n, p in zm.model.named_parameters()}

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def _reset(self) -> None:
        self.zm.model.load_state_dict(self.state)
        self.zm.model.zero_grad(set_to_none=True)  # a run that failed mid-step leaves some
        torch.manual_seed(1234)
        if self.device == "cuda":
            torch.cuda.manual_seed_all(1234)

    def _peak_and_grads(self, module: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
        self._reset()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        # measure_step names gradients by module.named_parameters(): map to the model's names
        by_name = dict(module.named_parameters())
        peak, _, grads = measure_step(module, self.args, self.kwargs, self.loss_fn,
                                      self.autocast_name)
        return peak, {self.names[by_name[k]]: g for k, g in grads.items()}

    def _step_ms(self, module: nn.Module, context: Callable[[], Any]) -> float:
        with context():
            if self.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            with autocast_context(self.device, self.autocast):
                loss = self.loss_fn(module(*self.args, **self.kwargs))
            loss.backward()
            if self.device == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - begin) * 1e3
        module.zero_grad(set_to_none=True)
        return elapsed

    def warm_up(self, module: nn.Module) -> None:
        """One untimed step (e.g. the one that compiles), from the model's initial state."""
        self._reset()
        self._step_ms(module, contextlib.nullcontext)
        self._reset()

    def paired_ms(self, module: nn.Module, context: Callable[[], Any]) -> tuple[float, float]:
        """Median step ms of ``module`` under ``context`` and of the model without
        checkpointing, their steps interleaved (after ``warmup`` warm-up steps each), so load
        from other processes hits both alike."""
        plain = contextlib.nullcontext
        samples: tuple[list[float], list[float]] = ([], [])
        for i in range(self.steps + self.warmup):
            base = self._step_ms(self.zm.model, plain)
            ms = self._step_ms(module, context)
            if i >= self.warmup:
                samples[0].append(ms)
                samples[1].append(base)
        self._reset()
        return statistics.median(samples[0]), statistics.median(samples[1])

    def run(self, module: nn.Module, context: Callable[[], Any] = contextlib.nullcontext
            ) -> tuple[int, float, float, dict[str, torch.Tensor]]:
        """Peak bytes, median step ms, median no-checkpointing step ms, gradients."""
        with context():
            peak, grads = self._peak_and_grads(module)
        ms, base = self.paired_ms(module, context)
        return peak, ms, base, grads


def grads_match(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
                ) -> tuple[bool, float]:
    """Bit-identical, and the largest absolute difference."""
    if reference.keys() != grads.keys():
        return False, math.inf
    diff = max((float((reference[k] - grads[k]).abs().max()) for k in reference), default=0.0)
    return all(torch.equal(reference[k], grads[k]) for k in reference), diff


def distinct_peaks(rows: list[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    """The measured peaks of ``rows`` (status ok), those within 0.5 % merged, ascending, each
    with the short names of the rows at it."""
    budgets: list[tuple[int, list[str]]] = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        for b in budgets:
            if abs(b[0] - r["peak_bytes"]) <= 0.005 * b[0]:
                b[1].append(r.get("short", r["strategy"]))
                break
        else:
            budgets.append((r["peak_bytes"], [r.get("short", r["strategy"])]))
    return sorted(budgets)


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


def auto_sac_peer(zm: zoo.ZooModel, runner: Runner, device: str, rows: list[dict[str, Any]],
                  reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]]
                  ) -> None:
    """torch's auto-SAC at the measured peak of each other peer (see the module docstring)."""
    none = next((r for r in rows if r["strategy"] == "none" and r.get("status") == "ok"), None)
    if none is None:
        row(AUTO_SAC, "peer", status="not run: needs the measured peak of 'none' to calibrate "
            "sac_milp's memory model")
        return
    targets = [(peak, names) for peak, names in distinct_peaks(
        [r for r in rows if r["kind"] == "peer" and r["strategy"] != "none"])
        if peak < 0.995 * none["peak_bytes"]]
    if not targets:
        row(AUTO_SAC, "peer", status="not run: no other peer's peak to solve it at")
        return
    if runner.out_of_time():
        row(AUTO_SAC, "peer", status=TIME_UP)
        return
    try:
        stats = collect_auto_sac_stats(zm, device, runner.autocast)
    except Exception as error:  # fake-tensor tracing, estimators or pwlf fits that fail
        row(AUTO_SAC, "peer", status=f"not run: torch's estimators failed on this model: "
            f"{type(error).__name__}: {error}"[:300])
        return
    try:
        eager = eager_op_names(zm, list(stats.sac_stats), runner.autocast)
    except Exception as error:
        row(AUTO_SAC, "peer", status=f"not run: recording the model's eager ops failed: "
            f"{type(error).__name__}: {error}"[:300])
        return
    # sac_milp counts parameters, gradients and activations; our measured peak also counts
    # the inputs and what the loss allocates: give it the target less that gap
    offset = none["peak_bytes"] - stats.model_peak_bytes
    first = True  # the first plan's planning time includes the estimators'
    for target, names in targets:
        label = f"{AUTO_SAC} @ {'/'.join(names)}"
        fields: dict[str, Any] = dict(
            short=f"auto-SAC@{'/'.join(names)}", budget_bytes=target,
            sac_milp_budget_gib=(target - offset) / GIB,
            sac_milp_unmodelled_bytes=offset, sac_milp_no_ac_peak_bytes=stats.model_peak_bytes,
            estimate_mode=stats.estimate_mode, estimators_s=stats.collect_s,
            no_backward_snapshot_modules=stats.filled)
        if runner.out_of_time():
            row(label, "peer", status=TIME_UP, **fields)
            continue
        began = time.perf_counter()
        try:
            plan = solve_auto_sac(stats, target - offset)
        except Exception as error:
            row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300], **fields)
            continue
        if plan is None:
            row(label, "peer", status=f"infeasible: sac_milp found no plan within "
                f"{(target - offset) / GIB:.4f} GiB of its memory model (its no-checkpointing "
                f"peak: {stats.model_peak_bytes / GIB:.4f} GiB)", **fields)
            continue
        policies, unmatched = _aligned_policies(plan, eager)
        planning_s = time.perf_counter() - began + (stats.collect_s if first else 0.0)
        fields.update(
            predicted_peak_bytes=plan.peak_bytes + offset, planning_s=planning_s,
            planning_how=("estimators + sac_milp" if first else "sac_milp (stats reused)"),
            sac_milp_peak_bytes=plan.peak_bytes, sac_milp_recompute_ms=plan.recompute_ms,
            ac_decisions=plan.ac_decisions,
            saved_ops={f: f"{sum(d)}/{len(d)}" for f, (_, d) in policies.items()},
            widened_modules=plan.widened, eager_ops_not_in_sac_estimator=unmatched)
        first = False
        try:
            peak, ms, base, grads = _run_auto_sac(zm, runner, policies, fields)
        except Exception as error:  # e.g. ops that differ from the recorded eager ones
            row(label, "peer", status=f"failed: {type(error).__name__}: {error}"[:300], **fields)
            continue
        equal, diff = grads_match(reference, grads)
        row(label, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
            within_budget=peak <= target,
            peak_error=(fields["predicted_peak_bytes"] - peak) / peak,
            grads_equal=equal, grad_max_abs_diff=diff, **fields)


def bench_model(name: str, kwargs: dict[str, Any], device: str, steps: int, quick: bool,
                timing: str, peers: list[str] | None = None, *,
                autocast: torch.dtype | None = None, deadline: float | None = None,
                compile_budgets: tuple[float, ...] = COMPILE_BUDGETS, warmup: int = 2,
                op_ranges: bool = True) -> list[dict[str, Any]]:
    """Every selected peer, then our plans at their measured peaks, on zoo model ``name``.
    ``autocast``: every step under ``torch.autocast(dtype)``; ``deadline``: a
    ``time.perf_counter()`` value past which what is left is recorded as not run;
    ``warmup``: untimed steps before the timed ones; ``op_ranges``: as in ``optimize``
    (the smoke runs plan module calls only, for the test suite's time)."""
    zm = zoo.get(name, **kwargs)
    runner = Runner(zm, device, steps, autocast, deadline, warmup)
    rows: list[dict[str, Any]] = []
    short = {"batch": "b", "seq_len": "seq", "num_hidden_layers": "L", "n_layer": "L"}
    model_label = f"{zm.name} " + " ".join(f"{short.get(k, k)}{v}" for k, v in kwargs.items()
                                           if k not in ("device", "size"))

    def row(strategy: str, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"model": model_label, "strategy": strategy, "kind": kind, **fields}
        if "step_ms" in out:
            out["overhead"] = out["step_ms"] / out["base_step_ms"] - 1.0
        rows.append(out)
        print(format_row(out), flush=True)
        return out

    selected = QUICK_PEERS if quick else PEERS
    if peers is not None:  # "none" always: it is the reference for gradients and memory
        selected = tuple(p for p in ALL_PEERS if p == "none" or p in peers)
    reference: dict[str, torch.Tensor] = {}
    for peer in selected:
        reason = peer_not_run(peer, device) or (TIME_UP if runner.out_of_time() else None)
        if reason:
            row({"auto-sac-milp": AUTO_SAC, "compile": COMPILE}.get(peer, peer), "peer",
                status=reason)
        elif peer == "auto-sac-milp":
            auto_sac_peer(zm, runner, device, rows, reference, row)
        elif peer == "compile":
            compile_peer(zm, runner, compile_budgets, reference, row)
        else:
            grads = eager_peer(peer, zm, runner, reference, row)
            reference = grads if peer == "none" and grads is not None else reference
    first = our_plans(zm, runner, timing, rows, reference, row, op_ranges)
    if first is not None:
        replay_peers(zm, first, rows)
    return rows


def peer_schedule(peer: str, problem: Problem, n_blocks: int) -> Schedule | None:
    """The schedule hand-written peer ``peer`` runs, on our profile's problem (None for
    peers the simulator does not replay, or when the profile's blocks are not the model's
    ``n_blocks`` layers)."""
    blocks = baselines.units(problem)
    if len(blocks) != n_blocks:
        return None
    keep = {"sac-matmuls": problem.is_matmul, "sac-linear": problem.is_linear}.get(peer)
    if peer == "none":
        segments: list[tuple[int, int]] = []
    elif peer == "every-layer" or keep is not None:
        segments = blocks
    elif peer in ("every-2nd", "every-4th"):
        step = 2 if peer == "every-2nd" else 4
        segments = blocks[step - 1::step]
    elif peer == "chen-sqrt-n":
        size = max(1, round(math.sqrt(n_blocks)))
        segments = [(blocks[i][0], blocks[min(i + size, n_blocks) - 1][1])
                    for i in range(0, n_blocks, size)]
    else:
        return None
    regions = [run for a, b in segments for run in problem.recomputable_runs(a, b)]
    kept = [i for a, b in regions for i in range(a, b)
            if keep is not None and keep(i) and problem.can_keep(i)]
    return Schedule.from_segments(problem.n_nodes, regions, keep=kept)


def replay_peers(zm: zoo.ZooModel, plan: planner.Plan, rows: list[dict[str, Any]]) -> None:
    """Each measured hand-written peer replayed by our simulator on our profile (its
    predicted peak and overhead: ``schedule``), and each plan of ours marked with the peers
    whose schedule it is (``same_plan_as``): those pairs can only tie."""
    problem = plan.problem()
    n_blocks = len(zm.model.get_submodule(zm.block_prefix))
    schedules: dict[str, str] = {}
    for r in rows:
        if r["kind"] != "peer" or r.get("status") != "ok":
            continue
        schedule = peer_schedule(r["strategy"], problem, n_blocks)
        if schedule is None:
            continue
        try:
            timeline = simulate(problem, schedule)
        except SimulationError as error:  # e.g. Chen's segments of several layers
            r["not_replayed"] = str(error)[:200]
            continue
        schedules[r["strategy"]] = r["schedule"] = schedule.describe()
        r["predicted_peak_bytes_replayed"] = timeline.peak_bytes
        r["predicted_overhead"] = timeline.recompute_time_ms / plan.baseline_step_ms
    for r in rows:
        if r["kind"] == "ours" and "plan_schedule" in r:
            r["same_plan_as"] = [peer for peer, text in schedules.items()
                                 if text == r["plan_schedule"]]


def pairings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each plan of ours against each measured peer whose peak was its budget: the two
    measured overheads, and whether the two run the same schedule (a tie within noise)."""
    peers = {(r["model"], r.get("short", r["strategy"])): r for r in rows
             if r["kind"] == "peer" and r.get("status") == "ok" and r["strategy"] != "none"}
    out = []
    for r in rows:
        if r["kind"] != "ours" or r.get("status") != "ok":
            continue
        for name in r["strategy"].removeprefix("ours @ ").split("/"):
            peer = peers.get((r["model"], name))
            if peer is None:
                continue
            out.append(dict(model=r["model"], peer=name, ours=r["overhead"],
                            theirs=peer["overhead"],
                            predicted_ours=r.get("predicted_overhead"),
                            predicted_theirs=peer.get("predicted_overhead"),
                            same_plan=name in r.get("same_plan_as", ())))
    return out


def eager_peer(peer: str, zm: zoo.ZooModel, runner: Runner,
               reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]]
               ) -> dict[str, torch.Tensor] | None:
    """Measure one hand-written peer strategy; its gradients (None if it failed)."""
    try:
        peak, ms, base, grads = runner.run(zm.model, functools.partial(peer_context, peer, zm))
    except Exception as error:  # a peer failing is a result to record
        row(peer, "peer", status=f"failed: {type(error).__name__}: {error}"[:300])
        return None
    equal, diff = grads_match(grads if peer == "none" else reference, grads)
    row(peer, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
        grads_equal=equal, grad_max_abs_diff=diff)
    return grads


def our_plans(zm: zoo.ZooModel, runner: Runner, timing: str, rows: list[dict[str, Any]],
              reference: dict[str, torch.Tensor], row: Callable[..., dict[str, Any]],
              op_ranges: bool = True) -> planner.Plan | None:
    """Our plans, one per distinct peer peak (torch auto-SAC's and torch.compile's included):
    the first via optimize() (profile + solve, timed), the others reuse its profile (replan,
    timed). Planned under the runner's autocast, and run under it. Returns the first."""
    first: planner.Plan | None = None
    for budget, peers in distinct_peaks(rows):
        label = f"ours @ {'/'.join(peers)}"
        if runner.out_of_time():
            row(label, "ours", status=TIME_UP, budget_bytes=budget)
            continue
        began = time.perf_counter()
        try:
            if first is None:
                first = planner.optimize(zm.model, zm.example_inputs, budget_gb=1e6,
                                         loss_fn=zm.loss_fn, timing=timing, progress=False,
                                         autocast=runner.autocast)
                how = f"optimize(timing={timing!r})"
            else:
                how = "replan (profile reused)"
            plan = replan(first, budget_bytes=budget, op_ranges=op_ranges)
        except InfeasibleBudgetError as error:
            row(label, "ours", status=f"infeasible: {error.args[0][:200]}", budget_bytes=budget)
            continue
        planning_s = time.perf_counter() - began
        # apply() instruments the model in place: applied only around each planned step,
        # so the interleaved no-checkpointing steps run the plain model
        peak, ms, base, grads = runner.run(zm.model, functools.partial(_planned, zm.model,
                                                                       plan))
        equal, diff = grads_match(reference, grads)
        row(label, "ours", status="ok", budget_bytes=budget, peak_bytes=peak, step_ms=ms,
            base_step_ms=base,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            peak_error=(plan.predicted_peak_bytes - peak) / peak,
            within_budget=peak <= budget, planning_s=planning_s, planning_how=how,
            solver=plan.solver.name, solver_status=plan.solver.status,
            autocast_dtype=plan.autocast_dtype, grads_equal=equal, grad_max_abs_diff=diff,
            plan_schedule=plan.schedule.describe(),
            predicted_overhead=plan.predicted_overhead)
    return first


# --------------------------------------------------------------------------- output


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f} %"


def _grads_word(r: dict[str, Any]) -> str:
    if "grads_close" in r and not r["grads_equal"]:  # compiled: within a tolerance
        return (f"{'close' if r['grads_close'] else 'NOT CLOSE'} (rel. error "
                f"{r['grad_rel_error']:.1e}, tolerance {r['grad_tolerance']:g})")
    return "equal" if r["grads_equal"] else "DIFFER"


def format_row(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"  {r['model']:<24} {r['strategy']:<28} {r['status']}"
    return (f"  {r['model']:<24} {r['strategy']:<28} peak {r['peak_bytes'] / GIB:8.4f} GiB  "
            f"step {r['step_ms']:8.1f} ms  {_pct(r.get('overhead')):>9}  "
            f"grads {_grads_word(r)}")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Frontier on {result['device_name']} ({result.get('precision', 'fp32')}, "
             f"torch {result['torch']}, {result['date']}, {result['mode']} mode, "
             f"{result['steps']} timed steps)", "",
             "| model | strategy | peak GiB | step ms | no-ckpt ms | overhead | budget GiB "
             "| within | predicted GiB | pred. error | planning s | grads equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status") != "ok":
            budget = f"{r['budget_bytes'] / GIB:.4f}" if "budget_bytes" in r else ""
            status = r["status"] if len(r["status"]) < 120 else r["status"][:117] + "..."
            lines.append(f"| {r['model']} | {r['strategy']} | {status} | | | | {budget} "
                         "| | | | | |")
            continue
        planned = "within_budget" in r  # ours, and torch's auto-SAC
        grads = "yes" if r["grads_equal"] else f"no (max diff {r['grad_max_abs_diff']:.2e})"
        if "grads_close" in r and not r["grads_equal"]:
            grads = _grads_word(r)
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['peak_bytes'] / GIB:.4f} | "
            f"{r['step_ms']:.1f} | {r['base_step_ms']:.1f} | {_pct(r.get('overhead'))} | "
            + (f"{r['budget_bytes'] / GIB:.4f} | {'yes' if r['within_budget'] else 'NO'} | "
               f"{r['predicted_peak_bytes'] / GIB:.4f} | {_pct(r['peak_error'])} | "
               f"{r['planning_s']:.1f} | " if planned else "| | | | | ")
            + grads + " |")
    lines += ["", f"Wall time of the whole run: {result['wall_s']:.0f} s. "
              "Overhead: median step time over that of the model without checkpointing, their "
              "steps interleaved in the same loop. Planning s: the first "
              "plan per model is `planner.optimize` (profile, solve); later ones "
              "reuse that profile (`planner.replan`).",
              "",
              f"{AUTO_SAC} @ X: torch's `sac_milp` + `get_optimal_checkpointing_policy_per_module`"
              " solved at peer X's measured peak (budget), less the memory its model leaves out "
              "(our measured no-checkpointing peak minus its estimate of it); predicted: its "
              "estimate plus that gap; planning s: the first per model includes its estimators "
              "(MemTracker, RuntimeEstimator, SACEstimator on a fake-tensor step). The JSON "
              "rows hold its decisions (`ac_decisions`, `saved_ops`) and the adaptations made "
              "(see frontier.py's docstring)."]
    if any(r["strategy"].startswith(COMPILE) for r in result["rows"]):
        lines += ["", f"{COMPILE} (activation_memory_budget b): the model compiled once per "
                  "budget (backend in the JSON rows, `compile_s` its compile time, not in the "
                  "step time); its gradients are compared within a tolerance (rel. error: the "
                  "largest over parameters of ||g - g_ref|| / ||g_ref||), since compiling "
                  "reorders floating point."]
    lines += pairing_lines(result.get("pairings", []))
    if result.get("precision", "fp32") != "fp32":
        lines += ["", f"Every step ran under `torch.autocast({result['autocast']})`; our plans "
                  f"were made with `optimize(..., autocast=torch.{result['autocast']})`; "
                  "gradients are compared with the no-checkpointing step of that precision."]
    return "\n".join(lines) + "\n"


def pairing_lines(pairs: list[dict[str, Any]]) -> list[str]:
    """The pairings of our plans with the peers at whose peak they were made: how many,
    how many run the peer's own schedule, and where ours measured slower, the predictions."""
    if not pairs:
        return []
    differ = [p for p in pairs if not p["same_plan"]]
    wins = [p for p in differ if p["ours"] < p["theirs"]]
    lines = ["", "## Ours against each peer at that peer's peak", "",
             f"{len(pairs)} pairings; in {len(pairs) - len(differ)} our plan is the peer's "
             f"own schedule (a tie within noise). Of the {len(differ)} where the plans "
             f"differ, ours measured a lower overhead in {len(wins)}. Predicted: the peer "
             "replayed by our simulator on our profile (blank: a peer it does not replay)."]
    losses = [p for p in differ if p not in wins]
    if losses:
        lines += ["", "| model | peer | ours measured | peer measured | ours predicted "
                  "| peer predicted |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['model']} | {p['peer']} | {_pct(p['ours'])} | {_pct(p['theirs'])} "
                  f"| {_pct(p['predicted_ours'])} | {_pct(p['predicted_theirs'])} |"
                  for p in losses]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    cols = min(2, len(models))
    nrows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 5.2 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        ok = [r for r in result["rows"] if r["model"] == model and r.get("status") == "ok"]
        auto = sorted((r for r in ok if r["strategy"].startswith(AUTO_SAC)),
                      key=lambda r: r["peak_bytes"])
        peers = [r for r in ok if r["kind"] == "peer" and r not in auto]
        ours = sorted((r for r in ok if r["kind"] == "ours"), key=lambda r: r["peak_bytes"])
        for r in peers:
            x, y = r["peak_bytes"] / GIB, 100 * r.get("overhead", 0.0)
            ax.scatter(x, y, s=60, marker="s", zorder=3)
            ax.annotate(r.get("short", r["strategy"]), (x, y), textcoords="offset points",
                        xytext=(6, 6), fontsize=9)
        if auto:
            ax.plot([r["peak_bytes"] / GIB for r in auto],
                    [100 * r.get("overhead", 0.0) for r in auto], "^--", color="m",
                    lw=1.5, label=f"{AUTO_SAC} (budget = a peer's peak)", zorder=4)
        if ours:
            ax.plot([r["peak_bytes"] / GIB for r in ours],
                    [100 * r.get("overhead", 0.0) for r in ours], "o-", color="black",
                    lw=2, label="our plans (budget = a peer's peak)", zorder=4)
        if ours or auto:
            ax.legend(loc="best", fontsize=9)
        ax.margins(x=0.1, y=0.18)  # room for the labels
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(model, fontsize=11)
        ax.set_xlabel("measured peak (GiB)")
        ax.set_ylabel("step-time overhead vs no checkpointing (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle(f"Memory/time frontier: {result['device_name']}, "
                 f"{result.get('precision', 'fp32')}\ntorch {result['torch']}, "
                 f"{result['date']}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def make_result(device: str, mode: str, steps: int, timing: str, autocast: torch.dtype | None,
                started: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document of one run (``started``: its ``time.perf_counter()`` start)."""
    return {
        "torch": torch.__version__, "device": device, "device_name": device_name(device),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": mode, "steps": steps, "timing": timing,
        "precision": precision_name(autocast),
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "python": platform.python_version(), "wall_s": time.perf_counter() - started,
        "rows": rows, "pairings": pairings(rows),
    }


def write_result(result: dict[str, Any], out: Path, stem: str) -> None:
    """``out/stem.{json,md,png}``, and the table on the terminal."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    table = markdown(result)
    (out / f"{stem}.md").write_text(table)
    plot(result, out / f"{stem}.png")
    print()
    print(table)
    print(f"wrote {out / stem}.{{json,md,png}}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smallest sizes, 2 timed steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (7; --quick 2)")
    parser.add_argument("--timing", default="measure", choices=["measure", "estimate"])
    parser.add_argument("--autocast", default=None, choices=sorted(AUTOCAST),
                        help="run every step under torch.autocast(this dtype)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models", nargs="*", default=None, help="zoo names to keep")
    parser.add_argument("--peers", nargs="*", default=None, choices=ALL_PEERS,
                        help="peer strategies to run ('none' always runs)")
    opts = parser.parse_args(argv)
    steps = opts.steps or (2 if opts.quick else 7)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    autocast = AUTOCAST.get(opts.autocast)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name, kwargs in cases(opts.device, opts.quick):
        if opts.models and name not in opts.models:
            continue
        print(f"== {name} {kwargs}", flush=True)
        rows += bench_model(name, kwargs, opts.device, steps, opts.quick, opts.timing,
                            opts.peers, autocast=autocast, op_ranges=not opts.quick)
    result = make_result(opts.device, "quick" if opts.quick else "full", steps, opts.timing,
                         autocast, started, rows)
    stem = (f"frontier-{opts.device}" + (f"-{opts.autocast}" if opts.autocast else "")
            + ("-quick" if opts.quick else ""))
    write_result(result, opts.out, stem)
    return result


if __name__ == "__main__":
    main()
