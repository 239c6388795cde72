"""The planned model checks, at the start of each training step, that it is still the step
its plan was made for: what ``apply`` installs on the root module as a forward pre-hook.

Each check is cheap (one walk of the module tree, no hashing) and names the change it
finds: inputs larger than planned, of another dtype or another value; another precision;
gradients the plan did not count; parameters or buffers of another dtype, shape or device;
modules replaced, added or removed; a plan checkpoint replaced by a forward set on the
instance. A change warns once (:class:`PlanMismatchWarning`) or, ``strict``, raises
:class:`PlanMismatchError`; ``planner.replan`` or ``optimize`` plans the model as it is.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from planner.plan import InputSpec, Plan, PlanMismatchError, PlanMismatchWarning, format_bytes
from planner.runtime.partitioner import partitioner_budget
from profiles.parallel import describe_parallel, job_backend, layout_changes

__all__ = ["PlanGuard", "compiled_modules"]

_Tensors = dict[str, tuple[tuple[int, ...], str, str]]  # name: (shape, dtype, device type)


def _walk(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return model.named_modules(remove_duplicate=False)


def compiled_modules(model: nn.Module) -> list[str]:
    """The paths of ``model``'s modules that torch.compile compiles on their own: compiled
    in place (``module.compile()``, as torchtitan compiles each block) or wrapped
    (``torch.compile(module)`` set as a child)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")  # imported once anything compiled
    wrapper = frame.OptimizedModule if frame is not None else ()
    return [path or "<model>" for path, m in _walk(model)
            if m._compiled_call_impl is not None or isinstance(m, wrapper)]


def _tensors(model: nn.Module) -> _Tensors:
    """Every parameter and buffer by name: shape, dtype and device type."""
    prefix = {id(m): f"{path}." if path else "" for path, m in _walk(model)}
    found: _Tensors = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    found[prefix[id(module)] + name] = (tuple(t.shape),
                                                       str(t.dtype).removeprefix("torch."),
                                                       t.device.type)
    return found


_MISSING = object()


class _AsApplied:
    """The module tree and its tensors as applied, compared from the root: the check every
    step runs, cheap enough to cost nothing a step can see (building the named tables every
    step cost 0.2 ms, 0.3-0.5 ms inside a step: GPT small and ResNet on the CPU, 1 thread).
    When it fails, the named comparison says what changed. Tensors are recorded by id, shape,
    dtype and device, never held: a parameter replaced after apply (FSDP2's sharding) must
    be freed. Passing implies the named comparison passes (same names, shapes, dtypes and
    devices), whatever ids the allocator reuses."""

    def __init__(self, model: nn.Module) -> None:
        self.records = [(m, tuple(m._modules.items()), len(m._parameters), len(m._buffers),
                         tuple(_marks(m))) for m in model.modules()]

    def unchanged(self, model: nn.Module) -> bool:
        if self.records[0][0] is not model:
            return False
        for module, children, n_params, n_buffers, marks in self.records:
            table = module._modules
            if len(table) != len(children) or len(module._parameters) != n_params \
                    or len(module._buffers) != n_buffers:
                return False
            for name, child in children:
                if table.get(name, _MISSING) is not child:
                    return False
            for buffer, name, tid, shape, dtype, device in marks:
                now = (module._buffers if buffer else module._parameters).get(name, _MISSING)
                if now is _MISSING or (id(now) if now is not None else None) != tid or (
                        now is not None and (now.shape != shape or now.dtype is not dtype
                                             or now.device != device)):
                    return False
        return True

    def parameters(self) -> Iterator[torch.Tensor]:
        """The model's parameters, where `unchanged` said so."""
        for module, *_ in self.records:
            yield from (t for t in module._parameters.values() if t is not None)


def _marks(module: nn.Module) -> Iterator[tuple[bool, str, int | None, Any, Any, Any]]:
    for buffer, table in ((False, module._parameters), (True, module._buffers)):
        for name, t in table.items():
            yield (buffer, name, *((id(t), t.shape, t.dtype, t.device) if t is not None
                                   else (None, None, None, None)))


def _sharded(model: nn.Module) -> bool:
    """FSDP2 swaps parameters between sharded and (mixed-precision) unsharded ones around
    each forward: their dtype and device are its own, not the user's change."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _wraps(forward: Any, wrapper: Any, depth: int = 8) -> bool:
    """Whether ``forward`` is ``wrapper`` or wraps it (``functools.wraps``' ``__wrapped__``,
    accelerate's ``_old_forward``, a ``functools.partial``)."""
    for _ in range(depth):
        if forward is wrapper:
            return True
        forward = (getattr(forward, "__wrapped__", None) or getattr(forward, "func", None)
                   or getattr(getattr(forward, "__self__", None), "_old_forward", None))
        if forward is None:
            return False
    return False


def step_checks(model: nn.Module) -> Callable[[], bool]:
    """The checks `PlanGuard.check` runs on ``model`` at each step that need no plan (its
    modules and tensors as applied, their gradients), as one call: what a planned step's
    guard costs, timed where no plan exists yet (`planner.region_calibration`: ResNet b16
    on 2 cores, 0.06 ms alone, 0.29 ms at the start of a step)."""
    as_applied = _AsApplied(model)

    def run() -> bool:
        unchanged = as_applied.unchanged(model)
        return unchanged and not any(p.grad is not None and p.requires_grad
                                     for p in as_applied.parameters())

    return run


class PlanGuard:
    """Forward pre-hook on a planned model: warns (or raises, ``strict``) when a training
    step is not the step its plan was made for (module docstring)."""

    def __init__(self, plan: Plan, model: nn.Module, device_type: str, strict: bool,
                 restore_use_cache: list[Any], installed: dict[str, Any]) -> None:
        self.inputs = list(plan.inputs)
        self.autocast_dtype = plan.autocast_dtype
        # gradients counted when a step starts: added into, or held through the forward
        static = plan.profile.static
        self.grads_at_start = static.grads_at_start or static.grads_in_forward
        self.device_type = device_type
        self.strict = strict
        self.restore_use_cache = restore_use_cache
        # the partitioner's budget the compiled plan was measured under, and the value its
        # apply replaced (`planner.runtime.partitioner`)
        self.partitioner_budget = plan.compiled.partitioner_budget if plan.compiled else None
        self.restore_partitioner_budget: float | None = None
        self.model_name = plan.model_name
        self.budget = format_bytes(plan.budget_bytes)
        self.modules = dict(_walk(model))
        self.tensors = _tensors(model)
        self.as_applied = _AsApplied(model)
        for_gpu = plan.profile.for_gpu
        self.devices = {d for _, _, d in self.tensors.values()} | ({"cuda"} if for_gpu else set())
        self.installed = [(path, model.get_submodule(path), wrapper)
                          for path, wrapper in installed.items()]
        self.names = _argument_names(model)
        self.parallel = plan.profile.parallel
        self.parallel_checked = False
        self.eager_plan = plan.compiled is None
        self.compile_checked = not self.eager_plan  # an eager plan's: at its first step
        self._told: set[str] = set()
        self._register()

    def _register(self) -> None:
        """A number that finds this guard while dynamo traces it (`_at_trace_time`)."""
        self.token = next(_TOKENS)
        _TRACED[self.token] = self

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy or an unpickled guard
        self.__dict__.update(state)
        self._register()

    def _complain(self, message: str, about: str | None = None) -> None:
        """Warn once per ``about`` (an input's name; default the message): a value that
        changes every step warns once, not every step."""
        if self.strict:
            raise PlanMismatchError(message)
        key = about or message
        if key not in self._told:
            self._told.add(key)
            warnings.warn(message, PlanMismatchWarning, stacklevel=8)  # the model(...) call

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # inference is not planned
        if torch.compiler.is_compiling():  # the model compiled whole: this hook is traced
            _at_trace_time(self.token)
            return  # the rest was checked when the graph was traced, eagerly before it
        self.check(module, args, kwargs)

    def check(self, module: nn.Module, args: tuple, kwargs: dict, inputs: bool = True) -> None:
        """Every check of a training step (``inputs``: its inputs too)."""
        if inputs:
            self._check_inputs(args, kwargs)
        self._check_precision(module)
        as_applied = getattr(self, "as_applied", None)  # (guards pickled before it: none)
        unchanged = as_applied is not None and as_applied.unchanged(module)
        self._check_grads(module, as_applied.parameters() if unchanged else None)
        if hasattr(self, "modules"):  # (guards pickled before these checks have none)
            changed = self._check_model(module, unchanged)
            if not unchanged and not changed and not _sharded(module):
                self.as_applied = _AsApplied(module)  # a copy of the model: its own ids
        if not getattr(self, "parallel_checked", True):
            self._check_parallel(module)
        if not getattr(self, "compile_checked", True):
            self._check_compiled(module)
        self._check_partitioner()

    def _check_compiled(self, model: nn.Module) -> None:
        """On the first training step of an eager plan: modules compiled since ``apply``
        (torchtitan compiles each block after its checkpointing policy is applied) run
        another step than the one planned."""
        self._compiled_said(compiled_modules(model))

    def _check_traced(self) -> None:
        """While dynamo traces an eager plan's model as a whole (``torch.compile(model)``,
        ``model.compile()``): it runs another step than the one planned."""
        if getattr(self, "eager_plan", False):  # (said once: `_complain`)
            self._compiled_said(["<model>"])

    def _compiled_said(self, compiled: list[str]) -> None:
        self.compile_checked = True
        if not compiled:
            return
        self._complain(
            f"{self.model_name} runs with module{'s' * (len(compiled) > 1)} "
            f"{', '.join(repr(p) for p in compiled[:3])}"
            f"{f' and {len(compiled) - 3} more' if len(compiled) > 3 else ''} compiled "
            "(torch.compile), and its plan is the eager step's: compiled, a step keeps what "
            "inductor and its partitioner keep (more than eager on a ResNet: docs/recipes.md, "
            f"'torch.compile'), so the {self.budget} budget was not measured for it. Plan the "
            "compiled step: planner.optimize(..., compiled='blocks') where each block is "
            "compiled, compiled='model' where the model is, then apply() that plan.",
            about="compiled")

    def _check_partitioner(self) -> None:
        """A compiled plan's budget holds under the partitioner's budget it was measured
        under, which apply set: said where it changed since (a graph partitioned after the
        change keeps what that budget keeps)."""
        planned = getattr(self, "partitioner_budget", None)  # (guards pickled before it)
        if planned is None or partitioner_budget() == planned:
            return
        self._complain(
            f"torch._functorch.config.activation_memory_budget is {partitioner_budget()}, "
            f"and this plan of {self.model_name} was measured compiled under {planned}, "
            f"which apply set: graphs compiled now keep what the partitioner keeps at the "
            f"new value, and the {self.budget} budget does not hold for them. Leave it at "
            f"{planned} while the plan is applied, or plan again under the value you want",
            about="partitioner")

    def _check_parallel(self, model: nn.Module) -> None:
        """On the first training step: the model runs under the parallelism planned (the
        user's parallelize runs after apply, so only the step can tell)."""
        import torch.distributed as dist

        self.parallel_checked = True
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        changed = layout_changes(self.parallel, describe_parallel(model)) or (
            f"it runs on {world} ranks, planned {self.parallel.world_size}"
            if self.parallel and world != self.parallel.world_size else "") or \
            self._backend_change()
        if changed:
            self._complain(
                f"{self.model_name} does not run as its plan was made for: {changed}. Each "
                f"rank's memory is not the plan's, so the {self.budget} budget does not hold. "
                "Plan with optimize(..., parallelize=your_parallelize, mesh_shape=...) "
                "exactly as you train.")

    def _backend_change(self) -> str:
        """The collectives' backend, where the plan names one and a job's group runs."""
        planned = getattr(self.parallel, "backend", None)
        running = job_backend(self.device_type) if planned else None
        if running is None or running == planned:
            return ""
        return (f"its collectives run on {running}, planned for {planned} (gloo "
                "reduce-scatters a copy of each FSDP2 unit's gradients, NCCL in place)")

    # ------------------------------------------------------------------ the model

    def _check_model(self, model: nn.Module, as_applied: bool) -> str:
        """What changed ("" for nothing); ``as_applied``: the tree and its tensors are
        known unchanged (`_AsApplied`)."""
        changed = ("" if as_applied else
                   self._module_changes(model) or self._tensor_changes(model)) \
            or self._wrapper_changes()
        if changed:
            self._complain(
                f"{self.model_name} changed after its plan was applied: {changed}. The plan's "
                f"memory is not this model's, so the {self.budget} budget does not hold. Run "
                "planner.optimize() on the model as it is now, then apply() that plan.")
        return changed

    def _module_changes(self, model: nn.Module) -> str:
        now = dict(_walk(model))
        if len(now) == len(self.modules) and all(
                self.modules.get(path) is m for path, m in now.items()):
            return ""
        added = [p for p in now if p not in self.modules]
        removed = [p for p in self.modules if p not in now]
        replaced = [p for p, m in now.items() if p in self.modules and self.modules[p] is not m]
        parts = [f"{what} {', '.join(repr(p) for p in paths[:3])}"
                 + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
                 for what, paths in (("module replaced:", replaced), ("modules added:", added),
                                     ("modules removed:", removed)) if paths]
        return "; ".join(parts)

    def _tensor_changes(self, model: nn.Module) -> str:
        now = _tensors(model)
        if now == self.tensors:
            return ""
        sharded = _sharded(model)
        for name, (shape, dtype, device) in now.items():
            was = self.tensors.get(name)
            if was is None:
                return f"{name!r} was added"
            if shape != was[0]:
                return f"{name!r} has shape {list(shape)}, planned {list(was[0])}"
            if sharded:
                continue
            if dtype != was[1]:
                return f"{name!r} is {dtype}, planned {was[1]} (e.g. .to(dtype) after apply)"
            if device != was[2] and device not in self.devices and was[2] != "meta":
                # (a model planned on the meta device is materialised on a real one)
                return f"{name!r} is on {device}, planned on {was[2]}"
        gone = [name for name in self.tensors if name not in now]
        return f"{gone[0]!r} was removed" if gone else ""

    def _wrapper_changes(self) -> str:
        for path, module, wrapper in self.installed:
            if not _wraps(module.__dict__.get("forward"), wrapper):
                return (f"the checkpoint of module {path or '<model>'!r} was replaced by a "
                        "forward set on the instance")
        return ""

    # ------------------------------------------------------------------ the step

    def _check_grads(self, module: nn.Module, params: Iterator[torch.Tensor] | None) -> None:
        """``params``: the model's parameters where the model is as applied."""
        if getattr(self, "grads_at_start", True):  # planned with them (or pickled before)
            return
        if any(p.grad is not None and p.requires_grad
               for p in (module.parameters() if params is None else params)):
            self._complain(
                f"{self.model_name} starts a training step with .grad allocated (gradient "
                "accumulation, or zero_grad(set_to_none=False)), but its plan counted "
                f"gradients from the backward on: the {self.budget} budget does not hold. "
                "Plan with optimize(..., grad_accumulation=True) (or "
                "zero_grad_after_forward=True where zero_grad() runs between the forward "
                "and the backward), or call zero_grad() (set_to_none=True) before each step.")

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        planned = {(spec.keyword, spec.name): spec for spec in self.inputs}
        names = getattr(self, "names", [])
        given = [*(((False, str(k)), v) for k, v in enumerate(args)),
                 *(((True, k), v) for k, v in kwargs.items())]
        for key, value in given:
            # planned as x=..., run as model(x), or the other way round
            other = ((True, names[int(key[1])]) if int(key[1]) < len(names) else None) \
                if not key[0] else ((False, str(names.index(key[1])))
                                    if key[1] in names else None)
            named = (names[int(key[1])] if int(key[1]) < len(names) else None) \
                if not key[0] else key[1]
            if isinstance(value, str) and named not in names:
                continue  # metadata a batch carries (**kwargs, *args): it sets no memory
            spec = planned.get(key) or planned.get(other)
            change = _input_change(spec, value) if spec is not None else (
                "it was not given when planned" if _may_change_the_step(value) else "")
            if change:
                self._complain(
                    f"{self.model_name} runs with input {key[1]!r} where {change}: the "
                    f"{self.budget} budget holds only for the inputs planned. Plan with "
                    "these inputs (planner.optimize).", about=f"input {key[1]}")

    def _check_precision(self, module: nn.Module) -> None:
        enabled = self.device_type != "meta" and torch.amp.is_autocast_available(
            self.device_type) and torch.is_autocast_enabled(self.device_type)
        dtype = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.") \
            if enabled else None
        around = _autocast_around_forward(module)
        if dtype is None and around is not None and around.device == self.device_type:
            dtype = str(around.fast_dtype).removeprefix("torch.")  # entered inside forward
        if dtype != self.autocast_dtype:
            planned = f"autocast {self.autocast_dtype}" if self.autocast_dtype else "no autocast"
            running = f"autocast {dtype}" if dtype else "no autocast"
            self._complain(
                f"{self.model_name} was planned under {planned} but runs under {running}: "
                f"activations change size, so the {self.budget} budget does not hold. "
                "Plan with optimize(..., autocast=...) matching how you train.")


_TOKENS = itertools.count()
_TRACED: weakref.WeakValueDictionary[int, PlanGuard] = weakref.WeakValueDictionary()


def _at_trace_time(token: int) -> None:
    """The check of guard ``token`` (`PlanGuard._check_traced`) run by dynamo while it
    traces the guard's hook, once per graph it compiles: no graph break, nothing it reads
    or sets guarded on (a comptime function sees the traced frame's constants, not its
    objects: the guard is found by number). Nothing where this torch has no comptime."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:
        return
    comptime(lambda ctx: _check_traced(ctx.get_local("token").as_python_constant()))


def _check_traced(token: int) -> None:
    guard = _TRACED.get(token)
    if guard is not None:
        guard._check_traced()


def _autocast_around_forward(module: nn.Module) -> torch.autocast | None:
    """The enabled ``torch.autocast`` a forward set on the instance enters around the
    module's own (accelerate's mixed precision wraps ``model.forward`` so, and the Trainer's
    bf16 with it), found through the wrappers' ``__wrapped__``, ``__func__`` and closures;
    None when the forward is the class's or enters none. The guard's pre-hook runs before
    that wrapper, so without this it would see no autocast where the step runs under one."""
    todo, seen = [module.__dict__.get("forward")], set()
    while todo and len(seen) < 32:
        found = todo.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, torch.autocast):
            return found if found._enabled else None
        if not callable(found):
            continue
        todo += [getattr(found, name, None) for name in ("__wrapped__", "__func__",
                                                          "model_forward")]
        todo += [_contents(cell) for cell in getattr(found, "__closure__", None) or ()]
    return None


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


def _may_change_the_step(value: Any) -> bool:
    """Whether an input not given when planning can change the step's memory: a tensor of
    more than one element (labels, a mask), or a switch turned on (``output_attentions=
    True``); a count (the HF Trainer's ``num_items_in_batch``) or a None cannot."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 1
    return value is True


def _argument_names(model: nn.Module) -> list[str]:
    """The names of the model's forward arguments, in order (none where it has no Python
    signature)."""
    try:
        params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _input_change(spec: InputSpec, value: Any) -> str:
    """How an input differs from the planned one, in words ('' when it does not)."""
    if isinstance(value, torch.Tensor):
        if spec.shape is None:
            return f"it was {spec.value!r} when planned and is now a tensor"
        shape = tuple(spec.shape)
        if value.dim() != len(shape) or any(a > b for a, b in zip(value.shape, shape,
                                                                  strict=True)):
            return (f"it has shape {list(value.shape)}, larger than the planned "
                    f"{list(shape)}")
        dtype = str(value.dtype).removeprefix("torch.")
        if spec.dtype is not None and dtype != spec.dtype:
            return f"it is {dtype}, planned {spec.dtype}"
        if spec.padded is False and not bool(value.all()):
            return ("it holds padding (zeros) where the planned mask held none: attention "
                    "takes its masked branch, which holds more. optimize(..., envelope="
                    "Envelope(max_length=...)) plans both branches")
        return ""
    if spec.shape is not None:
        return f"it was a tensor of shape {list(spec.shape)} when planned and is now {value!r}"
    plain = value is None or isinstance(value, bool | int | float | str)
    if plain and value != spec.value:
        return f"it is {value!r}, planned {spec.value!r}"
    return ""
