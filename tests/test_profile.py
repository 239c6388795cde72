from __future__ import annotations

import pydantic
import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import profiles
from planner import zoo
from profiles.tracing import normalize_inputs
from solvers.from_profile import problem_from_profile


def _profile(model: zoo.ZooModel, **kwargs: object) -> tuple[torch.fx.GraphModule,
                                                             profiles.GraphProfile]:
    gm = profiles.capture(model.model, model.example_inputs, model.loss_fn)
    kwargs.setdefault("timing", "estimate")
    return gm, profiles.profile(gm, model.example_inputs, progress=False, **kwargs)


def _real_saved_bytes(module: nn.Module, model: zoo.ZooModel) -> int:
    """Bytes of the storages autograd saves in a real step, each once, params/inputs out."""
    args, kwargs = normalize_inputs(module, model.example_inputs)
    static = {StorageWeakRef(t.untyped_storage())
              for t in [*module.parameters(), *module.buffers(), *args, *kwargs.values()]
              if isinstance(t, torch.Tensor)}
    seen: dict[StorageWeakRef, int] = {}
    keep = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in static:
            seen[ref] = tensor.untyped_storage().nbytes()
        keep.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        (model.loss_fn or profiles.default_loss)(module(*args, **kwargs))
    return sum(seen.values())


def test_saved_activation_bytes_are_exact(zoo_model: zoo.ZooModel) -> None:
    gm, prof = _profile(zoo_model)
    assert prof.saved_activation_bytes() > 0
    # the captured graph is what gets trained: its real step saves exactly what we predict
    assert prof.saved_activation_bytes() == _real_saved_bytes(gm, zoo_model)
    if prof.capture_method == "fx":  # fx keeps the model's own calls: the model agrees too
        assert prof.saved_activation_bytes() == _real_saved_bytes(zoo_model.model, zoo_model)


def test_profile_json_round_trip(zoo_model: zoo.ZooModel) -> None:
    _, prof = _profile(zoo_model)
    again = profiles.GraphProfile.from_json(prof.to_json())
    assert again == prof
    assert again.fingerprint == prof.fingerprint


def test_fingerprint_changes_with_shape_only() -> None:
    _, first = _profile(zoo.get("mlp", batch=8))
    _, same = _profile(zoo.get("mlp", batch=8, seed=3))
    _, other = _profile(zoo.get("mlp", batch=16))
    assert first.fingerprint == same.fingerprint
    assert first.fingerprint != other.fingerprint


def test_profile_structure_of_a_tiny_mlp() -> None:
    model = zoo.get("mlp", batch=4, width=8, depth=1)
    _, prof = _profile(model)
    nodes = {n.name: n for n in prof.nodes}
    assert prof.nodes[0].op == "placeholder" and prof.nodes[-1].op == "loss"
    stem = nodes["stem"]
    assert stem.params == ["stem.bias", "stem.weight"]
    assert stem.outputs[0].shape == [4, 8] and stem.outputs[0].nbytes == 4 * 8 * 4
    assert stem.fwd_flops == 2 * 4 * 64 * 8
    assert stem.bwd_flops == 2 * 4 * 64 * 8  # only the weight gradient: x needs no grad
    relu = nodes["relu"]
    # relu saves its own output; the stem's output is freed storage-wise from relu's view
    assert relu.saved_storages == relu.new_storages
    assert prof.static.param_bytes == sum(p.numel() * 4 for p in model.model.parameters())
    assert prof.static.grad_bytes == prof.static.param_bytes
    assert prof.static.input_bytes == 4 * 64 * 4
    assert prof.storages[stem.outputs[0].storage].producer == stem.index


def test_views_share_their_base_storage() -> None:
    model = zoo.get("gpt", size="tiny", batch=1, seq_len=8)
    _, prof = _profile(model)
    split = next(n for n in prof.nodes if n.target == "split")
    assert len(split.outputs) == 3 and split.new_storages == []
    assert len({t.storage for t in split.outputs}) == 1


def test_internal_saved_tensors_are_attributed_to_their_node() -> None:
    model = zoo.get("gpt", size="tiny", batch=1, seq_len=8, dropout=0.5)
    _, prof = _profile(model)
    dropout = next(n for n in prof.nodes if n.module.endswith("attn_drop"))
    kinds = {prof.storages[s].kind for s in dropout.saved_storages}
    assert "internal" in kinds  # the dropout mask: saved, not an output
    assert dropout.random


def test_backward_is_measured_per_node_not_assumed() -> None:
    _, prof = _profile(zoo.get("gpt", size="tiny"))
    timed = [n for n in prof.nodes if n.fwd_time_ms > 0 and n.bwd_time_ms > 0]
    assert len(timed) > 10
    ratios = {round(n.bwd_time_ms / n.fwd_time_ms, 3) for n in timed}
    assert len(ratios) > 3
    assert sum(n.bwd_flops for n in prof.nodes) > sum(n.fwd_flops for n in prof.nodes)


def test_measured_timing_on_cpu_is_positive_and_labelled() -> None:
    model = zoo.get("mlp", batch=8, width=32, depth=2)
    _, prof = _profile(model, timing="measure", repeats=2, warmup=1)
    assert prof.timing == "measure" and prof.device == "cpu"
    assert prof.step is not None and prof.step.fwd_ms > 0 and prof.step.bwd_ms > 0
    # node times are scaled to add up to the measured whole step
    assert abs(prof.fwd_time_ms - prof.step.fwd_ms) < 1e-6 * prof.step.fwd_ms + 1e-9
    linears = [n for n in prof.nodes if n.op == "call_module" and n.params]
    assert linears and all(n.fwd_time_ms > 0 and n.bwd_time_ms > 0 for n in linears)
    # checkpoint overhead calibrated on this CPU, and the counts it is charged by
    costs = prof.checkpoint_costs
    assert costs is not None and "measured" in costs.source
    assert costs.region_ms > 0 and costs.pack_ms > 0 and costs.sac_op_ms > 0
    # addmm saves its input and weight; the first layer's input needs no grad: weight only
    assert [n.saved_tensors for n in linears] == [1, 2, 2, 2]
    problem = problem_from_profile(prof)
    assert problem.checkpoint_region_ms == costs.region_ms
    assert problem.node_packed == [n.saved_tensors for n in prof.nodes]
    assert problem.node_ops == [len(n.ops) for n in prof.nodes]


def test_estimate_uses_the_named_device() -> None:
    model = zoo.get("mlp")
    _, h100 = _profile(model, device="H100")
    _, a100 = _profile(model, device="a100")
    assert h100.device == "H100" and a100.device == "A100"
    assert h100.checkpoint_costs == profiles.DEVICES["H100"].checkpoint_costs()
    assert a100.fwd_time_ms > h100.fwd_time_ms
    with pytest.raises(KeyError, match="DeviceSpec"):
        _profile(model, device="tpu-v9")


def test_profiling_leaves_the_model_untouched() -> None:
    model = zoo.get("resnet", batch=4, image=16, blocks_per_stage=1)
    net = model.model
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    for timing in ("estimate", "measure"):
        _profile(model, timing=timing, repeats=1, warmup=0)
    assert torch.equal(torch.get_rng_state(), rng)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN stats included
    assert all(torch.equal(grads[n], p.grad) for n, p in net.named_parameters())
    bn = next(n for n in _profile(model)[1].nodes if n.target.endswith("bn1"))
    assert bn.stateful  # BatchNorm in training mode updates its running statistics


def test_meta_model_implies_estimate() -> None:
    if "hf-llama" not in zoo.names():
        pytest.skip("transformers is not installed")
    model = zoo.get("hf-llama", device="meta", seq_len=32)
    gm = profiles.capture(model.model, model.example_inputs)
    prof = profiles.profile(gm, model.example_inputs, progress=False)
    assert prof.timing == "estimate" and prof.saved_activation_bytes() > 0
    with pytest.raises(ValueError, match="meta"):
        profiles.profile(gm, model.example_inputs, timing="measure", progress=False)


def test_optimizer_state_is_counted_exactly() -> None:
    model = zoo.get("mlp", width=32, depth=2)
    optimizer = torch.optim.AdamW(model.model.parameters(), lr=1e-3)
    _, prof = _profile(model, optimizer=optimizer)
    assert not optimizer.state  # the user's optimizer did not step
    loss = model.loss_fn(model.model(*model.example_inputs))
    loss.backward()
    optimizer.step()
    real = sum(t.untyped_storage().nbytes() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))
    assert prof.static.optimizer_state_bytes == real > 2 * prof.static.param_bytes - 1


def test_missing_loss_asks_for_loss_fn() -> None:
    model = zoo.get("mlp")
    gm = profiles.capture(model.model, model.example_inputs)  # no loss_fn given
    with pytest.raises(ValueError, match="loss_fn"):
        profiles.profile(gm, model.example_inputs, progress=False)


def test_corrupt_profile_json_names_the_field() -> None:
    _, prof = _profile(zoo.get("mlp", depth=1))
    data = prof.model_dump()
    data["nodes"][3]["fwd_time_ms"] = "fast"
    with pytest.raises(pydantic.ValidationError, match="fwd_time_ms"):
        profiles.GraphProfile.model_validate(data)
    data = prof.model_dump()
    data["nodes"][2]["saved_storages"] = [10_000]
    with pytest.raises(pydantic.ValidationError, match="storage 10000"):
        profiles.GraphProfile.model_validate(data)
    with pytest.raises(pydantic.ValidationError, match="schema_version"):
        profiles.GraphProfile.model_validate({**prof.model_dump(), "schema_version": 99})
    with pytest.raises(pydantic.ValidationError):
        profiles.GraphProfile.from_json(prof.to_json()[:-40])
