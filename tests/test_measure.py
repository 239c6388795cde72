"""The CPU peak tracker counts what torch's MemTracker counts, without changing the step."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import profiles
from planner import zoo
from planner.measure import PeakTracker
from profiles.inputs import normalize_inputs


def _memtracker_peak(model: zoo.ZooModel) -> int:
    args, kwargs = normalize_inputs(model.model, model.example_inputs)
    tracker = MemTracker()
    tracker.track_external(model.model, *[t for t in [*args, *kwargs.values()]
                                          if isinstance(t, torch.Tensor)])
    with tracker:
        (model.loss_fn or profiles.default_loss)(model.model(*args, **kwargs)).backward()
    model.model.zero_grad(set_to_none=True)
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())


def _tracker_peak(model: zoo.ZooModel) -> tuple[int, int]:
    args, kwargs = normalize_inputs(model.model, model.example_inputs)
    static = [*model.model.parameters(), *model.model.buffers(),
              *[t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]]
    with PeakTracker(static) as tracker:
        (model.loss_fn or profiles.default_loss)(model.model(*args, **kwargs)).backward()
    model.model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, tracker.static_bytes


@pytest.mark.parametrize("name", ["resnet", "gpt", "hf-llama"])
def test_peak_tracker_agrees_with_memtracker(name: str) -> None:
    """Models whose modules take one tensor each (MemTracker's hooks hold nothing there).
    The tracker also counts loss targets from the start; MemTracker only once an op makes
    a view of them (GPT flattens its targets), else never (ResNet's 4 int64 labels)."""
    model = zoo.get(name, batch=4) if name != "gpt" else zoo.get(name, size="tiny", batch=4)
    peak, _ = _tracker_peak(model)
    untracked_targets = 4 * 8 if name == "resnet" else 0
    assert peak - untracked_targets == _memtracker_peak(model)


def test_frozen_parameters_and_two_input_modules() -> None:
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) * self.b(y)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.join = torch.nn.Linear(64, 64), TwoInputs()
            self.pre.weight.requires_grad_(False)  # frozen, as PEFT leaves base weights

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.pre(x)
            return self.join(torch.relu(h), torch.sigmoid(h)).sum()

    model = zoo.ZooModel("net", Net(), (torch.randn(512, 64, requires_grad=True),), None)
    peak, static = _tracker_peak(model)
    assert peak > static
    with pytest.raises(RuntimeError, match="hook"):  # what MemTracker does with it
        _memtracker_peak(model)


def test_a_gpu_step_counts_only_its_own_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, ``max_memory_allocated`` counts everything the process holds: a reference
    model's gradients or a clone of the weights kept by a benchmark are no part of the step
    (the first GPU run read 4 GiB of them as the plan's). A fake allocator holding 3 GiB
    of bystanders and reaching them plus 1 GiB in the step: the step's peak is 1 GiB."""
    from planner import verification

    gib = 2**30
    fake = dict(memory_allocated=lambda device=None: 3 * gib,
                max_memory_allocated=lambda device=None: 4 * gib,
                synchronize=lambda device=None: None,
                reset_peak_memory_stats=lambda device=None: None)
    for name, function in fake.items():
        monkeypatch.setattr(torch.cuda, name, function)
    monkeypatch.setattr(verification, "_model_device", lambda module: torch.device("cuda"))
    model = torch.nn.Linear(4, 4)
    peak, _, grads = verification.measure_step(model, (torch.randn(2, 4),), {},
                                               lambda out: out.sum())
    assert peak == 1 * gib
    assert set(grads) == {"weight", "bias"}


def test_a_bystander_that_dies_during_the_step_is_no_part_of_its_peak() -> None:
    """With ``follow_resizes`` every tensor alive when the step begins is counted, and those
    the step never touches are taken off again. One that dies half-way (a cache emptied, a
    collective's buffer freed by its worker thread) was counted while it lived: taking off
    only the bystanders still alive at the end read all 4 MiB of it as the step's."""
    from planner.measure import PeakTracker

    held = {"cache": torch.zeros(1 << 20)}  # 4 MiB no op of the step reads

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            held.clear()  # the bystander dies between the two layers
            return self.b(torch.relu(h)).sum()

    def peak(net: torch.nn.Module, x: torch.Tensor) -> int:
        with PeakTracker([*net.parameters(), x], follow_resizes=True) as tracker:
            net(x).backward()
        return tracker.own_peak_bytes

    torch.manual_seed(0)
    net, x = Net(), torch.randn(256, 64)
    with_bystander = peak(net, x)
    net.zero_grad(set_to_none=True)
    assert peak(net, x) == with_bystander  # nothing held: the same step, the same peak


def test_a_storage_freed_on_another_thread_reads_as_zero_bytes() -> None:
    """A collective's worker thread can drop a storage's last reference between the
    tracker's check that it lives and its read of the size: the read says 0 bytes, it does
    not fail (a 2 x 2 gloo rank crashed once in 30 runs on exactly this)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from profiles.parallel import storage_nbytes

    tensor = torch.zeros(10)
    ref = StorageWeakRef(tensor.untyped_storage())
    assert storage_nbytes(ref) == 40
    del tensor
    assert storage_nbytes(ref) == 0


def test_live_bytes_drops_as_soon_as_the_last_tensor_dies() -> None:
    """What a step leaves alive, read after its last op: a tensor let go since (``del`` of
    what a backward kept) no longer counts, though no op has run to notice its death."""
    static = torch.ones(256)
    with PeakTracker([static]) as tracker:
        made = static * 2  # 1 KiB, the step's last op
        assert tracker.live_bytes == 2 * 1024
        del made
        assert tracker.live_bytes == 1024
    assert tracker.peak_bytes == 2 * 1024


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_loss_target_counts_on_the_gpu_as_the_cpu_tracker_counts_it(name: str) -> None:
    """On a GPU ``measure_step`` counts the tensors the loss function is bound to (its
    target) as the step's, since the allocator cannot see what the step reads; they must be
    exactly what the CPU's tracker finds the step reading from before it."""
    from planner.verification import bound_tensors

    model = zoo.get(name, **({"size": "tiny"} if name == "gpt" else {}))
    args, kwargs = normalize_inputs(model.model, model.example_inputs)
    bound = bound_tensors(model.loss_fn)
    assert [t.dtype for t in bound] == [torch.int64]  # the target, and nothing else
    static = [*model.model.parameters(), *model.model.buffers(), *args]
    peaks = []
    for extra in ([], bound):
        with PeakTracker([*static, *extra]) as tracker:
            model.loss_fn(model.model(*args, **kwargs)).backward()
        model.model.zero_grad(set_to_none=True)
        peaks.append(tracker.peak_bytes)
    assert peaks[0] == peaks[1]


def test_bound_tensors_finds_partials_closures_and_defaults() -> None:
    import functools

    from planner.verification import bound_tensors

    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)

    def loss(out: torch.Tensor, weight: torch.Tensor = c) -> torch.Tensor:
        return (out * weight).sum() + b.sum()

    found = bound_tensors(functools.partial(loss, weight=a))
    assert {id(t) for t in found} == {id(a), id(b), id(c)}
    assert bound_tensors(lambda out: out.sum()) == []
    weighted = torch.nn.CrossEntropyLoss(weight=c)
    assert [id(t) for t in bound_tensors(weighted)] == [id(weighted.weight)]


def test_a_functional_collectives_wrapper_allocates_nothing() -> None:
    """Tensor parallel's collectives return an AsyncCollectiveTensor around their result:
    the wrapper's storage is no allocation (it counted once more, 32-64 KiB under TP)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    with PeakTracker([]) as tracker:
        result = torch.ones(1024) * 2  # what the collective made: 4 KiB
        wrapped = AsyncCollectiveTensor(result)
        out = wrapped + 1  # 4 KiB more
        del result, wrapped, out
    assert tracker.peak_bytes == 8192 and tracker.static_bytes == 0


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf-llama"])
def test_the_allocators_events_count_what_the_tracker_counts_on_an_eager_step(
        name: str) -> None:
    """`allocator_peak` (the CPU allocator's events, as the profiler records them) and
    `PeakTracker` (the storages ops return) measure an eager step alike: within a few
    scalars (the engine makes some below the dispatcher: 32 bytes on GPT). Where a kernel
    allocates a workspace of its own the allocator sees more (ResNet's convolution
    backward: +0.28 MB over 9.07)."""
    from planner.measure import allocator_peak

    model = zoo.get(name)
    _tracker_peak(model)  # warm: lazy initialisations happen once, outside the measures
    held: dict[str, tuple[int, int]] = {}
    measured = allocator_peak(lambda: held.setdefault("tracker", _tracker_peak(model)))
    peak, static = held["tracker"]
    assert measured.events > 0 and 0 <= measured.peak_bytes - (peak - static) <= 64


def test_a_block_an_earlier_measure_saw_freed_during_this_one_does_not_lower_it() -> None:
    """The profiler reports the free of every block whose size it recorded, in an earlier
    profiled call too: a tensor the first measure saw made, freed in the second (garbage
    collected, a cache replaced), must not cancel what the second allocates."""
    from planner.measure import allocator_peak

    kept = {}
    allocator_peak(lambda: kept.setdefault("earlier", torch.empty(1 << 20)))

    def frees_the_earlier_then_allocates() -> float:
        del kept["earlier"]
        return float(torch.ones(1 << 20).sum())

    measured = allocator_peak(frees_the_earlier_then_allocates)
    assert measured.peak_bytes >= 4 << 20 and measured.end_bytes == 0


def test_the_allocators_events_see_what_compiled_code_allocates() -> None:
    """Inductor's generated C++ allocates its buffers below the dispatcher (and under a
    dispatch mode such as the tracker dynamo runs the frame eagerly instead): the
    allocator's events see them, here the matmul's (64, 256) float buffer that the fused
    relu and sum read."""
    from planner.measure import allocator_peak

    weight = torch.randn(256, 256)
    compiled = torch.compile(lambda x: (x @ weight).relu().sum(dim=1), backend="inductor")
    x = torch.randn(64, 256)
    compiled(x)  # compiles
    measured = allocator_peak(lambda: compiled(x))
    assert measured.peak_bytes >= 64 * 256 * 4 and measured.end_bytes <= 64 * 4
