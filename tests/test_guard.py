"""A planned model runs what was planned, or says why not, at the step where it changes
(planner.runtime.guard and the traced forwards of planner.runtime.emit): every change of the
issue's list either leaves results and memory as planned, or warns naming it; never
silent."""

from __future__ import annotations

import copy
import functools
import gc
import io
import pickle
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import profiles
from planner import PlanMismatchError, PlanMismatchWarning, apply, remove
from planner.api import measure_step, plan_for_schedule, structure_fingerprint
from planner.arguments import _input_specs
from planner.runtime.emit import TracedForward, checkpointed_modules
from planner.runtime.guard import PlanGuard, step_checks
from profiles.inputs import normalize_inputs
from profiles.traced import trace_forward
from solvers import Schedule
from solvers.from_profile import problem_from_profile


class Scaled(nn.Module):
    """A forward that reads a float, a flag and a class attribute: all baked into its trace."""

    power = 1

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.scale = 0.5
        self.gelu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * self.scale
        h = F.gelu(h) if self.gelu else torch.tanh(h)
        return self.b(h ** self.power)


class Dropped(Scaled):
    """A forward that reads ``self.training``: eval() traces to another program."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) * self.scale)
        return self.b(h * 2 if self.training else h)


SHIFT = 0.0  # a global a forward reads: its value is a constant of the trace


class Shifted(Scaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) * self.scale)
        return self.b(h + SHIFT)


class Net(nn.Module):
    def __init__(self, inner: type[Scaled] = Scaled) -> None:
        super().__init__()
        self.inner = inner()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, depth: int = 1, mask: torch.Tensor | None = None,
                mode: str = "a", **metadata: object) -> torch.Tensor:
        h = self.inner(x)
        for _ in range(depth - 1):
            h = self.inner(h)
        return self.head(h if mask is None else h * mask)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _planned(span_name: str = "inner[mul..b]", inner: type[Scaled] = Scaled,
             **inputs: object) -> tuple[Net, tuple, object]:
    """A Net planned to checkpoint one span (an op range of ``inner`` by default)."""
    torch.manual_seed(0)
    model, x = Net(inner), torch.randn(32, 16)
    args, kwargs = normalize_inputs(model, {"x": x, **inputs})
    prof = profiles.profile(model, kwargs, loss_fn=_loss, timing="estimate", progress=False)
    problem = problem_from_profile(prof)
    span = next(s for s in problem.module_spans if s.name == span_name)
    plan = plan_for_schedule(prof, Schedule.from_segments(problem.n_nodes,
                                                         [(span.start, span.stop)]),
                             _input_specs(args, kwargs), structure_fingerprint(model))
    return model, (x,), plan


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    _, loss, grads = measure_step(model, (x,), {}, _loss)
    return loss, grads


def _same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1])


def _unplanned_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    clone = copy.deepcopy(model)
    remove(clone)
    return _step(clone, x)


# ----------------------------------------------------------------------------- traced forwards


@pytest.mark.parametrize(("change", "value"), [("scale", 0.25), ("gelu", True)])
def test_an_attribute_the_trace_read_changed_after_apply_is_traced_again(change: str,
                                                                         value: object) -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    assert isinstance(model.inner.__dict__["forward"], TracedForward)
    setattr(model.inner, change, value)
    with pytest.warns(PlanMismatchWarning, match=f"attribute '{change}' changed"):
        planned = _step(model, x)  # the plan's memory was not counted for the new program
    assert _same(planned, _unplanned_step(model, x))


def test_a_global_the_forward_reads_changed_after_apply_is_traced_again() -> None:
    global SHIFT
    model, (x,), plan = _planned("inner[mul..b]", Shifted)
    apply(model, plan)
    try:
        SHIFT = 1.0
        with pytest.warns(PlanMismatchWarning, match="global 'SHIFT' changed"):
            planned = _step(model, x)
        assert _same(planned, _unplanned_step(model, x))
    finally:
        SHIFT = 0.0


def test_a_class_attribute_changed_is_traced_again_and_not_shared_from_the_cache() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    before = trace_forward(Scaled())
    try:
        Scaled.power = 2
        assert trace_forward(Scaled()) is not before
        with pytest.warns(PlanMismatchWarning, match="class attribute 'power' changed"):
            planned = _step(model, x)
        assert _same(planned, _unplanned_step(model, x))
    finally:
        Scaled.power = 1


def test_a_traced_module_in_eval_during_training_keeps_its_checkpoints() -> None:
    """Its forward does not read ``self.training``: the planned ranges run in eval()."""
    model, (x,), plan = _planned()
    apply(model, plan)
    model.inner.eval()
    traced = model.inner.__dict__["forward"]
    ran = []
    for checkpoint in [*traced.checkpoints.values(), traced.whole]:
        checkpoint.checkpointed = functools.partial(
            lambda c, *a: ran.append(c) or type(c).checkpointed(c, *a), checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = _step(model, x)
    assert _same(planned, _unplanned_step(model, x))
    assert ran and all(c is not traced.whole for c in ran)  # the planned ranges ran


def test_a_traced_module_whose_eval_forward_differs_warns_and_stays_correct() -> None:
    model, (x,), plan = _planned("inner[mul..b]", Dropped)
    apply(model, plan)
    model.inner.eval()
    with pytest.warns(PlanMismatchWarning, match="eval"):
        planned = _step(model, x)
    assert _same(planned, _unplanned_step(model, x))


def test_an_instance_forward_on_a_traced_module_is_honoured() -> None:
    model, (x,), plan = _planned()
    calls = []

    def logged(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return type(model.inner).forward(model.inner, *args)

    model.inner.forward = logged  # a library's hook set before apply
    unplanned = _step(model, x)
    apply(model, plan)
    calls.clear()
    with pytest.warns(PlanMismatchWarning, match="forward set on the instance"):
        planned = _step(model, x)
    assert calls and _same(planned, unplanned)


def test_an_instance_forward_set_after_apply_warns() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    model.inner.forward = lambda h: type(model.inner).forward(model.inner, h)
    with pytest.warns(PlanMismatchWarning, match="replaced by a forward set on the instance"):
        _step(model, x)


def test_a_forward_with_an_instance_forward_offers_no_op_ranges() -> None:
    module = Scaled()
    module.forward = module.forward
    assert "instance-level forward" in trace_forward(module)


# ----------------------------------------------------------------------------- the model


def _quiet_step(model: nn.Module, x: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, x)


def test_a_planned_model_that_did_not_change_does_not_warn() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    _quiet_step(model, x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        _quiet_step(clone, x)


@pytest.mark.parametrize(("change", "named"), [
    (lambda m: m.double(), "float64"),
    (lambda m: setattr(m.inner, "b", nn.Linear(16, 16)), "module replaced: 'inner.b'"),
    (lambda m: setattr(m.inner.a, "adapter", nn.Linear(16, 16)),
     "modules added: 'inner.a.adapter'"),
    (lambda m: m.head.register_buffer("extra", torch.zeros(4096)), "'head.extra' was added"),
])
def test_a_model_changed_after_apply_warns_naming_the_change(change: object, named: str) -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    change(model)
    with pytest.warns(PlanMismatchWarning, match="changed after its plan") as caught:
        model(x.to(next(model.parameters()).dtype)).sum().backward()
    assert any(named in str(w.message) for w in caught), [str(w.message) for w in caught]


def _guard(model: nn.Module) -> PlanGuard:
    return next(h for h in model._forward_pre_hooks.values() if isinstance(h, PlanGuard))


def _retyped_in_place(model: Net) -> None:
    model.head.weight.data = model.head.weight.data.double()  # same Parameter, new dtype


def test_an_eager_plan_whose_modules_are_compiled_after_apply_warns_once() -> None:
    """torchtitan applies its checkpointing policy, then compiles each block in place
    (``block.compile()``): an eager plan's step is then not the one planned, said at the
    first step, once (a model left eager does not warn: above)."""
    model, (x,), plan = _planned()
    apply(model, plan)
    model.head.compile(backend="eager")
    try:
        with pytest.warns(PlanMismatchWarning, match=r"module 'head' compiled \(torch.compile"
                          r"\), and its plan is the eager step's.*compiled='blocks'"):
            _step(model, x)
        _quiet_step(model, x)
    finally:
        torch._dynamo.reset()


def _plain_step(model: nn.Module, as_called: nn.Module, x: torch.Tensor
                ) -> tuple[torch.Tensor, dict]:
    """A step without `measure_step`'s tracker (dynamo does not compile under a dispatch
    mode): ``as_called`` (the model, or what compiles it) called, ``model``'s gradients."""
    loss = _loss(as_called(x))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("whole", ["torch.compile(model)", "model.compile()"])
def test_an_eager_plan_compiled_whole_warns_once_without_a_recompile(whole: str) -> None:
    """The model compiled whole after ``apply`` (its guard's hook is traced, not run): said
    while dynamo traces it, once, with ``fullgraph=True`` as well (no graph break), and the
    saying sets nothing dynamo guards on (no recompile at the next step); the compiled
    step's losses and gradients are the eager plan's."""
    from torch._dynamo.testing import CompileCounter

    model, (x,), plan = _planned()
    apply(model, plan)
    eager = _plain_step(model, model, x)
    counter = CompileCounter()
    compiled = model
    if whole == "model.compile()":
        model.compile(backend=counter, fullgraph=True)
    else:
        compiled = torch.compile(model, backend=counter, fullgraph=True)
    try:
        with pytest.warns(PlanMismatchWarning, match=r"module '<model>' compiled "
                          r"\(torch.compile\), and its plan is the eager step's.*"
                          r"compiled='model'"):
            first = _plain_step(model, compiled, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = _plain_step(model, compiled, x)
        assert counter.frame_count == 1
        assert _same(first, eager) and _same(second, eager)
    finally:
        model._compiled_call_impl = None
        torch._dynamo.reset()


def test_a_strict_eager_plan_compiled_whole_stops_at_its_trace() -> None:
    """``strict``: the compile stops with the guard's error (dynamo wraps it, its message
    kept) before any step runs compiled."""
    model, (x,), plan = _planned()
    apply(model, plan, strict=True)
    try:
        with pytest.raises(Exception, match="its plan is the eager step's") as raised:
            torch.compile(model, backend="eager")(x)
        chain, error = [], raised.value
        while error is not None and len(chain) < 8:
            chain.append(error)
            error = error.__cause__ or error.__context__
        assert any(isinstance(e, PlanMismatchError) for e in chain), chain
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("change", [
    lambda m: m.double(), _retyped_in_place,
    lambda m: setattr(m.inner, "b", nn.Linear(16, 16)),
    lambda m: setattr(m.inner.a, "adapter", nn.Linear(16, 16)),
    lambda m: m.head.register_buffer("extra", torch.zeros(4096)),
    lambda m: setattr(m.head, "bias", None),
    lambda m: setattr(m.head, "weight", nn.Parameter(torch.randn(4, 16))),
    lambda m: delattr(m, "head"),
])
def test_the_guard_cheap_check_sees_every_change_the_named_one_sees(change: object) -> None:
    """Each step compares the model with itself as applied by identity (cheap), and names
    the change only when that fails: the cheap check must never pass a changed model."""
    model, _, plan = _planned()
    apply(model, plan)
    guard = _guard(model)
    assert guard.as_applied.unchanged(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        _guard(clone).check(clone, (), {}, inputs=False)  # a copy's tensors: new ids
        assert _guard(clone).as_applied.unchanged(clone)
    change(model)
    assert not guard.as_applied.unchanged(model)


def test_the_guard_keeps_no_replaced_parameter_alive() -> None:
    """A parameter replaced after apply (FSDP2's sharding replaces every one) is freed; the
    guard, which saw no change (same shape, dtype, device), is as cheap again next step."""
    model, (x,), plan = _planned()
    apply(model, plan)
    weight = weakref.ref(model.head.weight)
    model.head.weight = nn.Parameter(torch.randn(4, 16))
    gc.collect()
    assert weight() is None, "the guard keeps a replaced parameter alive"
    _quiet_step(model, x)
    assert _guard(model).as_applied.unchanged(model)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"depth": 4}, "'depth' where it is 4, planned 1"),
    ({"mask": torch.ones(32, 16)}, "'mask' where it was None when planned"),
    ({"x": torch.randn(32, 16, dtype=torch.float64)}, "float64"),
])
def test_inputs_of_another_value_or_dtype_warn(kwargs: dict, named: str) -> None:
    model, (x,), plan = _planned(depth=1, mask=None)
    apply(model, plan)
    model.double() if "x" in kwargs else None
    with pytest.warns(PlanMismatchWarning) as caught:
        model(**{"x": x, **kwargs}).sum().backward()
    assert any(named in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_strict_raises_on_a_changed_model() -> None:
    model, (x,), plan = _planned()
    apply(model, plan, strict=True)
    model.inner.b = nn.Linear(16, 16)
    with pytest.raises(PlanMismatchError, match="module replaced"):
        model(x)


# ----------------------------------------------------------------------------- apply


def _retargeted(plan: object, **target: str) -> object:
    """``plan`` with its first checkpoint's target edited (as a hand-edited plan file)."""
    region = next(r for r in plan.schedule.regions if r.is_recompute)
    edited = region.model_copy(update={"target": region.target.model_copy(update=target)})
    return plan.model_copy(update={"schedule": plan.schedule.model_copy(update={
        "regions": tuple(edited if r is region else r for r in plan.schedule.regions)})})


def test_a_refused_apply_keeps_the_plan_already_installed() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    installed = checkpointed_modules(model)
    with pytest.raises(PlanMismatchError, match="gone"):
        apply(model, _retargeted(plan, first="gone"))
    assert checkpointed_modules(model) == installed
    _quiet_step(model, x)


def test_an_edited_plan_naming_another_module_is_refused_by_name() -> None:
    model, _, plan = _planned("inner.b")
    with pytest.raises(PlanMismatchError, match="'head'"):
        apply(model, _retargeted(plan, path="head"))
    assert not checkpointed_modules(model)


def test_inputs_not_given_when_planned_warn_when_they_can_change_the_step() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a count or a None cannot (HF Trainer's extras)
        model(x, mask=None).sum().backward()
    with pytest.warns(PlanMismatchWarning, match="'mask' where it was not given"):
        model(x, mask=torch.ones(32, 16)).sum().backward()


def test_a_guard_warning_points_at_the_line_that_called_the_model() -> None:
    model, (x,), plan = _planned()
    apply(model, plan)
    model.double()
    with pytest.warns(PlanMismatchWarning) as caught:
        model(x.double()).sum().backward()
    assert {w.filename for w in caught} == {__file__}


def test_an_input_whose_value_changes_every_step_warns_once() -> None:
    """A value that differs at every step (a depth, a count the user passes) is said once,
    not once per new value."""
    model, (x,), plan = _planned(depth=1)
    apply(model, plan)
    with pytest.warns(PlanMismatchWarning) as caught:
        for depth in (2, 3, 4, 5):
            model.zero_grad(set_to_none=True)
            model(x, depth=depth).sum().backward()
    assert len([w for w in caught if "'depth'" in str(w.message)]) == 1


def test_strings_a_batch_carries_through_kwargs_are_not_guarded() -> None:
    """Metadata (a sample id, a source name) passed on through ``**kwargs`` sets no memory:
    not guarded; a named argument's string still is."""
    model, (x,), plan = _planned(note="first", mode="a")
    apply(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for note in ("second", "third"):
            model.zero_grad(set_to_none=True)
            model(x, note=note, mode="a").sum().backward()
    model.zero_grad(set_to_none=True)
    with pytest.warns(PlanMismatchWarning, match="'mode' where it is 'b'"):
        model(x, note="fourth", mode="b").sum().backward()


def test_step_checks_are_the_guards_checks_that_need_no_plan() -> None:
    """What the region calibration times as a planned step's guard: passes on the model
    as it was, fails where a module was replaced or gradients are allocated."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    checks = step_checks(model)
    assert checks()
    model(torch.randn(2, 4)).sum().backward()
    assert not checks()  # gradients allocated
    model.zero_grad(set_to_none=True)
    assert checks()
    model[1] = torch.nn.Tanh()
    assert not checks()  # a module replaced
