"""The batches a plan covers (:class:`Envelope`), and those batches built from one example.

A data loader gives batches of every length up to a maximum, padded or not, and a trainer
may hold several of them on the device at once. An envelope names those dimensions: the
longest batch (``max_length`` tokens per row), the rows (``batch_size``), whether rows may
be padded, how many batches a step holds (``resident_batches``), and the buckets of lengths
that get a plan each. :func:`bucket_batches` builds, from the user's one example, the batch
each bucket is planned on: every input of the example's length (dim 1, the ``[batch,
tokens]`` layout of language models) tiled or cut to the bucket's length, every input of the
example's rows to ``batch_size`` rows, and each attention mask as the branch it stands for.

Masks are the branch that reads values: Hugging Face builds an attention bias only when a
mask holds a zero, and ``sdpa`` then leaves its causal kernel, so a padded batch of the
same shape holds more than an unpadded one. Each length is planned for both (a mask with
one zero, the most tokens a padded row can hold, and a mask of ones), and the step takes
the plan of its branch (:mod:`planner.plan_table`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

__all__ = ["SCANNED_ROWS", "Envelope", "bucket_batches", "mask_inputs", "other_batches_bytes",
           "padded", "ragged", "resident_bytes", "row_lengths"]

InputKey = tuple[bool, str]  # (keyword, name) as InputSpec addresses an input


class Envelope(BaseModel):
    """The batches a plan must cover. ``max_length``: the longest row in tokens (a
    collator's ``max_length``, a tokenizer's ``model_max_length``); ``min_length`` the
    shortest; ``batch_size`` the rows (None: the example's); ``padding``: rows may be padded
    (a mask input may hold zeros); ``buckets``: ``"one"`` plans the longest batch only,
    ``"pow2"`` a plan per power of two from ``max_length / 32`` up to ``max_length`` (at
    most six), or the bucket bounds; and
    ``resident_batches``: batches on the device during a step (Hugging Face Trainer loads
    its ``gradient_accumulation_steps`` micro-batches before the first forward)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: PositiveInt | None = Field(None, description="None: no length dimension "
                                           "(images; rows and resident batches only)")
    min_length: PositiveInt = 1
    batch_size: PositiveInt | None = None
    padding: bool = True
    buckets: Literal["one", "pow2"] | tuple[PositiveInt, ...] = "one"
    resident_batches: PositiveInt = Field(1, description="batches the device holds during "
                                          "a step, this one included")

    @model_validator(mode="after")
    def _consistent(self) -> Envelope:
        if self.max_length is None:
            if self.buckets != "one":
                raise ValueError("buckets are of lengths: give max_length with them")
            return self
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} is above max_length "
                             f"{self.max_length}")
        if isinstance(self.buckets, tuple):
            bounds = list(self.buckets)
            if bounds != sorted(set(bounds)) or bounds[0] < self.min_length or \
                    bounds[-1] > self.max_length:
                raise ValueError(f"buckets {bounds}: bucket bounds ascend, each within "
                                 f"[min_length, max_length] = [{self.min_length}, "
                                 f"{self.max_length}]")
        return self

    def bounds(self) -> list[int | None]:
        """Each bucket's longest length, ascending; the last is ``max_length``."""
        if self.buckets == "one" or self.max_length is None:
            return [self.max_length]
        if self.buckets == "pow2":  # at most six: from max_length / 32 (or min_length) up
            found, bound = [], 1
            while bound < self.max_length:
                if bound >= max(self.min_length, self.max_length // 32):
                    found.append(bound)
                bound *= 2
            return [*found, self.max_length]
        return sorted({*self.buckets, self.max_length})

    def describe(self, masks: bool = True) -> str:
        """The envelope in words (``masks``: the batch has masks, so padding is a branch)."""
        rows = f"{self.batch_size} rows" if self.batch_size else "the example's rows"
        held = f", {self.resident_batches} batches resident" if self.resident_batches > 1 \
            else ""
        if self.max_length is None:
            return f"{rows}{held}"
        lengths = f"{self.max_length}" if self.min_length == self.max_length else \
            f"{self.min_length}-{self.max_length}"
        pad = "" if not masks else ", padded or not" if self.padding else ", unpadded"
        return f"{rows} of {lengths} tokens{pad}{held}"


def _tokens(value: Any) -> bool:
    """An integer or boolean tensor of ``[rows, tokens, ...]``: token ids, a mask."""
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and \
        not value.is_floating_point() and not value.is_complex()


def sequence_length(args: tuple, kwargs: dict) -> int | None:
    """The example's length: dim 1 of its first integer input of two or more dims (token
    ids; None: none, e.g. an image batch)."""
    for value in (*args, *kwargs.values()):
        if _tokens(value):
            return int(value.shape[1])
    return None


def _has_length(key: InputKey, value: Any, length0: int) -> bool:
    """Whether dim 1 of this input is the batch's length: token ids, masks and labels
    (integer), and by name ``inputs_embeds``-like or float masks."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != length0:
        return False
    return _tokens(value) or (key[0] and ("embeds" in key[1] or "mask" in key[1]))


def _rows(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    return None


def _tiled(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` tiled (or cut) along ``dim`` to ``size``: its own values, repeated."""
    now = tensor.shape[dim]
    if now == size:
        return tensor
    times = [1] * tensor.dim()
    times[dim] = -(-size // now)
    return tensor.repeat(*times).narrow(dim, 0, size).contiguous()


def _is_mask(key: InputKey, value: Any, length: int) -> bool:
    """A ``[rows, length]`` integer or boolean tensor named a mask (keyword inputs) or, for
    positional ones, holding only zeros and ones."""
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != length:
        return False
    if value.is_floating_point() or value.is_complex():
        return False
    if key[0]:
        return "mask" in key[1]
    return value.device.type != "meta" and bool(((value == 0) | (value == 1)).all())


def mask_inputs(args: tuple, kwargs: dict) -> list[InputKey]:
    """The example's attention masks, as (keyword, name)."""
    length = sequence_length(args, kwargs)
    items = [*(((False, str(k)), v) for k, v in enumerate(args)),
             *(((True, k), v) for k, v in kwargs.items())]
    return [key for key, value in items if length is not None and _is_mask(key, value, length)]


def padded(masks: list[InputKey], args: tuple, kwargs: dict) -> bool:
    """Whether any of ``masks`` holds a zero in this call: the branch a padded batch takes
    (one reduction per mask; Hugging Face's own mask code reads the same)."""
    for keyword, name in masks:
        value = kwargs.get(name) if keyword else (args[int(name)] if int(name) < len(args)
                                                   else None)
        if isinstance(value, torch.Tensor) and not bool(value.all()):
            return True
    return False


def ragged(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The batch with each mask padded as a collator pads rows of many lengths: row ``r`` of
    ``R`` keeps its first ``L * (r + 1) // R`` tokens (at least one), the rest zeros. A
    compiled step's memory can follow the mask's values, not only its shape (HF Llama tiny
    under one schedule: 1.0 MB more with 88 of 256 tokens padded than with one)."""
    masks = set(mask_inputs(args, kwargs))

    def padded_rows(key: InputKey, value: Any) -> Any:
        if key not in masks:
            return value
        rows, length = value.shape
        kept = torch.arange(length, device=value.device)[None, :] < torch.tensor(
            [max(1, length * (r + 1) // rows) for r in range(rows)], device=value.device)[:, None]
        return kept.to(value.dtype)

    return (tuple(padded_rows((False, str(k)), v) for k, v in enumerate(args)),
            {k: padded_rows((True, k), v) for k, v in kwargs.items()})


def _resized(key: InputKey, value: Any, length0: int | None, rows0: int,
             length: int | None, rows: int, masks: list[InputKey], pad: bool | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    out = value
    if length is not None and length0 is not None and _has_length(key, out, length0):
        out = _tiled(out, 1, length)
    if out.dim() >= 1 and out.shape[0] == rows0:
        out = _tiled(out, 0, rows)
    if key in masks and pad is not None:
        out = torch.ones_like(out)
        if pad:  # one padded token: the padded branch with the most real tokens
            out[0, -1] = 0
    return out


def batch_at(args: tuple, kwargs: dict, length: int | None, rows: int | None,
             pad: bool | None) -> tuple[tuple, dict]:
    """The example as a batch of ``rows`` rows of ``length`` tokens (None: its own), its
    masks padded (``pad``) or not (None: as they are)."""
    length0, rows0 = sequence_length(args, kwargs), _rows(args, kwargs)
    if rows0 is None or (length is not None and length0 is None):
        raise ValueError("an envelope of lengths needs an input of [batch, tokens] (integer "
                         "token ids); this example has none: give Envelope(max_length=None) "
                         "for rows and resident batches only")
    masks = mask_inputs(args, kwargs)
    rows = rows or rows0
    new_args = tuple(_resized((False, str(k)), v, length0, rows0, length, rows, masks, pad)
                     for k, v in enumerate(args))
    new_kwargs = {k: _resized((True, k), v, length0, rows0, length, rows, masks, pad)
                  for k, v in kwargs.items()}
    return new_args, new_kwargs


def branches(envelope: Envelope, masks: list[InputKey]) -> list[bool | None]:
    """The mask branches each length is planned for: none without masks, the unpadded one
    only when rows are never padded."""
    if not masks:
        return [None]
    return [False, True] if envelope.padding else [False]


def bucket_batches(args: tuple, kwargs: dict, envelope: Envelope
                   ) -> list[tuple[int | None, bool | None, tuple, dict]]:
    """(length, padded, args, kwargs) of every batch the envelope is planned on: each
    bucket's longest, in each mask branch."""
    masks = mask_inputs(args, kwargs)
    return [(length, pad, *batch_at(args, kwargs, length, envelope.batch_size, pad))
            for length in envelope.bounds() for pad in branches(envelope, masks)]


def other_batches_bytes(envelope: Envelope, args: tuple, kwargs: dict) -> int:
    """Bytes of the batches a step holds beside its own (``resident_batches - 1`` of them),
    each as large as this one (the envelope's longest: a loader gives them in any order)."""
    return (envelope.resident_batches - 1) * resident_bytes(args, kwargs)


def resident_bytes(args: tuple, kwargs: dict) -> int:
    """Bytes of one batch's tensors (each storage once)."""
    storages: dict[Any, int] = {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr() if value.device.type != "meta" else id(storage)] = \
                storage.nbytes()
    return sum(storages.values())


SCANNED_ROWS = 100_000  # a larger training set is not read for its longest row


def row_lengths(dataset: Any) -> tuple[int, int] | None:
    """The fewest and most ``input_ids`` of a row of a map-style training set (None: not
    one, or larger than ``SCANNED_ROWS`` rows)."""
    try:
        size = len(dataset)
    except TypeError:
        return None
    if not 0 < size <= SCANNED_ROWS:
        return None
    column = getattr(dataset, "column_names", None)
    if column is not None:  # a datasets.Dataset: read the one column
        if "input_ids" not in column:
            return None
        rows = dataset.with_format(None)["input_ids"]
    else:
        rows = [row.get("input_ids") if isinstance(row, dict) else None for row in dataset]
    if any(row is None for row in rows):
        return None
    lengths = [len(row) for row in rows]
    return min(lengths), max(lengths)
