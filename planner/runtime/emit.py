"""Checkpoints on the model's own modules: what ``planner.apply`` installs.

Each RECOMPUTE region of a plan is one call of one of the model's modules (a module span of
the profile). Its ``forward`` is replaced, on that instance only, by a :class:`Checkpointed`
wrapper that runs the original forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, with a selective-checkpoint
policy when the plan keeps some of its ops. Nested regions are wrappers on a module and on
some of its submodules. The model keeps its class, its module tree, its parameters and its
hooks (FSDP2's ``fully_shard`` and DDP wrap it as usual); ``remove_checkpoints`` takes the
wrappers off again. Wrappers are plain picklable objects, so ``torch.save``/``torch.load``
and ``copy.deepcopy`` of the model keep them.

The SAC policy sees aten ops, not plan nodes: a kept node is named by its op and that op's
occurrence among the ops the module's forward dispatches, as in the profile (which recorded
exactly those ops). Buffers the module updates in forward (BatchNorm running statistics) are
put back after a rerun, so recomputing changes no state.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.plan import PlanMismatchError, PlanMismatchWarning
from planner.runtime.guard import compiled_modules
from planner.runtime.offload import KEEPS_THROUGH_HOOKS, keeps_next, offload_paused
from planner.runtime.skipping import with_skips
from planner.runtime.traced_program import Program, Range
from profiles.kernels import attention_kernels
from profiles.traced import trace_forward, trace_inputs
from solvers.decision import CHECKPOINT_DEFAULT, RULES, Decision

log = logging.getLogger(__name__)

__all__ = ["ANY_PRECISION", "Checkpointed", "Installation", "OpStreamWarning", "RegionSpec",
           "TracedForward", "checkpoint_policy", "checkpointed_modules", "install_checkpoints",
           "prepare_checkpoints", "remove_checkpoints"]


ANY_PRECISION = "any"  # RegionSpec.autocast_dtype: compare the op stream under any precision


def _distinct(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Each tensor once, in first-seen order, and each argument's position among them.
    Told apart by ``is``, not ``id()``: under ``torch.compile`` dynamo guards on an ``id``
    it reads (a new guard failure, so a recompile, at every step); ``is`` it guards as
    aliasing."""
    distinct: list[torch.Tensor] = []
    position_of = []
    for tensor in tensors:
        position = next((p for p, seen in enumerate(distinct) if seen is tensor), None)
        if position is None:
            position = len(distinct)
            distinct.append(tensor)
        position_of.append(position)
    return distinct, position_of


@dataclass(frozen=True)
class RegionSpec:
    """What one module's checkpoint does: kept ops and buffers to restore after a rerun.

    ``expected_ops`` (op, count) are the ops the module's forward ran when profiled. A
    forward that runs others is not the call that was planned (changed code, another branch,
    or an edited plan that names another module): its checkpoint frees other tensors and
    may keep the wrong ones, so it is reported (``OpStreamWarning``) or refused
    (``strict``). Checked on the module's first call in a training step (grad enabled,
    train() mode, not compiling), and on every such call when the region keeps ops (its
    policy counts them anyway).

    ``autocast_dtype``: the precision the plan was profiled under (None: no autocast). A
    call under another precision runs other casts, and the plan's guard reports that
    precision, so the op stream is compared on calls under this one only; ``ANY_PRECISION``
    compares every call.
    """

    path: str
    # (aten op, occurrence in the module's forward) -> what becomes of its output, for the
    # ops the checkpoint does not recompute (`Region.saves`; any other op is recomputed)
    saved_ops: Mapping[tuple[str, int], Decision]
    restore_buffers: tuple[str, ...] = ()  # relative to the module
    expected_ops: tuple[tuple[str, int], ...] = ()
    strict: bool = False
    autocast_dtype: str | None = ANY_PRECISION
    # an op range of the module's traced forward, fx nodes first..last ('': the whole call)
    first: str = ""
    last: str = ""
    # (aten op, occurrence among the ops of that name the rerun recomputes): the ops its
    # rerun answers with uninitialized outputs, nothing needing their values (F9)
    skipped_ops: frozenset[tuple[str, int]] = frozenset()

    @property
    def is_range(self) -> bool:
        return bool(self.first)

    @property
    def label(self) -> str:
        """How messages name the region."""
        name = repr(self.path) if self.path else "<model>"
        return f"{name} ops {self.first}..{self.last}" if self.is_range else name


def _precision(tensors: list[torch.Tensor]) -> str | None:
    """The autocast dtype a call runs under, e.g. ``"bfloat16"``; None without autocast."""
    device = tensors[0].device.type if tensors else "cpu"
    if not torch.is_autocast_enabled(device):
        return None
    return str(torch.get_autocast_dtype(device)).removeprefix("torch.")


class OpStreamWarning(UserWarning):
    """A checkpointed module's forward ran other ops than the call the plan was made for."""


def checkpoint_policy(decision: Decision) -> CheckpointPolicy:
    """What a selective checkpoint's policy returns for an op of ``decision``: its rule's
    (`solvers.decision.RULES`), the one place a decision becomes torch's."""
    return CheckpointPolicy[RULES[decision].policy]


class _Policy:
    """SAC policy of one checkpoint call: the planned decision of each (op, occurrence)
    pair; counts the forward and the rerun separately."""

    def __init__(self, saved_ops: Mapping[tuple[str, int], Decision]) -> None:
        self.saved_ops = saved_ops
        self.counters: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        counter = self.counters[ctx.is_recompute]
        name = str(func)
        occurrence = counter[name]
        counter[name] += 1
        decision = self.saved_ops.get((name, occurrence), CHECKPOINT_DEFAULT)
        # SAC packs a saved output right after this call: an offloaded call's hooks move it
        # where the decision copies it (OFFLOAD); a KEEP stays on the device
        keeps_next(RULES[decision].copies and not ctx.is_recompute)
        return checkpoint_policy(decision)


def _traced_contexts(saved: tuple[tuple[str, int, str], ...]) -> tuple[Any, Any]:
    """A checkpoint's ``context_fn`` where dynamo traces it: SAC's contexts of a fresh
    policy of ``saved`` ((op, occurrence, decision) constants), called as the graph is
    traced. Dynamo takes a module-level function or a partial of one; a closure failed
    the trace ("checkpoint not implemented for NestedUserFunctionVariable context_fn"), so
    no plan that keeps ops compiled. The partitioner keeps a ``MUST_SAVE`` and recomputes
    the rest; no skips (it drops what nothing reads) and no offload (refused compiled)."""
    return create_selective_checkpoint_contexts(
        _Policy({(op, n): Decision(d) for op, n, d in saved}))


class _Checkpoint:
    """Runs a function of a module under non-reentrant checkpoint as ``spec`` says: the
    SAC policy of its keeps, the op-stream check, buffers restored after a rerun."""

    checked = False  # the op stream of a training step was compared with the plan's

    def __init__(self, module: nn.Module, spec: RegionSpec) -> None:
        self.module = module
        self.spec = spec
        # the decisions as constants a compiled graph's policy is built from (`_traced_contexts`)
        self._saved = tuple(sorted((op, n, d.value) for (op, n), d in spec.saved_ops.items()))

    def _body(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What checkpoint calls: ``fn``, but on a rerun the buffers it updates are put
        back, so recomputing changes no state. Compiled, ``fn`` as it is: a compiled
        graph updates buffers once, in its forward (its recompute replays no mutation), and
        a count kept outside the checkpoint would break the graph there (dynamo does not
        trace a checkpoint that mutates a variable of its caller)."""
        if not self.spec.restore_buffers:
            return fn
        calls = 0

        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            nonlocal calls
            calls += 1
            if calls == 1:
                return fn(*args, **kwargs)
            buffers = [self.module.get_buffer(name) for name in self.spec.restore_buffers]
            # outside the dispatch modes: SAC's replay must see only the module's own ops
            with _disable_current_modes(), torch.no_grad():
                before = [b.clone() for b in buffers]
            try:
                return fn(*args, **kwargs)
            finally:  # also when early stop interrupts the rerun
                with _disable_current_modes(), torch.no_grad():
                    for buffer, value in zip(buffers, before, strict=True):
                        buffer.copy_(value)

        return run

    def checkpointed(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` under the checkpoint of this region."""
        # Every tensor argument goes to checkpoint positionally: checkpoint saves positional
        # tensors as saved tensors (nested in another checkpoint: packed into it, nothing
        # held) but holds keyword arguments and containers as plain objects until its frame
        # dies (an HF attention's hidden_states=... would stay alive through the forward).
        # The rerun rebuilds fresh containers: a caller may append to a list it passed
        # (DenseNet's layers take the growing list of features).
        # A tensor passed twice goes in once: the rerun then sees one object again where the
        # forward saw one (nn.MultiheadAttention's self-attention branches on `query is key`).
        if kwargs or not all(type(a) is torch.Tensor for a in args):
            leaves, structure = tree_flatten((args, kwargs))
        else:  # tensors only (a block's call, an op range's inputs): no tree to walk
            leaves, structure = list(args), None
        where = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        distinct, position_of = _distinct([leaves[k] for k in where])
        body = self._body(fn)

        def run(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for k, position in zip(where, position_of, strict=True):
                filled[k] = tensors[position]
            call_args, call_kwargs = (tuple(filled), {}) if structure is None else \
                tree_unflatten(filled, structure)
            if torch.compiler.is_compiling():  # no offload under compile: none to pause
                return body(*call_args, **call_kwargs)
            with offload_paused():  # the forward and its rerun: the checkpoint's saves
                return body(*call_args, **call_kwargs)

        tensors = distinct
        for k in where:
            leaves[k] = None  # the closure keeps the structure, not the tensors
        # the first training call counts its ops with a policy that keeps what the plan
        # keeps (nothing, for most regions); later calls of a region that keeps nothing run
        # plain checkpoint and pay nothing
        check = bool(self.spec.expected_ops) and self._planned_step(tensors) and (
            bool(self.spec.saved_ops) or not self.checked)
        # the checkpoint's input save goes through offload hooks when a call it runs in is
        # offloaded (offloaded checkpointing); its forward and rerun (`run`) pause them
        if not check and not self.spec.saved_ops:
            return checkpoint(run, *tensors, use_reentrant=False)
        if torch.compiler.is_compiling():
            return checkpoint(run, *tensors, use_reentrant=False,
                              context_fn=functools.partial(_traced_contexts, self._saved))
        policy = _Policy(self.spec.saved_ops)
        planned_ops = [False]  # its forward ran the plan's op stream: the rerun may skip
        out = checkpoint(run, *tensors, use_reentrant=False, **KEEPS_THROUGH_HOOKS,
                         context_fn=self._contexts(policy, lambda: planned_ops[0]))
        if check:
            self._check_ops(policy.counters[False])  # under strict, raises every call
            self.checked = True
            planned_ops[0] = policy.counters[False] == Counter(dict(self.spec.expected_ops))
        return out

    def _contexts(self, policy: _Policy, planned_ops: Callable[[], bool]
                  ) -> Callable[[], tuple[Any, Any]]:
        """The checkpoint's context_fn: SAC's contexts of ``policy``, its rerun skipping the
        plan's ops (F9) once ``planned_ops()`` says the forward ran the planned op stream.
        Compiled, the partitioner decides what the rerun runs (it drops what nothing
        reads): no mode of ours in its graph."""
        skipped = self.spec.skipped_ops

        def contexts() -> tuple[Any, Any]:
            sac = create_selective_checkpoint_contexts(policy)
            if skipped and not torch.compiler.is_compiling():
                return with_skips(sac, skipped, planned_ops)
            return sac

        return contexts

    def _planned_step(self, tensors: list[torch.Tensor]) -> bool:
        """Whether this call is one of the training step the plan was made for: the module
        in train() mode (eval runs other ops, e.g. no dropout), under the precision planned,
        eager (the compiled graph is not counted), with no module inside compiled on its
        own (per-block compile runs a block's ops as compiled code: a model-level op range
        around a block warned of other ops at every plan the compiled fit measured)."""
        return self.module.training and not torch.compiler.is_compiling() and (
            self.spec.autocast_dtype == ANY_PRECISION
            or _precision(tensors) == self.spec.autocast_dtype) and not self._compiled_inside()

    def _compiled_inside(self) -> bool:
        """Whether a module this region may run is compiled on its own; looked at once (at
        the first training call, after the compile of torchtitan's order), as a model of
        many modules would pay for the walk at every call of a region that keeps ops."""
        inside = getattr(self, "_compiled", None)
        if inside is None:
            inside = self._compiled = bool(compiled_modules(self.module))
        return inside

    def _check_ops(self, ran: Counter[str]) -> None:
        expected = dict(self.spec.expected_ops)
        if not expected or ran == Counter(expected):
            return
        changed = sorted(set(ran) ^ set(expected) | {op for op in ran
                                                     if ran[op] != expected.get(op)})
        planned, running = attention_kernels(list(expected)), attention_kernels(list(ran))
        where = f"module {self.spec.label}"
        if set(planned) != set(running):
            message = (f"{where} runs attention kernel {', '.join(running) or 'none'} where "
                       f"the plan assumed {', '.join(planned) or 'none'}: it saves other "
                       "tensors, so the plan's memory is not this step's. Plan for this "
                       "device and dtype (optimize(..., device=...)), or pin the kernel with "
                       "torch.nn.attention.sdpa_kernel while profiling and training.")
        else:
            message = (f"{where} ran other ops than the call the plan checkpoints "
                       f"({', '.join(changed[:4])} ...): the plan's memory and the ops its "
                       "checkpoint keeps are not this module's (changed code, another branch, "
                       "or a plan file edited to name another module). Run "
                       "planner.optimize() again on this model and these inputs.")
        if self.spec.strict:
            raise PlanMismatchError(message)
        warnings.warn(message, OpStreamWarning, stacklevel=4)


class Checkpointed(_Checkpoint):
    """A module's ``forward``, run under non-reentrant checkpoint (set on the instance)."""

    def __init__(self, module: nn.Module, spec: RegionSpec) -> None:
        super().__init__(module, spec)
        # a forward already set on the instance (another library's hook, or a traced
        # forward of this plan) is kept and wrapped
        self.inner = module.__dict__.get("forward")

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        return self.checkpointed(self.original, args, kwargs)

    def __repr__(self) -> str:
        return (f"Checkpointed({self.spec.path or type(self.module).__name__}, saves "
                f"{len(self.spec.saved_ops)} ops)")


class _RangeCheckpoint(_Checkpoint):
    def __call__(self, rng: Range, values: tuple) -> tuple:
        return self.checkpointed(functools.partial(rng.run, self.module), values, {})


class TracedForward:
    """A module's forward as its fx trace (children as leaves), with planned op ranges run
    under checkpoint (set on the instance, like `Checkpointed`). Every other node runs as
    in the traced graph; without grad the module's own forward runs. Picklable: the graph
    is traced again when first needed.

    The trace is the program of the call that was planned, so each training call checks
    that it still is (`_departure`): what the trace followed from (`trace_inputs`: the
    module's and its class's attributes, the globals and the function of its forward) is
    compared, and on a change the forward is traced again: the same program runs on; another
    one runs with the planned ranges, its op streams compared with the plan's, and a warning
    naming what changed. Where the trace cannot stand for the call (a forward set on the
    instance, the module in eval() when its eval forward traces otherwise, a forward that
    no longer has the planned ranges) the module's own forward runs under one checkpoint
    of the whole call, with a warning. ``strict``: each warning is an error. Results stay
    the unplanned model's."""

    def __init__(self, module: nn.Module, specs: list[RegionSpec],
                 program: Program | None = None) -> None:
        self.module = module
        self.specs = specs
        self.inner: Callable[..., Any] | None = None  # a forward on the instance (install)
        self.checkpoints = {spec.first: _RangeCheckpoint(module, spec) for spec in specs}
        buffers = tuple(name for name, _ in module.named_buffers())
        self.whole = _Checkpoint(module, RegionSpec(specs[0].path, {}, buffers))
        self._program = program
        self._inputs = trace_inputs(module) if program is not None else None
        self._same_in_eval: bool | None = None  # eval() traces to the program (None: unknown)
        self._signature: tuple[Callable[..., Any], inspect.Signature] | None = None
        self._told: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_program": None, "_inputs": None, "_same_in_eval": None,
                "_signature": None}

    @property
    def checked(self) -> bool:
        """Every range's op stream was compared with the plan's (as `Checkpointed.checked`)."""
        return all(c.checked for c in self.checkpoints.values())

    @checked.setter
    def checked(self, value: bool) -> None:
        for c in self.checkpoints.values():
            c.checked = value

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def program(self) -> Program:
        """The traced forward cut into its ranges (traced on first use)."""
        if self._program is None:
            self._inputs = trace_inputs(self.module)
            self._program = _traced_program(self.module, self.specs)
        return self._program

    def _departure(self) -> str:
        """Why this call's program is not the planned trace ('' when it is); traces again
        when what the trace followed from changed."""
        if self.inner is not None:
            return "a forward set on the instance runs instead of the class's traced one"
        program = self.program()
        now = trace_inputs(self.module)
        if now != self._inputs:
            try:
                fresh = _traced_program(self.module, self.specs)
            except PlanMismatchError as error:
                return f"its forward changed since it was planned ({error})"
            changed, self._inputs, self._same_in_eval = _changed(self._inputs, now), now, None
            if fresh.code != program.code:
                self._program = program = fresh
                self.checked = False  # the next calls compare their op streams with the plan's
                self._tell(f"{changed} changed since it was planned, and its forward now "
                           "traces to another program: it runs that program with the planned "
                           "ranges (results as unplanned), but the plan's memory was not "
                           "counted for it")
        if not self.module.training and not self._eval_runs(program):
            return "it is in eval() mode in a training step, where its forward runs other " \
                   "ops than the train() forward its op ranges were planned in"
        return ""

    def _eval_runs(self, program: Program) -> bool:
        """Whether the module's forward in eval() traces to ``program`` (a forward that
        never reads ``self.training``): its ranges then run as planned. Traced once per
        set of trace inputs."""
        if self._same_in_eval is None:
            graph = trace_forward(self.module, instance_forward_runs=False, training=False)
            self._same_in_eval = not isinstance(graph, str) and \
                graph.python_code("self").src == program.code
        return self._same_in_eval

    def _fall_back(self, why: str, args: tuple, kwargs: dict) -> Any:
        self._tell(f"{why}; its planned op ranges cannot run, so its whole call runs under "
                   "one checkpoint (results as unplanned; memory and time differ from the "
                   "plan's)")
        return self.whole.checkpointed(self.original, args, kwargs)

    def _tell(self, what: str) -> None:
        """Warn once (``strict``: raise) that this module runs outside its plan."""
        path = self.specs[0].path
        message = (f"module {repr(path) if path else '<model>'}: {what}. Run "
                   "planner.optimize() again on the model as it now trains.")
        if self.specs[0].strict:
            raise PlanMismatchError(message)
        if message not in self._told:
            self._told.add(message)
            warnings.warn(message, PlanMismatchWarning, stacklevel=4)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        why = "" if torch.compiler.is_compiling() else self._departure()
        if why:
            return self._fall_back(why, args, kwargs)
        return self._run(self.program(), args, kwargs)

    def _run(self, program: Program, args: tuple, kwargs: dict) -> Any:
        forward = type(self.module).forward
        signature = getattr(self, "_signature", None)  # (pickled before it: none)
        if signature is None or signature[0] is not forward:
            self._signature = signature = (forward, inspect.signature(forward))
        bound = signature[1].bind(self.module, *args, **kwargs)
        return program.forward(self.module, self._run_range, *list(bound.args)[1:])

    def _run_range(self, name: str, inputs: tuple) -> tuple:
        """A range of the program running (its code calls this), under its checkpoint."""
        return self.checkpoints[name](self.program().ranges[name], inputs)

    def __repr__(self) -> str:
        return f"TracedForward({self.specs[0].path or '<model>'}, {len(self.specs)} ranges)"


def _changed(before: tuple | None, after: tuple) -> str:
    """Which of a trace's inputs (`trace_inputs`) differ, in words."""
    if before is None:
        return "what its trace follows from"
    forward, code, own, shared, read = before
    names = [f"attribute {k!r}" for k, _ in sorted(set(after[2]) - set(own))]
    names += [f"class attribute {k!r}" for _, k, _ in sorted(set(after[3]) - set(shared))]
    names += [f"global {k!r}" for k, _ in sorted(set(after[4]) - set(read))]
    if after[0] is not forward or after[1] is not code:
        names.append("its forward function")
    return ", ".join(dict.fromkeys(names)) or "what its trace follows from"


def _traced_program(module: nn.Module, specs: list[RegionSpec]) -> Program:
    """``module``'s class forward traced and cut into the ranges of ``specs``."""
    graph = trace_forward(module, instance_forward_runs=False)
    if isinstance(graph, str):
        raise PlanMismatchError(
            f"module {specs[0].label}: the plan checkpoints op ranges of its traced forward, "
            f"but {graph}. Run planner.optimize() again.")
    return Program.cut(graph, [(spec.label, spec.first, spec.last) for spec in specs])


class Installation:
    """A plan's checkpoints, checked and traced against ``model`` but not yet on it
    (`prepare_checkpoints`): everything that can refuse a plan has run, so `install`
    changes the model only once nothing can."""

    def __init__(self, model: nn.Module, specs: list[RegionSpec]) -> None:
        self.model = model
        self.traced: list[TracedForward] = []
        self.calls: list[tuple[nn.Module, RegionSpec]] = []
        ranges: dict[str, list[RegionSpec]] = {}
        seen: set[str] = set()
        for spec in specs:
            if spec.is_range:
                ranges.setdefault(spec.path, []).append(spec)
                continue
            if spec.path in seen:
                raise PlanMismatchError(
                    f"the plan checkpoints module {spec.label} twice (two calls of a module "
                    "run by one forward); a module's forward can carry one checkpoint. Run "
                    "planner.optimize() again.")
            seen.add(spec.path)
            self.calls.append((_submodule(model, spec), spec))
        for group in ranges.values():
            module = _submodule(model, group[0])
            self.traced.append(TracedForward(module, group, _traced_program(module, group)))
        self.wrappers = [Checkpointed(module, spec) for module, spec in self.calls]

    def install(self) -> list[str]:
        """Set the wrappers on the modules (traced forwards inside their call's checkpoint);
        returns the paths. The same wrappers each time: a plan table swaps installations
        in and out between steps (`planner.runtime.table_install`)."""
        for forward in self.traced:
            forward.inner = forward.module.__dict__.get("forward")
            forward.module.forward = forward
        for wrapper in self.wrappers:
            wrapper.inner = wrapper.module.__dict__.get("forward")
            wrapper.module.forward = wrapper
        return [f.specs[0].path for f in self.traced] + [spec.path for _, spec in self.calls]


def _submodule(model: nn.Module, spec: RegionSpec) -> nn.Module:
    try:
        return model.get_submodule(spec.path)
    except AttributeError:
        raise PlanMismatchError(
            f"the plan checkpoints module {spec.label}, which {type(model).__name__} does not "
            "have. Run planner.optimize() on this model.") from None


def prepare_checkpoints(model: nn.Module, specs: Iterable[RegionSpec]) -> Installation:
    """``specs`` checked and traced against ``model`` (a plan already on it stays)."""
    return Installation(model, list(specs))


def install_checkpoints(model: nn.Module, specs: Iterable[RegionSpec]) -> list[str]:
    """Wrap the forward of each module named in ``specs`` (op ranges: one traced forward
    per module, under its call's checkpoint if it has one); returns their paths. Refused,
    changing nothing, when a module is already checkpointed by a plan."""
    installation = prepare_checkpoints(model, specs)
    for module in [f.module for f in installation.traced] + [m for m, _ in installation.calls]:
        if isinstance(module.__dict__.get("forward"), Checkpointed | TracedForward):
            raise ValueError(f"module {_path_of(model, module)!r} is already checkpointed by a "
                             "plan; call planner.remove(model) first")
    return installation.install()


def _path_of(model: nn.Module, module: nn.Module) -> str:
    return next(path for path, m in model.named_modules() if m is module)


def checkpointed_modules(model: nn.Module) -> dict[str, Checkpointed | TracedForward]:
    """The modules of ``model`` that run under a plan's checkpoint (or a traced forward
    with checkpointed op ranges), by path: the outermost wrapper of each."""
    return {path: module.__dict__["forward"] for path, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), Checkpointed | TracedForward)}


def remove_checkpoints(model: nn.Module) -> list[str]:
    """Take every plan checkpoint and traced forward off ``model``; returns their paths."""
    removed = []
    for path, wrapper in checkpointed_modules(model).items():
        module = wrapper.module
        while isinstance(wrapper, Checkpointed | TracedForward):
            if wrapper.inner is not None:
                module.forward = wrapper.inner
            else:
                del module.__dict__["forward"]
            wrapper = wrapper.inner
        removed.append(path)
    return removed
