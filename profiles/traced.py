"""A second view of a module call: its own forward traced with torch.fx, children as leaves.

The eager profile sees a module call as a span of aten ops with its child calls inside. The
ops a forward runs *between* its children (a ResNet stem's pooling, a U-Net's
concatenations) and runs of consecutive child calls that no single module wraps can only
be regions when the forward itself is cut. `trace_segments` cuts it: the forward's fx graph
with every submodule a leaf is a list of segments, each one child call or the own ops
between two, and each segment is matched to the profile nodes it ran. Any doubt about the
match leaves the module with module-call regions only, with the reason.

What is traced: a module called once per step, with at least one child call, whose
``forward`` takes positional tensors only (an optional argument would be traced down one of
its branches, a ``None`` as a proxy that is "not None"). Tracing runs the forward on
proxies, never on tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from profiles.functions import functions_as_leaves
from profiles.schema import FunctionSpan, ModuleCall, NodeProfile, TracedSegment

__all__ = ["ChildrenAsLeaves", "trace_forward", "trace_inputs", "trace_segments",
           "traced_calls"]

_COMPUTE = frozenset({"call_function", "call_method", "call_module"})


class ChildrenAsLeaves(fx.Tracer):
    """Traces one module's own forward: every submodule it calls is one ``call_module``,
    every custom autograd Function it applies one ``call_function`` of its ``apply``
    (`profiles.functions`: its backward is its own, not its ops')."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with functions_as_leaves(self):
            return super().trace(root, concrete_args)


def _signature_problem(module: nn.Module) -> str:
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "its forward has no Python signature"
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return f"its forward takes *{p.name} or keyword-only arguments"
        if p.default is not p.empty:
            return (f"its forward's argument {p.name!r} is optional (a trace follows one of "
                    "its branches)")
    return ""


_MODULE_STATE = frozenset(vars(nn.Module()))  # parameters, buffers, children, hooks
_PLAIN = (bool, int, float, str, bytes, type(None), tuple, frozenset)
_TRACES: dict[tuple, fx.Graph | str] = {}  # by `_trace_key`: repeated blocks trace once
_TRACES_KEPT = 256


def trace_inputs(module: nn.Module) -> tuple:
    """What a trace of ``module``'s forward follows from besides its children: the forward
    function and its code, the module's own attributes (a float becomes a constant of the
    graph, a flag picks a branch), plain attributes of its class and of its bases up to
    ``nn.Module``, and the plain globals its forward names. Equal values trace alike; a
    planned traced forward compares them at each training call (``planner.runtime.emit``). Own
    attributes count only where the forward's code can name them (`_names_read`): a
    ``repr`` of an attribute it never reads (a Hugging Face module's ``config``: 0.23 ms)
    would be paid on every call for nothing."""
    cls = type(module)
    forward = cls.forward
    named = _names_read(cls, forward)
    own = tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                       if k not in _MODULE_STATE and k != "forward"  # a plan's wrapper
                       and (named is None or k in named)
                       and not isinstance(v, torch.Tensor | nn.Module)))
    bases = cls.__mro__[:cls.__mro__.index(nn.Module)] if nn.Module in cls.__mro__ else ()
    shared = tuple((base.__qualname__, k, repr(v)) for base in bases
                   for k, v in vars(base).items()
                   if isinstance(v, _PLAIN) and not k.startswith("__"))
    code = getattr(forward, "__code__", None)
    names = getattr(forward, "__globals__", {})
    read = tuple((n, repr(names[n])) for n in (code.co_names if code else ())
                 if n in names and isinstance(names[n], _PLAIN))
    return (forward, code, own, shared, read)


@functools.lru_cache(maxsize=1024)
def _names_read(cls: type, forward: Any) -> frozenset[str] | None:
    """Every name ``forward`` can read an attribute of its module by: the names and string
    constants of its code (nested code too), of the functions it wraps or closes over, and
    of the class's methods and properties those name, followed through. None when some
    callable on the way has no Python code (then every attribute counts). Cached per class
    and forward: a planned call pays a lookup."""
    names: set[str] = set()
    seen: set[int] = set()
    todo: list[Any] = [forward]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, property):
            todo += [f.fget, f.fset]
            continue
        f = getattr(f, "__func__", f)  # staticmethod, classmethod
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType):
            return None
        todo.append(getattr(f, "__wrapped__", None))
        todo += [c.cell_contents for c in f.__closure__ or ()
                 if _filled(c) and isinstance(c.cell_contents, types.FunctionType)]
        new = _code_names(code) - names
        names |= new
        todo += [m for m in (inspect.getattr_static(cls, n, None) for n in new)
                 if isinstance(m, types.FunctionType | property | staticmethod | classmethod)]
    return frozenset(names)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _code_names(code: types.CodeType) -> set[str]:
    """The names and string constants of ``code`` and of the code nested in it."""
    out: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        out.update(c.co_names)
        out.update(k for k in c.co_consts if isinstance(k, str))
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return out


def _trace_key(module: nn.Module) -> tuple | None:
    """What a trace of ``module`` follows from (`trace_inputs`) and its and its children's
    configuration (``repr``); None when an attribute prints as an object's address
    (nothing then says two instances trace alike)."""
    inputs = trace_inputs(module)
    key = (type(module), repr(module), inputs)
    return None if " at 0x" in str((key[1], inputs[2:])) else key


def trace_forward(module: nn.Module, *, instance_forward_runs: bool = True,
                  training: bool = True) -> fx.Graph | str:
    """The fx graph of ``module``'s own forward in a training step (children as leaves), or
    why there is none. The same code traces to the same node names; a module that traces
    like one traced before (`_trace_key`) shares its graph, which nobody edits.
    ``instance_forward_runs``: a forward set on the instance is what runs, so the class's
    trace is not its program (False: the caller, a plan's own wrapper, runs the trace).
    ``training``: the module's own flag while tracing (False: its forward in eval())."""
    if instance_forward_runs and "forward" in vars(module):
        return ("an instance-level forward replaces its class's (another library's hook, "
                "or the user's), and a trace follows the class's")
    key = _trace_key(module)
    key = None if key is None else (*key, training)
    if key is not None and key in _TRACES:
        return _TRACES[key]
    found = _trace(module, training)
    if key is not None:
        if len(_TRACES) >= _TRACES_KEPT:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = found
    return found


def _trace(module: nn.Module, training: bool) -> fx.Graph | str:
    problem = _signature_problem(module)
    if problem:
        return problem
    was_training = module.training
    module.training = training  # its own flag only (children are leaves)
    try:
        with warnings.catch_warnings(), _state_kept(module) as changed:
            warnings.simplefilter("ignore")
            graph = ChildrenAsLeaves().trace(module)
    except Exception as error:  # any failure to trace means: module calls only
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"torch.fx cannot trace it ({type(error).__name__}: {first[:120]})"
    finally:
        module.training = was_training
    if changed:
        return ("tracing ran some of its forward on real tensors ("
                f"{', '.join(changed[:2])} updated, put back): its trace would skip that")
    return graph


@contextlib.contextmanager
def _state_kept(module: nn.Module) -> Iterator[list[str]]:
    """Tracing runs Python on proxies, but an op on a real tensor (``self.steps.add_(1)``
    on a buffer, ``torch.rand`` of a constant shape) runs for real: buffers and the RNG
    are put back after, and what changed is listed (the trace lacks those ops)."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()
               if b.device.type != "meta"}  # meta tensors hold no values to change
    versions = {name: p._version for name, p in module.named_parameters()}
    rng = torch.get_rng_state()
    changed: list[str] = []
    try:
        yield changed
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers and not torch.equal(b, buffers[name]):
                    b.copy_(buffers[name])
                    changed.append(name)
        changed += [name for name, p in module.named_parameters()
                    if versions.get(name, p._version) != p._version]


def _pieces(graph: fx.Graph) -> list[list[fx.Node]]:
    """The graph's compute nodes cut at each child call: [own ops, call, own ops, call, ...,
    own ops] (own-op pieces may be empty)."""
    pieces: list[list[fx.Node]] = [[]]
    for node in graph.nodes:
        if node.op == "call_module":
            pieces += [[node], []]
        elif node.op in _COMPUTE:
            pieces[-1].append(node)
    return pieces


_IN_PLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul,
                                 operator.itruediv, operator.iand, operator.ior})


def _in_place(node: fx.Node) -> bool:
    """Whether an fx node updates a tensor in place (``x.add_(y)``, ``torch.relu_(x)``,
    ``inplace=True``, an augmented assignment fx kept as one)."""
    name = str(node.target) if node.op == "call_method" else \
        getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or \
        node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True


def trace_segments(graph: fx.Graph, call: ModuleCall, children: Sequence[ModuleCall],
                   nodes: Sequence[NodeProfile], functions: Sequence[FunctionSpan] = ()
                   ) -> list[TracedSegment] | str:
    """Each segment of ``graph`` (the traced forward of ``call``'s module) with the profile
    nodes it ran, or why the trace does not match the profiled call. ``children``: the
    call's direct child calls, in order; ``nodes``: the profile's; ``functions``: its
    custom Function calls (one fx node each, whatever their forward writes).

    A trace can differ from the forward where tracing changes an op: ``out += identity``
    on a tensor traces as an out-of-place add (fx proxies have no ``__iadd__``), which
    holds one more tensor. Own ops are matched by their in-place updates: as many in the
    trace as the profile saw, per segment."""
    pieces = _pieces(graph)
    called = [piece[0] for piece in pieces[1::2]]
    prefix = f"{call.path}." if call.path else ""
    traced_paths = [prefix + str(node.target) for node in called]
    ran_paths = [c.path for c in children]
    if traced_paths != ran_paths:
        return (f"its traced forward calls {len(traced_paths)} children where the profiled "
                f"call ran {len(ran_paths)} (or in another order)")
    bounds = [call.start] + [x for c in children for x in (c.start, c.stop)] + [call.stop]
    out: list[TracedSegment] = []
    for k, piece in enumerate(pieces):
        start, stop = bounds[k], bounds[k + 1]
        if stop < start:
            return "its child calls overlap in the profile"
        if not piece:
            if stop > start:
                return ("it ran ops the traced graph does not show (hooks, or code outside "
                        "its forward)")
            continue
        if k % 2 == 0 and sum(map(_in_place, piece)) != sum(
                bool(nd.written_storages) for nd in nodes[start:stop]
                if not _in_function(nd.index, functions)):
            return (f"its trace updates tensors in place elsewhere than its forward (near "
                    f"fx node {piece[0].name!r}; `x += y` on a tensor traces as `x + y`)")
        out.append(TracedSegment(first=piece[0].name, last=piece[-1].name, start=start,
                                 stop=stop, child=k % 2 == 1))
    return out


def _in_function(index: int, functions: Sequence[FunctionSpan]) -> bool:
    return any(f.start <= index < f.stop for f in functions)


def traced_calls(model: nn.Module, calls: list[ModuleCall], nodes: Sequence[NodeProfile],
                 functions: Sequence[FunctionSpan] = ()) -> list[ModuleCall]:
    """``calls`` with `traced` segments (or the reason in `untraced`) for every call of a
    module that runs at least one child call; other calls are returned unchanged.
    ``functions``: the step's custom Function calls (`trace_segments`)."""
    children: dict[int, list[ModuleCall]] = {}
    for c in calls:
        if c.parent is not None:
            children.setdefault(c.parent, []).append(c)
    out = []
    for call in calls:
        kids = sorted(children.get(call.index, []), key=lambda c: (c.start, c.stop))
        if not kids:
            out.append(call)
            continue
        found = _segments_of(model, call, kids, nodes, functions)
        update = {"traced": found} if isinstance(found, list) else {"untraced": found}
        out.append(call.model_copy(update=update))
    return out


def _segments_of(model: nn.Module, call: ModuleCall, kids: list[ModuleCall],
                 nodes: Sequence[NodeProfile], functions: Sequence[FunctionSpan]
                 ) -> list[TracedSegment] | str:
    if call.calls > 1:
        return f"it runs {call.calls} times per step (one forward serves every call)"
    graph = trace_forward(model.get_submodule(call.path))
    if isinstance(graph, str):
        return graph
    return trace_segments(graph, call, kids, nodes, functions)
