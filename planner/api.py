"""optimize / apply / remove / verify: plan a model's checkpoints under a memory budget.

The public surface of the planner. :func:`optimize` (profile, then solve) is here; the
rest is re-exported from the modules that hold it: :mod:`planner.arguments` (argument
checks), :mod:`planner.model_state` (the model as planning finds it),
:mod:`planner.profiling` (``profile_model``), :mod:`planner.solving` (``solve``,
``replan``), :mod:`planner.runtime.install` (``apply``, ``remove``) and
:mod:`planner.verification` (``verify``, ``measure_step``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from planner.arguments import (
    MAX_BUDGET_BYTES,
    MIN_BUDGET_BYTES,
    SolveOptions,
    _budget_bytes,
    default_host_budget_bytes,
    host_budget_arg,
)
from planner.bucket_planning import plan_envelope
from planner.compile_fit import plan_compiled
from planner.config import GROUPS, PARALLEL, PROFILING, STEP, PlanConfig, shows_options
from planner.model_state import structure_fingerprint
from planner.plan import Plan, PlanMismatchWarning
from planner.plan_table import PlanTable
from planner.profiling import UNTRACED_LINES, ProfiledStep, profile_model
from planner.runtime.applying import apply
from planner.runtime.guard import PlanGuard
from planner.runtime.install import region_specs, remove
from planner.solving import plan_for_profile, plan_for_schedule, replan, solve, solve_profiled
from planner.verification import VerifyReport, measure_step, verify

__all__ = ["MAX_BUDGET_BYTES", "MIN_BUDGET_BYTES", "UNTRACED_LINES", "PlanConfig", "PlanGuard",
           "PlanMismatchWarning", "ProfiledStep", "SolveOptions", "VerifyReport", "apply",
           "default_host_budget_bytes", "host_budget_arg", "measure_step", "optimize",
           "plan_for_profile", "plan_for_schedule", "profile_model", "region_specs", "remove",
           "replan", "solve", "structure_fingerprint", "verify"]


@shows_options(*GROUPS)
def optimize(model: nn.Module, example_inputs: Any = None, *, budget_gb: float,
             config: PlanConfig | None = None, **options: Any) -> Plan | PlanTable:
    """Plan which module calls to checkpoint so one training step peaks under ``budget_gb``.

    The budget covers parameters, gradients, buffers, inputs, activations, temporaries and,
    when ``optimizer`` is given, its state and its ``step()`` (1 GiB = 2**30 bytes), for one
    step run as ``loss_fn(model(*inputs)).backward()``. ``autocast`` plans mixed precision
    (e.g. ``torch.bfloat16``); called inside ``torch.autocast``, that dtype is used.
    ``time_limit_s`` bounds the solving (profiling comes on top; a budget no plan meets
    takes up to a quarter more, searching for the lowest peak the error names). See
    :func:`profiles.profile` for ``timing``, ``device`` and ``execution``.

    Gradients: by default each step starts with no ``.grad`` (``zero_grad()``'s default,
    ``set_to_none=True``); ``grad_accumulation=True`` plans steps that start with every
    ``.grad`` allocated (micro-batches of gradient accumulation,
    ``zero_grad(set_to_none=False)``); ``zero_grad_after_forward=True`` plans steps that
    start with the last backward's ``.grad`` and free them between their forward and
    backward (Lightning's ``training_step``, ``zero_grad``, ``backward``). The planned model
    warns when a step starts with gradients its plan did not count.

    Any state of the object plans the same training step: a plan already applied (it stays
    installed until :func:`apply` replaces it), gradients left by a backward, eval mode
    (the training step is planned; the note says so). To plan one profile at several
    budgets use :func:`profile_model` and :func:`solve`.

    Parallel training: ``parallelize=`` is the training script's own function
    ``parallelize(model, mesh)`` (``fully_shard`` with its mixed-precision and reshard
    policies, ``parallelize_module`` for tensor parallel), ``mesh_shape=(dp,)`` or
    ``(dp, tp)`` with ``mesh_dim_names``. The budget is per rank and ``example_inputs`` one
    rank's batch: the function runs on a copy of the model over a fake process group of the
    mesh's size, and that rank's real step is profiled (:mod:`profiles.parallel`). Train
    with ``apply(model, plan)`` first, then ``parallelize(model, mesh)``, as torchtitan
    orders them. ``sharding="fsdp2"`` over ``world_size`` ranks is torchtitan's FSDP2
    recipe as such a function (units: ``shard_modules``, default the model's repeated
    blocks); ``sharding="ddp"`` adds DDP's gradient buckets to the single process's step.

    ``offload=True`` also lets the plan send module calls' saved activations to host memory
    and back (:mod:`planner.runtime.offload`), within ``host_budget_gb`` (default
    ``default_host_budget_bytes``); ``plan.offloads`` and ``plan.stall_ms`` say what and
    at what cost.

    ``op_ranges=False`` checkpoints module calls only: no op range inside a forward
    (:mod:`profiles.traced`), so no module's forward is replaced by its fx trace.

    ``deterministic=True`` gives the same plan, status and bound on a loaded machine as on
    a quiet one: CP-SAT then counts ``time_limit_s`` in its own measure of work (about
    seconds on a quiet machine, more on a busy one) and the DP and offload's search
    (``offload=True``) run to their own end, so the call may take longer than the limit
    (GPT-2-medium with offload: minutes).

    A pipeline stage: ``model`` is the stage's module, ``example_inputs`` one microbatch of
    its input (after the first stage, a tensor that requires grad), and ``pipeline=dict(
    schedule="1F1B", stage_index=r, num_stages=p, n_microbatches=m)`` (torch's names;
    ``"GPipe"`` and ``"InterleavedZeroBubble"`` too; ``target_bytes``: the last stage's
    target per microbatch). The plan keeps the stage's peak over one step of its schedule
    within ``budget_gb``: the microbatches it holds, its receive buffers, and on the last
    stage ``loss_fn``'s outputs (:mod:`planner.pipeline.stage`); ``plan.pipeline`` says the stage
    and that peak. Under a zero-bubble schedule a stage after the first runs as profiled
    (``planner.pipeline.split_backward``). Several stages per rank (``Interleaved1F1B``,
    ``ZBVZeroBubble``, ``DualPipeV``): :func:`planner.plan_rank`.

    The batches a plan covers: ``envelope=Envelope(max_length=512)`` (or its fields as a
    dict) plans every batch a loader may give (:mod:`planner.envelope`): up to
    ``max_length`` tokens per row, padded or not, with the trainer's resident batches, as a
    :class:`~planner.plan_table.PlanTable` of one plan per bucket of lengths and mask branch
    (``buckets="pow2"``: a plan per power of two). ``apply`` installs the table; each step
    takes its bucket's plan. Without an envelope the plan covers batches no larger than
    ``example_inputs``, of its mask branch.

    A compiled step: ``compiled="model"`` (you train ``torch.compile(model)``) or
    ``"blocks"`` (each repeated block's ``.compile()`` after ``apply``, as torchtitan does)
    plans the step compile runs. Inductor fuses ops and its partitioner chooses what
    untagged ops keep, so its peak is not the eager one: the plan is the fastest schedule
    measured whose step, compiled, peaks within ``budget_gb``, among eager optima at a
    range of eager budgets, hand policies of the repeated blocks and, nothing
    checkpointed, the partitioner's own ``activation_memory_budget`` at a few fractions
    (:mod:`planner.compile_fit`; each schedule tried compiles and runs a few steps on the
    model, which is left as it was). ``plan.compiled`` holds what was measured, and
    ``apply`` sets the fraction it was measured under while the plan is applied: compile
    after ``apply``. With an envelope (one bucket) the one plan is measured on its batches
    as training meets them, the length made dynamic (``plan.compiled.batches``). A compile
    can leave its step's output to Python's cycle collector; the peak counts it held by
    every later step, unless ``compile_garbage_collected=True`` says your loop calls
    :func:`planner.collect_compile_garbage` after each step (the HF Trainer switch does).

    Options (keywords, or whole as ``config=PlanConfig(...)``, keywords over it) are the
    fields of :class:`~planner.config.PlanConfig`, where each is described; an unknown one
    is refused naming what was meant.

    Raises:
        InfeasibleBudgetError: no schedule fits; ``.min_budget_gb`` is a budget that does.
        ProfileError: one training step of the model could not run.
    """
    config = PlanConfig.of(config, options, "optimize()")
    if config.pipeline is not None:
        return _plan_stage(model, example_inputs, budget_gb, config)
    if config.compiled is not None:
        return plan_compiled(model, example_inputs, _budget_bytes(budget_gb), config)
    solve_options = config.solve_options(_budget_bytes(budget_gb))
    profile_options = config.options(STEP, PROFILING, PARALLEL)
    if config.envelope is not None:
        return plan_envelope(model, example_inputs, config.envelope, solve_options,
                             profile_options)
    return solve_profiled(profile_model(model, example_inputs, **profile_options),
                          solve_options)


def _plan_stage(model: nn.Module, microbatch: Any, budget_gb: float,
                config: PlanConfig) -> Plan:
    """``optimize(..., pipeline=...)``: the stage planned for its schedule."""
    from planner.pipeline.stage import StageSteps, stage_spec

    spec, target_bytes = stage_spec(config.pipeline)
    if spec.num_chunks > 1:
        raise ValueError(f"pipeline= with num_chunks={spec.num_chunks}: a rank of several "
                         "model chunks is planned as a whole, its chunks together: "
                         "planner.plan_rank([chunk modules], [their microbatches], "
                         "pipeline=..., budget_gb=...) returns one plan per chunk")
    given = config.not_for_a_stage()
    if given:
        raise ValueError(f"pipeline= plans a stage on its own process; {given} with it is "
                         "not planned yet (a stage's steps after its first backward start "
                         "with gradients allocated: that is planned already)")
    if config.loss_fn is not None and not spec.last:
        raise ValueError(f"stage {spec.stage_index} of {spec.num_stages} is not the last: "
                         "its backward starts from the gradient the next stage sends; "
                         "give loss_fn to the last stage only")
    profile_options = {k: v for k, v in config.options(STEP, PROFILING).items()
                       if k not in ("loss_fn", "grad_accumulation", "zero_grad_after_forward",
                                    "progress")}
    steps = StageSteps(model, microbatch, spec, config.loss_fn, target_bytes,
                       **profile_options)
    return steps.plan(_budget_bytes(budget_gb), config.time_limit_s, config.solver,
                      deterministic=config.deterministic)[0]
