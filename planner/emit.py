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

import logging
import warnings
from collections import Counter
from collections.abc import Iterable
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

from planner.offload import KEEPS_THROUGH_HOOKS, keeps_next, offload_paused
from profiles.kernels import attention_kernels

log = logging.getLogger(__name__)

__all__ = ["ANY_PRECISION", "Checkpointed", "OpStreamWarning", "RegionSpec",
           "checkpointed_modules", "install_checkpoints", "remove_checkpoints"]


ANY_PRECISION = "any"  # RegionSpec.autocast_dtype: compare the op stream under any precision


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
    keep_ops: frozenset[tuple[str, int]]  # (aten op, occurrence in the module's forward)
    restore_buffers: tuple[str, ...] = ()  # relative to the module
    expected_ops: tuple[tuple[str, int], ...] = ()
    strict: bool = False
    autocast_dtype: str | None = ANY_PRECISION


def _precision(tensors: list[torch.Tensor]) -> str | None:
    """The autocast dtype a call runs under, e.g. ``"bfloat16"``; None without autocast."""
    device = tensors[0].device.type if tensors else "cpu"
    if not torch.is_autocast_enabled(device):
        return None
    return str(torch.get_autocast_dtype(device)).removeprefix("torch.")


class OpStreamWarning(UserWarning):
    """A checkpointed module's forward ran other ops than the call the plan was made for."""


class _Policy:
    """SAC policy of one checkpoint call: keeps the planned (op, occurrence) pairs; counts
    the forward and the rerun separately."""

    def __init__(self, keep_ops: frozenset[tuple[str, int]]) -> None:
        self.keep_ops = keep_ops
        self.counters: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        counter = self.counters[ctx.is_recompute]
        name = str(func)
        occurrence = counter[name]
        counter[name] += 1
        keep = (name, occurrence) in self.keep_ops
        # SAC packs a kept output right after this call: an offloaded call's hooks move it
        keeps_next(keep and not ctx.is_recompute)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed:
    """A module's ``forward``, run under non-reentrant checkpoint (set on the instance)."""

    checked = False  # the op stream of a training step was compared with the plan's

    def __init__(self, module: nn.Module, spec: RegionSpec) -> None:
        self.module = module
        self.spec = spec
        # a forward already set on the instance (another library's hook) is kept and wrapped
        self.inner = module.__dict__.get("forward")

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _body(self) -> Any:
        """The function checkpoint calls: the forward, but on a rerun the buffers it updates
        are put back, so recomputing changes no state."""
        if not self.spec.restore_buffers:
            return self.original
        calls = 0

        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.original(*args, **kwargs)
            buffers = [self.module.get_buffer(name) for name in self.spec.restore_buffers]
            # outside the dispatch modes: SAC's replay must see only the module's own ops
            with _disable_current_modes(), torch.no_grad():
                before = [b.clone() for b in buffers]
            try:
                return self.original(*args, **kwargs)
            finally:  # also when early stop interrupts the rerun
                with _disable_current_modes(), torch.no_grad():
                    for buffer, value in zip(buffers, before, strict=True):
                        buffer.copy_(value)

        return run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        # Every tensor argument goes to checkpoint positionally: checkpoint saves positional
        # tensors as saved tensors (nested in another checkpoint: packed into it, nothing
        # held) but holds keyword arguments and containers as plain objects until its frame
        # dies (an HF attention's hidden_states=... would stay alive through the forward).
        # The rerun rebuilds fresh containers: a caller may append to a list it passed
        # (DenseNet's layers take the growing list of features).
        leaves, structure = tree_flatten((args, kwargs))
        where = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        body = self._body()

        def run(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for k, tensor in zip(where, tensors, strict=True):
                filled[k] = tensor
            call_args, call_kwargs = tree_unflatten(filled, structure)
            with offload_paused():  # the forward and its rerun: the checkpoint's saves
                return body(*call_args, **call_kwargs)

        tensors = [leaves[k] for k in where]
        for k in where:
            leaves[k] = None  # the closure keeps the structure, not the tensors
        # the first training call counts its ops with a policy that keeps what the plan
        # keeps (nothing, for most regions); later calls of a region that keeps nothing run
        # plain checkpoint and pay nothing
        check = bool(self.spec.expected_ops) and self._planned_step(tensors) and (
            bool(self.spec.keep_ops) or not self.checked)
        # the checkpoint's input save goes through offload hooks when a call it runs in is
        # offloaded (offloaded checkpointing); its forward and rerun (`run`) pause them
        if not check and not self.spec.keep_ops:
            return checkpoint(run, *tensors, use_reentrant=False)
        policy = _Policy(self.spec.keep_ops)
        out = checkpoint(run, *tensors, use_reentrant=False, **KEEPS_THROUGH_HOOKS,
                         context_fn=lambda: create_selective_checkpoint_contexts(policy))
        if check:
            self._check_ops(policy.counters[False])  # under strict, raises every call
            self.checked = True
        return out

    def _planned_step(self, tensors: list[torch.Tensor]) -> bool:
        """Whether this call is one of the training step the plan was made for: the module
        in train() mode (eval runs other ops, e.g. no dropout), under the precision planned,
        eager (the compiled graph is not counted)."""
        return self.module.training and not torch.compiler.is_compiling() and (
            self.spec.autocast_dtype == ANY_PRECISION
            or _precision(tensors) == self.spec.autocast_dtype)

    def _check_ops(self, ran: Counter[str]) -> None:
        expected = dict(self.spec.expected_ops)
        if not expected or ran == Counter(expected):
            return
        changed = sorted(set(ran) ^ set(expected) | {op for op in ran
                                                     if ran[op] != expected.get(op)})
        planned, running = attention_kernels(list(expected)), attention_kernels(list(ran))
        if set(planned) != set(running):
            message = (f"module {self.spec.path!r} runs attention kernel "
                       f"{', '.join(running) or 'none'} where the plan assumed "
                       f"{', '.join(planned) or 'none'}: it saves other tensors, so the "
                       "plan's memory is not this step's. Plan for this device and dtype "
                       "(optimize(..., device=...)), or pin the kernel with "
                       "torch.nn.attention.sdpa_kernel while profiling and training.")
        else:
            message = (f"module {self.spec.path!r} ran other ops than the call the plan "
                       f"checkpoints ({', '.join(changed[:4])} ...): the plan's memory and "
                       "the ops its checkpoint keeps are not this module's (changed code, "
                       "another branch, or a plan file edited to name another module). Run "
                       "planner.optimize() again on this model and these inputs.")
        if self.spec.strict:
            from planner.plan import PlanMismatchError

            raise PlanMismatchError(message)
        warnings.warn(message, OpStreamWarning, stacklevel=3)

    def __repr__(self) -> str:
        return (f"Checkpointed({self.spec.path or type(self.module).__name__}, keep "
                f"{len(self.spec.keep_ops)} ops)")


def install_checkpoints(model: nn.Module, specs: Iterable[RegionSpec]) -> list[str]:
    """Wrap the forward of each module named in ``specs``; returns their paths."""
    installed = []
    for spec in specs:
        module = model.get_submodule(spec.path)
        if isinstance(module.__dict__.get("forward"), Checkpointed):
            raise ValueError(f"module {spec.path!r} is already checkpointed by a plan; call "
                             "planner.remove(model) first")
        module.forward = Checkpointed(module, spec)
        installed.append(spec.path)
    return installed


def checkpointed_modules(model: nn.Module) -> dict[str, Checkpointed]:
    """The modules of ``model`` that run under a plan's checkpoint, by path."""
    return {path: module.__dict__["forward"] for path, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), Checkpointed)}


def remove_checkpoints(model: nn.Module) -> list[str]:
    """Take every plan checkpoint off ``model``; returns the paths that had one."""
    removed = []
    for path, wrapper in checkpointed_modules(model).items():
        module = wrapper.module
        if wrapper.inner is not None:
            module.forward = wrapper.inner
        else:
            del module.__dict__["forward"]
        removed.append(path)
    return removed
