"""The hand-written peers of ``benchmarks/frontier.py``, as people write them, on a real model.

Which blocks each checkpoints is ``solvers.baselines.POLICIES`` ("every-layer", "every-2nd",
"every-4th", "chen-sqrt-n", "sac-matmuls", "sac-linear", "none"): here each segment of those
blocks runs under one ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (with a
selective-checkpoint policy for the "sac-" ones; Hugging Face models' "every-layer" by their
own ``gradient_checkpointing_enable``), and our simulator replays the same policy on our
profile (``policy_schedule``), so the measured peer and its replay are one schedule.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from frontier_measure import Runner, grads_match
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import planner
from planner import zoo
from solvers import Problem, Schedule, SimulationError, baselines, simulate

# ------------------------------------------------------------------- measured


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
def checkpointed_blocks(model: nn.Module, prefix: str, segments: list[tuple[int, int]],
                        context_fn: Callable[[], Any] | None = None) -> Iterator[None]:
    """Run each segment ``[start, stop)`` of the blocks at ``prefix`` under one non-reentrant
    checkpoint (``context_fn``: its selective-checkpoint policy).

    The blocks' ``forward`` is patched on the instances (no wrapper modules), so parameter
    names, hooks and ``state_dict()`` stay the model's own; restored on exit.
    """
    blocks = model.get_submodule(prefix)
    groups = [list(range(start, stop)) for start, stop in segments]
    originals = {i: blocks[i].forward for members in groups for i in members}
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
        for members in groups:
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


# the ops each selective policy keeps (`baselines.Policy.keep`), as torch policies
SAC_CONTEXTS: dict[str | None, Callable[[], Any] | None] = {
    None: None, "matmul": sac_context, "linear": sac_linear_context}


def peer_context(name: str, zm: zoo.ZooModel) -> contextlib.AbstractContextManager:
    """The context under which ``zm.model`` runs hand-written policy ``name``
    (``baselines.POLICIES``): each of its segments of ``zm.block_prefix``'s blocks under one
    checkpoint, keeping the policy's ops. Hugging Face models checkpoint every layer the way
    their users do, by ``gradient_checkpointing_enable`` (each decoder layer: the same blocks)."""
    if name == "every-layer" and hasattr(zm.model, "gradient_checkpointing_enable"):
        return hf_every_layer(zm.model)
    segments = baselines.policy_segments(name, len(zm.model.get_submodule(zm.block_prefix)))
    if not segments:
        return contextlib.nullcontext()
    return checkpointed_blocks(zm.model, zm.block_prefix, segments,
                               SAC_CONTEXTS[baselines.POLICIES[name].keep])


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


# ------------------------------------------------------------------- replayed


def peer_schedule(peer: str, problem: Problem, n_blocks: int) -> Schedule | None:
    """The schedule hand-written peer ``peer`` runs, on our profile's problem: its policy's
    ``baselines.policy_schedule`` (None for peers that are no such policy, or when the
    profile's blocks are not the model's ``n_blocks`` layers)."""
    if peer not in baselines.POLICIES or len(baselines.units(problem)) != n_blocks:
        return None
    return baselines.policy_schedule(peer, problem)


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
