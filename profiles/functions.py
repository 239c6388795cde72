"""Custom autograd Functions: which ops one ``Function.apply`` call ran.

A ``torch.autograd.Function`` runs its forward's aten ops without autograd, and its own
``backward`` stands for all of them: a straight-through estimator's gradient is not the
gradient of ``round``, a fused kernel's backward is not its ops'. So the ops one call ran
are one unit for the planner: never split between regions, never re-derived from the ops
(a traced forward calls the Function, `FunctionCall`), and the call's backward is booked to
its last op, which is where autograd packs what the call saves (``ctx.save_for_backward``
packs after the forward returns).

Nothing in torch's dispatch says where such a call begins or ends (its ops reach a dispatch
mode as any others; ``Function.apply`` is no torch function), so while a step is recorded
or a forward traced, ``Function.apply`` itself is watched: `watched_functions` reports each
outermost call to a listener, `functions_as_leaves` makes an fx trace record the call as one
node. Both replace ``Function.apply`` on the class for the duration of a ``with`` block and
put back what they found, so they nest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx
from torch.autograd.function import Function
from torch.utils._pytree import tree_leaves

__all__ = ["FunctionCall", "function_name", "functions_as_leaves", "watched_functions"]


def function_name(cls: type) -> str:
    """How profiles and messages name a Function class: ``module.QualName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


class FunctionCall:
    """``cls.apply`` as an fx node's target: one call of the Function, its own backward
    included. Equal for equal classes; named so that a graph's Python names it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.__name__ = f"{cls.__qualname__.replace('.', '_')}_apply"
        self.__module__ = __name__  # not torch's: fx's generated code names it a global

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.cls.apply(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionCall) and other.cls is self.cls

    def __hash__(self) -> int:
        return hash(self.cls)

    def __repr__(self) -> str:
        return f"{function_name(self.cls)}.apply"


@contextlib.contextmanager
def _apply_replaced(make: Callable[[Callable[..., Any]], Callable[..., Any]]
                    ) -> Iterator[None]:
    """``Function.apply`` is ``make(previous)`` inside the block, where ``previous(cls, *args,
    **kwargs)`` runs what was there before (torch's own, or an outer block's)."""
    found = Function.__dict__["apply"]

    def previous(cls: type, *args: Any, **kwargs: Any) -> Any:
        return found.__get__(None, cls)(*args, **kwargs)

    Function.apply = classmethod(make(previous))
    try:
        yield
    finally:
        Function.apply = found


@contextlib.contextmanager
def watched_functions(started: Callable[[type, tuple, dict], Any],
                      ended: Callable[[Any, Any], None]) -> Iterator[None]:
    """Inside the block, each outermost ``Function.apply`` call runs between
    ``token = started(cls, args, kwargs)`` and ``ended(token, output)`` (not when it raises).
    Calls a Function's forward makes (another Function inside it) are part of it."""
    depth = 0

    def make(previous: Callable[..., Any]) -> Callable[..., Any]:
        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            if depth:
                return previous(cls, *args, **kwargs)
            token = started(cls, args, kwargs)
            depth += 1
            try:
                output = previous(cls, *args, **kwargs)
            finally:
                depth -= 1
            ended(token, output)
            return output
        return apply

    with _apply_replaced(make):
        yield


@contextlib.contextmanager
def functions_as_leaves(tracer: fx.Tracer) -> Iterator[None]:
    """While ``tracer`` traces, a Function applied to a proxy is one ``call_function`` node
    whose target is `FunctionCall` (fx would otherwise run its forward on the proxies and
    record its ops, losing its backward)."""
    def make(previous: Callable[..., Any]) -> Callable[..., Any]:
        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", FunctionCall(cls), args, kwargs)
            return previous(cls, *args, **kwargs)
        return apply

    with _apply_replaced(make):
        yield
