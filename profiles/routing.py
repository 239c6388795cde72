"""Forced routing: run a model's routed experts on token counts chosen by the planner.

Hugging Face's MoE layers hand their experts module the router's choice as an argument
(``experts(hidden_states, top_k_index, top_k_weights)``, ``top_k_index`` of shape
``(tokens, k)``). Replacing that argument while profiling makes the step run the experts on
counts we choose, whatever the router's weights say (placeholders on the fake process
group included): `solvers.routing` bounds a schedule over every routing from such steps.
The forced choice is written into the router's own tensor, outside the dispatch modes that
record or measure the step: the step runs the ops and holds the tensors a real step does
(a checkpoint holds the router's choice until the backward, as it would). Its values are
forced; gradients of a forced step are not a real step's (the router's reach other scores).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["ROUTING_ARGUMENTS", "RoutedExperts", "balanced_counts", "moved_counts",
           "routed_experts", "routing_forced"]

# the names an experts module's forward gives the router's choice of experts per token
ROUTING_ARGUMENTS = ("top_k_index", "top_k_indices", "selected_experts", "router_indices")


class RoutedExperts:
    """The experts modules of one class in a model, and the argument that routes them."""

    def __init__(self, cls: type[nn.Module], argument: str, experts: int) -> None:
        self.cls, self.argument, self.experts = cls, argument, experts
        self.calls: list[tuple[int, int]] = []  # (tokens, k) of each forced call


def routed_experts(model: nn.Module) -> list[RoutedExperts]:
    """Each class of experts module in ``model`` that takes a routing argument
    (`ROUTING_ARGUMENTS`) and says how many experts it holds (``num_experts``)."""
    found: dict[type, RoutedExperts] = {}
    for module in model.modules():
        cls = type(module)
        experts = getattr(module, "num_experts", None)
        if cls in found or not isinstance(experts, int) or experts < 2:
            continue
        try:
            names = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            continue
        argument = next((n for n in ROUTING_ARGUMENTS if n in names), None)
        if argument is not None:
            found[cls] = RoutedExperts(cls, argument, experts)
    return list(found.values())


def balanced_counts(tokens: int, k: int, experts: int) -> list[int]:
    """``k * tokens`` routed as evenly as the experts allow."""
    share, extra = divmod(k * tokens, experts)
    return [share + (e < extra) for e in range(experts)]


def moved_counts(counts: Sequence[int], to: int, step: int) -> list[int]:
    """``counts`` with ``step`` tokens of expert 0 sent to expert ``to`` instead."""
    moved = list(counts)
    moved[0] -= step
    moved[to] += step
    return moved


def _routing_of(counts: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A ``(tokens, k)`` choice of experts giving expert ``e`` ``counts[e]`` tokens, each
    token to ``k`` distinct experts (every count at most ``tokens``): expert runs laid end
    to end, token ``t`` taking places ``t, t + T, ...``."""
    tokens, k = like.shape
    if sum(counts) != tokens * k or max(counts) > tokens:
        raise ValueError(f"counts {list(counts)} do not route {tokens} tokens to {k} experts")
    experts = torch.arange(len(counts), device=like.device, dtype=like.dtype)
    laid = torch.repeat_interleave(experts, torch.tensor(list(counts), device=like.device))
    return laid.reshape(k, tokens).t().contiguous()


def _routing_of_unseen(counts: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    with _disable_current_modes():
        return _routing_of(counts, like)


def _overwrite(choice: torch.Tensor, forced: torch.Tensor) -> None:
    """Write ``forced`` into the router's own tensor, unseen: outside the dispatch modes
    (not an op of the step) and through ``.data`` (no version bump: autograd's saved copy,
    topk's indices, is the same tensor, and the router's gradient is not this plan's to
    keep right while profiling)."""
    with _disable_current_modes(), torch.no_grad():
        choice.data.copy_(forced)


@contextlib.contextmanager
def routing_forced(found: Sequence[RoutedExperts],
                   counts_of: Callable[[int, int, int], Sequence[int]]) -> Iterator[None]:
    """Within the block, every call of the ``found`` experts classes (copies of the model
    included) routes as ``counts_of(tokens, k, experts)`` says; the classes are restored
    after."""
    originals = {}
    for routed in found:
        original = routed.cls.__dict__.get("forward")
        originals[routed.cls] = original
        signature = inspect.signature(routed.cls.forward)
        routed.cls.forward = _forced(routed, routed.cls.forward, signature, counts_of)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.forward
            else:
                cls.forward = original


def _forced(routed: RoutedExperts, forward: Callable, signature: inspect.Signature,
            counts_of: Callable[[int, int, int], Sequence[int]]) -> Callable:
    @functools.wraps(forward)
    def run(module: nn.Module, *args, **kwargs):
        bound = signature.bind(module, *args, **kwargs)
        choice = bound.arguments.get(routed.argument)
        if isinstance(choice, torch.Tensor) and choice.dim() == 2:
            tokens, k = choice.shape
            routed.calls.append((tokens, k))
            counts = counts_of(tokens, k, routed.experts)
            if is_fake(choice):  # an attempt on fake tensors: the loop will need real ones
                bound.arguments[routed.argument] = _routing_of(counts, choice)
            else:
                _overwrite(choice, _routing_of_unseen(counts, choice))
        return forward(*bound.args, **bound.kwargs)

    return run
