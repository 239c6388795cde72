"""Offload a plan's chosen activations to host memory with saved-tensor hooks.

Follows `solvers.offload`, the rule `simulate` replays: while an offloaded module call runs
(a forward pre-hook enters `torch.autograd.graph.saved_tensors_hooks`, a forward hook
leaves), each tensor autograd saves outside a checkpoint is packed into a handle. The first
pack of a storage copies the whole storage to host memory (pinned, on a side stream, on a
GPU) and later packs of it, through any view, reuse that copy; parameters, buffers and the
model's inputs stay where they are. Its device memory is let go at the end of the call the
plan's release names (by default the offloaded call; its forward hook waits for the copies
to end), never earlier: polling the copies' events freed them when the host saw them end, so
the peak followed how far the host ran ahead of the GPU (an H100 measured one plan at 6.99
GiB in one run and 8.83 GiB in the next). In the backward an offloaded call's copies come
back all at once: when the gradient of the output of the call named by the plan's prefetch
arrives (a tensor hook registered by a forward hook on that module), or when first unpacked;
the compute stream waits on an event, never on the device. A checkpoint
(`planner.runtime.emit.Checkpointed`) pauses the hooks inside its forward and rerun: its own hooks
take what is saved there. Its input save comes before the pause, so a checkpoint inside an
offloaded call moves its inputs ("offloaded checkpointing"); and on torch >= 2.14 the
outputs a top-level checkpoint saves as OFFLOAD (SAC's cache, packed through the hooks
around the checkpoint) move too, one by one, while those it saves as KEEP stay.

The hooks of a call are pushed on the thread's saved-tensor-hook stack by its pre-hook and
taken off by its forward hook, which torch also calls when the forward raises an
`Exception`. A `KeyboardInterrupt` (any `BaseException`) skips it: the pushed pack hook then
finds its call's frame gone from the stack, moves nothing and takes itself off, and the next
offloaded call or step closes whatever the interrupted forward left open, as does
`remove_offload` (``planner.remove``), so that no hook outlives the plan. Bookkeeping lives
as long as the saves it is for: a step whose backward never runs (a loss computed and
dropped) leaves nothing behind once its graph is freed.

On a machine without a GPU the same hooks run, with host and device one memory: copies are
synchronous, and host buffers are made inside `measure.host_memory()`, so `PeakTracker`
counts them as host memory, not as the device's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from planner.measure import host_memory

__all__ = ["KEEPS_THROUGH_HOOKS", "OffloadHooks", "install_offload", "keeps_next",
           "offload_paused", "offloaded_modules",
           "remove_offload", "suspended_offload"]

_state = threading.local()

# Torch >= 2.14 routes the tensors selective checkpointing keeps through the saved-tensor
# hooks around the checkpoint when asked (`respect_saved_tensors_hooks`): an offloaded
# call's keeps can go to the host. Older torch keeps them on the device, unhooked.
KEEPS_THROUGH_HOOKS: dict[str, bool] = (
    {"respect_saved_tensors_hooks": True}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


@contextlib.contextmanager
def offload_paused() -> Iterator[None]:
    """Inside a checkpoint's forward and rerun (`emit.Checkpointed`): its own hooks take
    the saves, offloaded calls it runs move nothing; only the outputs a top-level checkpoint
    offloads (`keeps_next`) still reach the hooks of the offloaded call around it."""
    _state.paused = getattr(_state, "paused", 0) + 1
    try:
        yield
    finally:
        _state.paused -= 1
        _state.keep = False


def keeps_next(keep: bool) -> None:
    """Called by a SAC policy on each op: whether the tensors packed next are outputs the
    checkpoint saves to be moved (OFFLOAD, in its forward, not its rerun). A nested
    checkpoint's keeps stay on the device, as `solvers.offload` says."""
    _state.keep = keep and getattr(_state, "paused", 0) == 1


def _paused() -> bool:
    return bool(getattr(_state, "paused", 0)) and not getattr(_state, "keep", False)


@dataclass(eq=False)
class _Copy:
    """One storage on the host, and on the device again once fetched."""

    host: torch.Tensor
    device: torch.device
    group: tuple[int, int]  # (step, offloaded call)
    on_device: torch.Tensor | None = None
    source: torch.Tensor | None = None  # the device bytes until the copy out has ended
    copied_out: Any = None  # CUDA events: the copy to the host, and back, has ended
    copied_in: Any = None
    __weakref__: Any = field(default=None, init=False, repr=False)


@dataclass(eq=False)
class _OpenCall:
    """An offloaded module call between its pre-hook and its forward hook, on one thread:
    the frame of its `Module._call_impl` (on the stack exactly while the call runs) and the
    pack hook it pushed (None: nothing pushed, inside a checkpoint)."""

    frame: FrameType | None
    pack: Callable[[torch.Tensor], Any] | None = None


@dataclass(eq=False)
class _Handle:
    """What autograd holds for one save: the copy and the view of its storage."""

    copy: _Copy
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _on_stack(frame: FrameType) -> bool:
    """Whether ``frame`` is running on this thread (an offloaded call's pack hook runs
    inside the call, a few frames below it)."""
    current = sys._getframe(2)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _close(call: _OpenCall) -> None:
    """Take a call's pack hook off this thread's saved-tensor-hook stack: the top, or from
    under hooks pushed after it (which go back in their order). The frame is dropped: saves
    hold the pack hook, and must not hold the call's locals."""
    if call.pack is not None:
        above = []
        while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if top[0] is call.pack:
                break
            above.append(top)
        for pack, unpack in reversed(above):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    call.frame = call.pack = None


_CALL_IMPL = nn.Module._call_impl.__code__


def _call_frame() -> FrameType:
    """The frame of the `Module._call_impl` that called the hook calling this: it holds
    from the call's pre-hooks to its forward hooks, also those torch calls after the
    forward raised. (A module class with its own call: the hook's caller.)"""
    caller = frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            break
        if frame.f_code is _CALL_IMPL:
            return frame
        frame = frame.f_back
    return caller


class OffloadHooks:
    """The offload of one applied plan: `calls[k]` is the k-th offloaded module's path,
    `prefetch[k]` the path whose output's gradient fetches it back (None: when needed) and
    `release[k]` the path at whose end its copies out are waited for (None: its own)."""

    def __init__(self, calls: list[str], prefetch: list[str | None],
                 release: list[str | None] | None = None) -> None:
        self.calls = calls
        self.prefetch = prefetch
        self.release = release or [None] * len(calls)
        self._reset()

    def _reset(self) -> None:
        self.step = 0
        self._thread = threading.local()  # `open_calls`, as torch's hook stack: per thread
        self.static: set[StorageWeakRef] = set()
        # weak: a copy lives as long as the saves that hold its handles, not a step longer
        self.copies: dict[StorageWeakRef, weakref.ref[_Copy]] = {}
        self.groups: dict[tuple[int, int], list[weakref.ref]] = {}
        self.fetched: set[tuple[int, int]] = set()
        self.streams: dict[str, Any] = {}
        # per offloaded call: its copies out that still hold their device bytes
        self.pending: dict[int, list[_Copy]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"calls": self.calls, "prefetch": self.prefetch, "release": self.release}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("release", [None] * len(state["calls"]))  # pickled before it
        self.__dict__.update(state)
        self._reset()

    # ------------------------------------------------------------ forward

    def new_step(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Root pre-hook: parameters, buffers and inputs are never moved. What an earlier
        step left is dropped: calls an interrupt left open, and the bookkeeping of copies
        no graph holds any more (a step without a backward frees them with its graph)."""
        self._close_stale()
        self.end_copies_out(list(self.pending))  # an interrupted step's
        if not torch.is_grad_enabled():
            return
        self.step += 1
        self.copies = {ref: c for ref, c in self.copies.items()
                       if not ref.expired() and c() is not None}
        self.groups = {group: live for group, refs in self.groups.items()
                       if (live := [ref for ref in refs if ref() is not None])}
        self.fetched = {key for key in self.fetched if key[0] == self.step - 1}
        tensors = [*model.parameters(), *model.buffers(),
                   *(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
        self.static = {StorageWeakRef(t.untyped_storage()) for t in tensors
                       if t.layout == torch.strided and t.device.type != "meta"}

    def open_calls(self) -> list[_OpenCall]:
        """The offloaded calls running on this thread, outermost first."""
        if not hasattr(self._thread, "calls"):
            self._thread.calls = []
        return self._thread.calls

    def enter(self, k: int, frame: FrameType) -> None:
        """Pre-hook of the k-th offloaded call, whose `Module._call_impl` runs in ``frame``
        (inside a checkpoint, forward or rerun, nothing is pushed: the checkpoint's hooks
        take the saves)."""
        self._close_stale()
        call = _OpenCall(frame)
        self.open_calls().append(call)  # before the push: an interrupt finds it
        if getattr(_state, "paused", 0):
            return
        group = (self.step, k)

        def pack(t: torch.Tensor) -> Any:
            if call.frame is None or not _on_stack(call.frame):  # interrupted: inert
                self._close_stale()
                return t
            return self.pack(t, group)

        call.pack = pack
        torch._C._autograd._push_saved_tensors_default_hooks(pack, self.unpack)

    def leave(self, k: int, frame: FrameType) -> None:
        """Forward hook (always called, also when the forward raised an `Exception`) of
        the k-th offloaded call, whose `Module._call_impl` runs in ``frame``; a call whose
        pre-hook pushed nothing (no grad) has nothing open."""
        self._close_stale()
        calls = self.open_calls()
        if calls and calls[-1].frame is frame:
            _close(calls.pop())
        if self.release[k] is None:
            self.end_copies_out([k])

    def close_open_calls(self) -> None:
        """Take every call still open on this thread off the saved-tensor-hook stack (an
        interrupt left them there): a removed plan leaves no hook behind."""
        calls = self.open_calls()
        while calls:
            _close(calls.pop())

    def _close_stale(self) -> None:
        """Close this thread's calls whose frame has left the stack: a `BaseException`
        other than `Exception` skipped their forward hooks."""
        calls = self.open_calls()
        if not calls:
            return
        frame, running = sys._getframe(1), set()
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
        while calls and id(calls[-1].frame) not in running:
            _close(calls.pop())

    def _movable(self, t: torch.Tensor) -> bool:
        """An activation: not a parameter or a view of one (FSDP2's all-gathered weights
        are parameters while they are unsharded), a buffer or an input."""
        return (not _paused() and type(t) is torch.Tensor
                and not isinstance(t._base, nn.Parameter)
                and t.layout == torch.strided and t.device.type != "meta"
                and StorageWeakRef(t.untyped_storage()) not in self.static)

    def pack(self, t: torch.Tensor, group: tuple[int, int]) -> Any:
        if not self._movable(t):
            return t
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        known = self.copies.get(ref)
        copy = known() if known is not None else None
        if copy is None:
            copy = self._copy_out(storage, t.device, group)
            self.copies[ref] = weakref.ref(copy)
            self.groups.setdefault(group, []).append(weakref.ref(copy))
        return _Handle(copy, t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _copy_out(self, storage: torch.UntypedStorage, device: torch.device,
                  group: tuple[int, int]) -> _Copy:
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        with host_memory():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                               pin_memory=device.type == "cuda")
        if device.type != "cuda":
            host.copy_(source)
            return _Copy(host, device, group)
        stream = self._stream("out", device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        copy = _Copy(host, device, group, source=source, copied_out=event)
        self.pending.setdefault(group[1], []).append(copy)
        return copy

    def end_copies_out(self, ks: list[int]) -> None:
        """At the end of the call that releases the offloaded calls ``ks`` (and of every
        call at a fetch or a new step, after an interrupted one): wait until their copies
        out have ended (the host waits, the device runs what is queued), then drop their
        device bytes."""
        for k in ks:
            for copy in self.pending.pop(k, ()):
                copy.copied_out.synchronize()
                copy.source = None

    def _stream(self, name: str, device: torch.device) -> Any:
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream(device)
        return self.streams[name]

    # ------------------------------------------------------------ backward

    def output_hook(self, k: int) -> Any:
        """For the forward hook of a prefetching module: a gradient hook on its output."""
        group = (self.step, k)

        def fetch(grad: torch.Tensor) -> None:
            self.fetch(group)

        return fetch

    def fetch(self, group: tuple[int, int]) -> None:
        """Bring one offloaded call's copies back (once)."""
        self.end_copies_out(list(self.pending))
        if group in self.fetched:
            return
        self.fetched.add(group)
        for ref in self.groups.pop(group, ()):
            copy = ref()
            if copy is not None and copy.on_device is None:
                self._copy_in(copy)

    def _copy_in(self, copy: _Copy) -> None:
        back = torch.empty(copy.host.numel(), dtype=torch.uint8, device=copy.device)
        if copy.device.type != "cuda":
            back.copy_(copy.host)
            copy.on_device = back
            return
        stream = self._stream("in", copy.device)
        stream.wait_stream(torch.cuda.current_stream(copy.device))  # `back` is allocated
        stream.wait_event(copy.copied_out)  # the host bytes are written
        with torch.cuda.stream(stream):
            back.copy_(copy.host, non_blocking=True)
            copy.copied_in = torch.cuda.Event()
            copy.copied_in.record(stream)
        back.record_stream(stream)
        copy.on_device = back

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        copy = packed.copy
        if copy.on_device is None:
            self.fetch(copy.group)
            if copy.on_device is None:  # not in its call's list any more (fetched before)
                self._copy_in(copy)
        if copy.device.type == "cuda":
            torch.cuda.current_stream(copy.device).wait_event(copy.copied_in)
        return torch.empty(0, dtype=packed.dtype, device=copy.device).set_(
            copy.on_device.untyped_storage(), packed.offset, packed.size, packed.stride)


COMPILE_REFUSED = (
    "this model's plan offloads activations with saved-tensor hooks, which torch.compile "
    "does not trace (it breaks the graph there), so the compiled step would not save and "
    "move what the plan predicts. Compile a plan without offload (optimize(..., "
    "offload=False)), or run this one eagerly.")


class _Enter:
    """Forward pre-hook of an offloaded call (a class: the model still pickles)."""

    def __init__(self, hooks: OffloadHooks, k: int) -> None:
        self.hooks, self.k = hooks, k

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        if _under_compile():
            raise RuntimeError(COMPILE_REFUSED)
        self.hooks.enter(self.k, _call_frame())


def _under_compile() -> bool:
    """Inside torch.compile: tracing, or running eagerly after a graph break (a frame of
    a compiled function or module is still on the stack). torch.compiler.disable, and the
    checkpoints that disable dynamo around themselves (torch.utils.checkpoint,
    checkpoint_wrapper), leave frames of the same file that compile nothing."""
    if torch.compiler.is_compiling():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_EVAL_FRAME) and _compiles(frame):
            return True
        frame = frame.f_back
    return False


def _compiles(frame: FrameType) -> bool:
    """Whether a frame of dynamo's eval_frame.py runs compiled code: a compile wrapper, or
    a method of a dynamo context or an `OptimizedModule` whose callback compiles
    (`DisableContext`'s is None)."""
    if frame.f_code.co_name == "compile_wrapper":
        return True
    names = frame.f_locals
    owner = names.get("self")
    context = getattr(owner, "dynamo_ctx", owner)
    return callable(names.get("callback", getattr(context, "callback", None)))


_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


class _Leave:
    def __init__(self, hooks: OffloadHooks, k: int) -> None:
        self.hooks, self.k = hooks, k

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self.hooks.leave(self.k, _call_frame())


class _Release:
    """Forward hook of a module at whose end offloaded calls' copies out are waited for."""

    def __init__(self, hooks: OffloadHooks, ks: list[int]) -> None:
        self.hooks, self.ks = hooks, ks

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self.hooks.end_copies_out(self.ks)


class _Prefetch:
    """Forward hook of a module whose output's gradient fetches offloaded calls back."""

    def __init__(self, hooks: OffloadHooks, ks: list[int]) -> None:
        self.hooks, self.ks = hooks, ks

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                for k in self.ks:
                    t.register_hook(self.hooks.output_hook(k))


class _NewStep:
    def __init__(self, hooks: OffloadHooks) -> None:
        self.hooks = hooks

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            self.hooks.new_step(module, args, kwargs)


_HOOK_TYPES = (_Enter, _Leave, _Prefetch, _Release, _NewStep)


def install_offload(model: nn.Module, calls: list[str], prefetch: list[str | None],
                    release: list[str | None] | None = None) -> OffloadHooks:
    """Install the hooks on ``model``'s modules (paths relative to it; '' the model)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("offload hooks cannot be installed while compiling")
    hooks = OffloadHooks(calls, prefetch, release)
    model.register_forward_pre_hook(_NewStep(hooks), with_kwargs=True, prepend=True)
    for k, path in enumerate(calls):
        module = model.get_submodule(path)
        module.register_forward_pre_hook(_Enter(hooks, k))
        module.register_forward_hook(_Leave(hooks, k), always_call=True)
    by_module: dict[str, list[int]] = {}
    for k, path in enumerate(prefetch):
        if path is not None:
            by_module.setdefault(path, []).append(k)
    for path, ks in by_module.items():
        model.get_submodule(path).register_forward_hook(_Prefetch(hooks, ks))
    released: dict[str, list[int]] = {}
    for k, path in enumerate(hooks.release):
        if path is not None:
            released.setdefault(path, []).append(k)
    for path, ks in released.items():
        model.get_submodule(path).register_forward_hook(_Release(hooks, ks), always_call=True)
    return hooks


def offloaded_modules(model: nn.Module) -> list[str]:
    """Paths of the modules that carry a plan's offload hooks."""
    return [path for path, module in model.named_modules()
            if any(isinstance(h, _HOOK_TYPES) for d in (module._forward_pre_hooks,
                                                       module._forward_hooks)
                   for h in d.values())]


_Taken = list[tuple[nn.Module, str, int, Any, bool]]


def remove_offload(model: nn.Module) -> list[str]:
    """Take every offload hook off ``model``; returns the paths that had one."""
    removed = offloaded_modules(model)
    for hooks in {id(h.hooks): h.hooks for *_, h, _ in _take_hooks(model)}.values():
        hooks.close_open_calls()
    return removed


def _take_hooks(model: nn.Module) -> _Taken:
    """Remove the offload hooks; what was taken, to put back (`suspended_offload`)."""
    taken: _Taken = []
    for module in model.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, name)
            for key in [key for key, h in hooks.items() if isinstance(h, _HOOK_TYPES)]:
                flag = (module._forward_pre_hooks_with_kwargs.pop(key, False)
                        or module._forward_hooks_always_called.pop(key, False))
                taken.append((module, name, key, hooks.pop(key), flag))
    return taken


@contextlib.contextmanager
def suspended_offload(model: nn.Module) -> Iterator[None]:
    """``model`` without its offload hooks inside, the same hooks after (profiling a
    planned model sees it as it runs unplanned)."""
    taken = _take_hooks(model)
    try:
        yield
    finally:
        for module, name, key, hook, flag in taken:
            getattr(module, name)[key] = hook
            if flag:
                flags = (module._forward_pre_hooks_with_kwargs if name == "_forward_pre_hooks"
                         else module._forward_hooks_always_called)
                flags[key] = True
