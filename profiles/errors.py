"""Errors raised while profiling; torch-free so solvers and tools can catch them."""

from __future__ import annotations


class ProfileError(RuntimeError):
    """One training step of the model could not be profiled (it fails to run, say)."""


class LossNotFoundError(ValueError):
    """The training loss cannot be told from the model's output (``default_loss``).

    ``output`` says what the output was. The message advises ``loss_fn=``; where no loss_fn
    can be given (a trainer switch, the command line) the caller says what to do there
    instead (:meth:`with_remedy`)."""

    PYTHON_REMEDY = ("pass loss_fn=lambda output: ... returning a scalar tensor (for HF "
                     "models, passing `labels` in the inputs makes the output carry `.loss`).")

    def __init__(self, output: str, remedy: str = PYTHON_REMEDY) -> None:
        self.output = output
        super().__init__(f"Cannot tell the training loss from the model's output ({output}): "
                         f"{remedy}")

    def with_remedy(self, remedy: str) -> LossNotFoundError:
        """The same error, advising ``remedy``."""
        return LossNotFoundError(self.output, remedy)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
