"""PlanConfig: every option of planning, declared once.

:func:`planner.optimize` takes its fields as keywords (or whole, ``config=PlanConfig(...)``);
:func:`planner.profile_model` the step's, profiling's and parallelism's, :func:`planner.solve`
and :func:`planner.replan` the search's. The command line's flags and the trainer switches'
options are these fields too, so an option is named, typed, defaulted, checked and
described here only. Each field says its group, its help, and whether a pipeline stage
plans it; the fields the command line offers name their flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from planner.arguments import SolveOptions, _check_solver_options, host_budget_arg
from planner.envelope import Envelope
from planner.sharding import SHARDINGS

__all__ = ["COMPILE_MODES", "PlanConfig", "cli_flags", "from_cli", "shows_options"]

STEP, PROFILING, PARALLEL, SEARCH, BATCHES, COMPILING = (
    "the step", "profiling", "parallelism", "the search", "batches", "compiling")
GROUPS = (STEP, PROFILING, PARALLEL, SEARCH, BATCHES, COMPILING)
COMPILE_MODES = ("model", "blocks")  # torch.compile(model); each block's .compile()


@dataclass(frozen=True)
class _Option:
    """What a field of :class:`PlanConfig` is: its group and help, whether a pipeline stage
    plans it (``stage``), and its command-line flag and parser where it has one."""

    group: str
    help: str
    stage: bool = True
    flag: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None


def _about(group: str, help: str, **more: Any) -> dict[str, _Option]:
    """A field's metadata: what it is (`_Option`)."""
    return {"option": _Option(group, help, **more)}


def positive(text: str) -> float:
    """A command line's positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How a model is planned, all but the budget: checked when built, so a wrong option is
    said where it is written (a trainer switch's constructor, not the first step)."""

    loss_fn: Callable[[Any], torch.Tensor] | None = field(default=None, metadata=_about(
        STEP, "loss_fn(output) -> scalar tensor; default: the output's .loss, or the output "
        "when it is a scalar"))
    optimizer: torch.optim.Optimizer | None = field(default=None, metadata=_about(
        STEP, "counted in static memory (its state after one step), and the peak of its "
        "step() after the backward"))
    autocast: torch.dtype | None = field(default=None, metadata=_about(
        STEP, "plan mixed precision (e.g. torch.bfloat16); inside torch.autocast, its dtype"))
    grad_accumulation: bool = field(default=False, metadata=_about(
        STEP, "steps start with every .grad allocated (micro-batches of gradient "
        "accumulation, zero_grad(set_to_none=False)); default: without .grad",
        stage=False, flag="--grad-accumulation"))
    zero_grad_after_forward: bool = field(default=False, metadata=_about(
        STEP, "steps start with the last backward's .grad and call zero_grad() between "
        "their forward and backward (Lightning's order): the gradients count through the "
        "forward and loss, not the backward; default: steps start without .grad",
        stage=False, flag="--zero-grad-after-forward"))
    compiled: str | None = field(default=None, metadata=_about(
        COMPILING, "plan the step torch.compile runs, its peak measured compiled: 'model' "
        "(torch.compile(model), the Trainer's torch_compile) or 'blocks' (each repeated "
        "block's .compile() after apply, torchtitan's order)", stage=False,
        flag="--compiled", choices=COMPILE_MODES))
    compile_garbage_collected: bool = field(default=False, metadata=_about(
        COMPILING, "with compiled: the training loop calls planner.collect_compile_garbage() "
        "after each step (the HF Trainer switch does), so what a compiling step leaves to "
        "Python's cycle collector is not counted in later steps; default: every later step "
        "holds what each compile left", stage=False))
    timing: str = field(default="auto", metadata=_about(
        PROFILING, "measure on this machine, or estimate from FLOPs and the device's "
        "roofline; auto: measure real tensors, estimate meta or fake ones",
        flag="--timing", choices=("auto", "measure", "estimate")))
    device: str | None = field(default=None, metadata=_about(
        PROFILING, "the device to plan for: H100, H200, A100, cpu; None: the model's device",
        flag="--device"))
    execution: str = field(default="auto", metadata=_about(
        PROFILING, "observe the forward on real tensors or fake ones (auto: real unless the "
        "model is on the meta device)", choices=("auto", "real", "fake")))
    progress: bool = field(default=True, metadata=_about(
        PROFILING, "show progress bars on a terminal or in a notebook"))
    world_size: int = field(default=1, metadata=_about(
        PARALLEL, "ranks the model is sharded over (with sharding=)", stage=False))
    sharding: str | None = field(default=None, metadata=_about(
        PARALLEL, "'ddp' or 'fsdp2' over world_size ranks", stage=False, choices=SHARDINGS))
    shard_modules: list[str] | None = field(default=None, metadata=_about(
        PARALLEL, "FSDP2's units (default: the model's repeated blocks)", stage=False))
    parallelize: Callable[[torch.nn.Module, Any], Any] | None = field(
        default=None, metadata=_about(PARALLEL, "the training script's parallelize(model, "
                                      "mesh)", stage=False))
    mesh_shape: tuple[int, ...] | None = field(default=None, metadata=_about(
        PARALLEL, "parallelize's mesh: (dp,) or (dp, tp)", stage=False))
    mesh_dim_names: tuple[str, ...] | None = field(default=None, metadata=_about(
        PARALLEL, "the mesh's dimension names", stage=False))
    solver: str = field(default="auto", metadata=_about(
        SEARCH, "auto, cpsat, dp or a baseline name", flag="--solver"))
    time_limit_s: float = field(default=60.0, metadata=_about(
        SEARCH, "solver seconds", flag="--time-limit", parse=positive))
    offload: bool = field(default=False, metadata=_about(
        SEARCH, "let the plan send module calls' saved activations to host memory and back",
        stage=False, flag="--offload"))
    host_budget_gb: float | None = field(default=None, metadata=_about(
        SEARCH, "host memory offload may take (with offload; default: half the machine's "
        "physical memory)", stage=False, flag="--host-budget-gb", parse=positive))
    op_ranges: bool = field(default=True, metadata=_about(
        SEARCH, "checkpoint op ranges inside a forward too, not module calls only",
        stage=False))
    deterministic: bool = field(default=False, metadata=_about(
        SEARCH, "the same plan on a loaded machine as on a quiet one (the limit counts "
        "CP-SAT's work, not seconds; the DP and offload's search run to their end)",
        flag="--deterministic"))
    pipeline: Any = field(default=None, metadata=_about(
        BATCHES, "plan a pipeline stage: dict(schedule=, stage_index=, num_stages=, "
        "n_microbatches=)"))
    envelope: Envelope | None = field(default=None, metadata=_about(
        BATCHES, "every batch a loader may give (planner.Envelope or its fields as a dict)"))

    def __post_init__(self) -> None:
        if isinstance(self.envelope, Mapping):
            object.__setattr__(self, "envelope", Envelope(**self.envelope))
        elif self.envelope is not None and not isinstance(self.envelope, Envelope):
            raise TypeError(f"envelope= takes a planner.Envelope (or its fields as a dict), "
                            f"not {type(self.envelope).__name__}")
        for name in ("grad_accumulation", "zero_grad_after_forward", "progress", "offload",
                     "op_ranges", "deterministic", "compile_garbage_collected"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for f in fields(self):
            choices, value = f.metadata["option"].choices, getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size,
                                                               numbers.Integral) \
                or self.world_size < 1:
            raise ValueError(f"world_size must be a whole number of ranks, 1 or more, got "
                             f"{self.world_size!r}")
        if self.compile_garbage_collected and self.compiled is None:
            raise ValueError("compile_garbage_collected=True says how a compiled step is "
                             "trained: give compiled='model' or 'blocks' with it")
        _check_solver_options(self.solver, self.time_limit_s)
        host_budget_arg(self.offload, self.host_budget_gb)

    @classmethod
    def of(cls, config: PlanConfig | None, options: Mapping[str, Any], caller: str,
           groups: Iterable[str] = GROUPS) -> PlanConfig:
        """``config`` (default: the defaults) with ``options`` (keywords of ``caller``, a
        function taking the fields of ``groups``) put in: an option that is no field, or
        another group's, is refused naming what was meant."""
        if config is not None and not isinstance(config, PlanConfig):
            raise TypeError(f"{caller} takes config=planner.PlanConfig(...), not "
                            f"{type(config).__name__}")
        taken = {f.name for f in fields(cls) if f.metadata["option"].group in set(groups)}
        for name in options:
            if name not in taken:
                raise TypeError(_unknown(name, caller, taken))
        return dataclasses.replace(config or cls(), **options)

    @classmethod
    def for_switch(cls, config: PlanConfig | None, options: Mapping[str, Any], switch: str,
                   decided: Iterable[str], where: str) -> PlanConfig:
        """A trainer switch's options, checked when the switch is made (not when training
        starts), progress bars off unless ``progress=True`` is given with them; the
        ``decided`` fields are the trainer's (``where`` says where to set them) and
        refused."""
        made = cls.of(config, {"progress": False, **options}, switch)
        refused = sorted(set(decided) & set(made.given()))
        if refused:
            raise TypeError(f"{switch} takes {refused} from {where}; set them there")
        return made

    def given(self) -> dict[str, Any]:
        """The fields not at their default, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}

    def not_for_a_stage(self) -> list[str]:
        """The options given that a pipeline stage does not plan (yet), as ``name=value``."""
        return sorted(f"{name}={value!r}" for name, value in self.given().items()
                      if not _meta(name).stage)

    def solve_options(self, budget_bytes: int) -> SolveOptions:
        """The search's fields, at ``budget_bytes``, as the solvers take them."""
        return SolveOptions(budget_bytes, self.solver, float(self.time_limit_s), self.offload,
                            host_budget_arg(self.offload, self.host_budget_gb) or 0,
                            self.op_ranges, self.deterministic, progress=self.progress)

    def options(self, *groups: str) -> dict[str, Any]:
        """The fields of ``groups``, by name (keywords of the function that takes them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["option"].group in groups}


def _meta(name: str) -> _Option:
    return next(f.metadata["option"] for f in fields(PlanConfig) if f.name == name)


def _unknown(name: str, caller: str, taken: set[str]) -> str:
    """The message for an option ``caller`` does not take: the field meant, or the function
    that takes it."""
    every = {f.name for f in fields(PlanConfig)}
    if name in every:
        takers = {SEARCH: "optimize() or solve()/replan() take it",
                  BATCHES: "optimize() takes it", COMPILING: "optimize() takes it"}
        return (f"{caller} does not take {name}= ({_meta(name).group}): "
                + takers.get(_meta(name).group, "optimize() or profile_model() take it"))
    close = difflib.get_close_matches(name, sorted(taken), n=1)
    hint = f"; did you mean {close[0]}=?" if close else ""
    return (f"{caller} got an unexpected option {name}={hint} Its options are the fields of "
            f"planner.PlanConfig: {', '.join(sorted(taken))}")


def shows_options(*groups: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A function taking ``**options`` (fields of ``groups``) shown with them as keywords
    (``help()``, a notebook's signature), each with its default."""
    def show(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func)
        params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        named = {p.name for p in params}
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                     annotation=f.type)
                   for f in fields(PlanConfig)
                   if f.metadata["option"].group in groups and f.name not in named]
        func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return func

    return show


def cli_flags(parser: argparse.ArgumentParser, defaults: Mapping[str, Any],
              groups: Iterable[str] = GROUPS) -> None:
    """The command line's flags of the fields of ``groups`` that have one; ``defaults``: a
    field's default on the command line where it differs (said in its help)."""
    for f in fields(PlanConfig):
        meta: _Option = f.metadata["option"]
        if meta.flag is None or meta.group not in set(groups):
            continue
        default = defaults.get(f.name, f.default)
        help_ = meta.help + (f" (here: {default}; optimize() in Python defaults to "
                             f"{f.default})" if f.name in defaults else "")
        if f.type == "bool":
            parser.add_argument(meta.flag, dest=f.name, action="store_true", help=help_)
        else:
            parser.add_argument(meta.flag, dest=f.name, default=default, type=meta.parse,
                                choices=meta.choices, help=help_,
                                metavar=None if meta.choices else
                                meta.flag.lstrip("-").upper().replace("-", "_"))


def from_cli(args: argparse.Namespace, groups: Iterable[str] = GROUPS) -> dict[str, Any]:
    """The fields of ``groups`` a parsed command line set with :func:`cli_flags`, by name."""
    return {f.name: getattr(args, f.name) for f in fields(PlanConfig)
            if hasattr(args, f.name) and f.metadata["option"].group in set(groups)}
