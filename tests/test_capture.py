from __future__ import annotations

import pytest
import torch
from torch import nn

import profiles
from planner import zoo
from profiles.tracing import flat_placeholder_values, normalize_inputs


def _call(module: nn.Module, inputs: object) -> object:
    args, kwargs = normalize_inputs(module, inputs)
    return module(*args, **kwargs)


def test_capture_shares_parameters_and_buffers(zoo_model: zoo.ZooModel) -> None:
    gm = profiles.capture(zoo_model.model, zoo_model.example_inputs, zoo_model.loss_fn)
    own_params = dict(zoo_model.model.named_parameters(remove_duplicate=False))
    own_buffers = dict(zoo_model.model.named_buffers(remove_duplicate=False))
    captured = dict(gm.named_parameters(remove_duplicate=False))
    assert captured, "the captured graph lost its parameters"
    assert all(p is own_params[name] for name, p in captured.items())
    assert all(b is own_buffers[name] for name, b in gm.named_buffers(remove_duplicate=False))
    assert sum(p.numel() for p in gm.parameters()) == sum(
        p.numel() for p in zoo_model.model.parameters())


def test_captured_graph_computes_the_same_loss(zoo_model: zoo.ZooModel) -> None:
    gm = profiles.capture(zoo_model.model, zoo_model.example_inputs, zoo_model.loss_fn)
    loss_fn = zoo_model.loss_fn or profiles.default_loss
    # Training mode with the same seed: dropout draws the same masks in both.
    torch.manual_seed(0)
    expected = loss_fn(_call(zoo_model.model, zoo_model.example_inputs))
    torch.manual_seed(0)
    actual = loss_fn(_call(gm, zoo_model.example_inputs))
    assert torch.equal(expected, actual)


def test_tied_weights_stay_tied() -> None:
    model = zoo.get("gpt", size="tiny")
    gm = profiles.capture(model.model, model.example_inputs)
    assert gm.get_parameter("lm_head.weight") is gm.get_parameter("tok_emb.weight")
    assert gm.get_parameter("lm_head.weight") is model.model.tok_emb.weight


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: neither tracer can follow it
            return self.lin(x)
        return -x


def test_data_dependent_control_flow_raises_capture_error_saying_what_to_do() -> None:
    with pytest.raises(profiles.CaptureError) as info:
        profiles.capture(Branchy(), torch.randn(2, 4))
    message = str(info.value)
    assert "symbolic_trace" in message and "torch.export" in message
    assert "What to do" in message and "control flow" in message


class KeywordModel(nn.Module):
    """Dict in, dict out; traced by torch.fx with keyword binding."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> dict:
        y = self.lin(x)
        if scale is not None:
            y = y * scale
        return {"y": y, "loss": y.square().mean()}


def test_input_forms_tensor_tuple_dict() -> None:
    x = torch.randn(2, 4)
    model = KeywordModel()
    gm = profiles.capture(model, {"x": x})
    assert flat_placeholder_values(gm, *normalize_inputs(gm, {"x": x}))[0] is x
    for inputs in (x, (x,), {"x": x}):
        gm = profiles.capture(model, inputs)
        assert torch.equal(_call(gm, inputs)["loss"], _call(model, inputs)["loss"])


class LightningLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def test_inputs_default_to_example_input_array_and_dummy_inputs() -> None:
    gm = profiles.capture(LightningLike(), None)
    assert profiles.profile(gm, None, progress=False).static.input_bytes == 3 * 4 * 4
    if "hf-gpt2" in zoo.names():
        hf = zoo.get("hf-gpt2").model
        gm = profiles.capture(hf, None)
        assert gm.meta["planner"]["method"] == "export"
    with pytest.raises(ValueError, match="example_inputs"):
        profiles.capture(nn.Linear(2, 2), None)


def test_capture_docstring_example_runs() -> None:
    import doctest

    import profiles.tracing

    result = doctest.testmod(profiles.tracing, raise_on_error=False, verbose=False)
    assert result.attempted >= 1 and result.failed == 0
