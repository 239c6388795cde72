"""Memory/time frontier: our plans against how people checkpoint today, in one process.

For each model, every strategy is applied to the same model and inputs, and each run's peak
memory (MemTracker on CPU, the CUDA allocator on GPU), median step time and gradients are
measured. Our plans are made at budgets equal to each peer's measured peak.

    python benchmarks/frontier.py                 # CPU mode (<= 10 min on 2 cores)
    python benchmarks/frontier.py --device cuda   # GPT-2-medium 24x1024, batch 8x1024, fp32
    python benchmarks/frontier.py --quick         # smallest sizes, for the smoke test

Writes benchmarks/results/frontier-<device>.{json,md,png} (``--out`` to change the folder).
Every number written is measured in that run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import planner
from planner import zoo
from planner.api import _input_specs, measure_step, plan_for_profile
from planner.plan import InfeasibleBudgetError
from profiles.tracing import normalize_inputs

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("none", "every-layer", "every-2nd", "every-4th", "chen-sqrt-n", "sac-matmuls",
         "auto-sac-milp", "rockmate")
QUICK_PEERS = ("none", "every-layer", "sac-matmuls", "auto-sac-milp", "rockmate")


# --------------------------------------------------------------------------- models


def cases(device: str, quick: bool) -> list[tuple[str, dict[str, Any]]]:
    hf = zoo.has_transformers()
    if quick:
        return [("gpt", dict(size="tiny", batch=4, device=device))]
    if device == "cuda":
        out = [("gpt", dict(size="gpt2-medium", batch=8, device=device))]
        if hf:
            out += [("hf-llama", dict(size="tiny", batch=8, seq_len=1024, device=device,
                                      hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=16, num_attention_heads=16,
                                      num_key_value_heads=16, vocab_size=32000))]
        out.append(("resnet", dict(batch=256, device=device)))
        if hf:
            out.append(("hf-gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                        batch=8, seq_len=1024, device=device)))
        return out
    # CPU: batches where activations dominate memory, small enough for 2 cores
    out = [("gpt", dict(size="small", batch=4, device=device))]
    if hf:
        out.append(("hf-llama", dict(size="tiny", batch=4, seq_len=128, device=device,
                                     num_hidden_layers=4)))
    out.append(("resnet", dict(batch=16, device=device)))
    if hf:
        out.append(("hf-gpt2", dict(n_layer=4, batch=4, seq_len=128, device=device)))
    return out


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def default_loss(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output


# --------------------------------------------------------------------------- peers

MATMUL_OPS = frozenset(
    op for op in (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        *(getattr(torch.ops.aten, name).default for name in (
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        ) if hasattr(torch.ops.aten, name)),
    )
)


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's "op" SAC: keep matmul and attention outputs, recompute the rest."""
    return (CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def sac_context() -> Any:
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, prefix: str, segments: list[list[int]],
                        context_fn: Callable[[], Any] | None = None) -> Iterator[None]:
    """Run each segment of the blocks at ``prefix`` under one non-reentrant checkpoint.

    The blocks' ``forward`` is patched on the instances (no wrapper modules), so parameter
    names, hooks and ``state_dict()`` stay the model's own; restored on exit.
    """
    blocks = model.get_submodule(prefix)
    originals = {i: blocks[i].forward for s in segments for i in s}
    last_output: dict[str, Any] = {}

    def segment_forward(members: list[int], *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            out = originals[members[0]](*a, **kw)
            for i in members[1:]:
                out = originals[i](_first(out), *a[1:], **kw)
            return out

        extra = {"context_fn": context_fn} if context_fn is not None else {}
        out = checkpoint(run, *args, use_reentrant=False, **extra, **kwargs)
        last_output["out"] = out
        return out

    def passthrough(*args: Any, **kwargs: Any) -> Any:
        out = last_output["out"]  # the segment already ran this block
        return (args[0], *out[1:]) if isinstance(out, tuple) else args[0]

    try:
        for members in segments:
            blocks[members[0]].forward = functools.partial(segment_forward, members)
            for i in members[1:]:
                blocks[i].forward = passthrough
        yield
    finally:
        for i in originals:
            del blocks[i].forward


@contextlib.contextmanager
def hf_every_layer(model: nn.Module) -> Iterator[None]:
    with warnings.catch_warnings():  # transformers 5 renames these; the old names still work
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()


def peer_context(name: str, zm: zoo.ZooModel) -> contextlib.AbstractContextManager:
    """The context under which ``zm.model`` runs with peer strategy ``name``."""
    n = len(zm.model.get_submodule(zm.block_prefix))
    if name == "none":
        return contextlib.nullcontext()
    if name == "every-layer":
        if hasattr(zm.model, "gradient_checkpointing_enable"):
            return hf_every_layer(zm.model)
        return checkpointed_blocks(zm.model, zm.block_prefix, [[i] for i in range(n)])
    if name in ("every-2nd", "every-4th"):
        step = 2 if name == "every-2nd" else 4
        return checkpointed_blocks(zm.model, zm.block_prefix,
                                   [[i] for i in range(step - 1, n, step)])
    if name == "chen-sqrt-n":
        size = max(1, round(math.sqrt(n)))
        return checkpointed_blocks(zm.model, zm.block_prefix,
                                   [list(range(i, min(i + size, n))) for i in range(0, n, size)])
    if name == "sac-matmuls":
        return checkpointed_blocks(zm.model, zm.block_prefix, [[i] for i in range(n)],
                                   context_fn=sac_context)
    raise KeyError(name)


def peer_not_run(name: str, device: str) -> str | None:
    """Why peer ``name`` cannot run here, or None."""
    if name == "rockmate":
        if device != "cuda":
            return "not run: no GPU (Rockmate is GPU only)"
        try:
            import rockmate  # noqa: F401
        except ImportError as error:
            return f"not run: rockmate not installed ({error})"
        return "not run: Rockmate adapter not written for this torch version"
    if name == "auto-sac-milp":
        try:
            from torch.distributed._tools import sac_ilp  # noqa: F401
        except ImportError as error:
            if "pulp" in str(error):
                return "not run: torch's sac_ilp needs pulp, which is not installed"
            return f"not run: torch.distributed._tools.sac_ilp does not import ({error})"
        return None
    return None


# --------------------------------------------------------------------------- measuring


class Runner:
    """Measures one callable module on fixed inputs: peak, gradients, median step time."""

    def __init__(self, zm: zoo.ZooModel, device: str, steps: int):
        self.zm, self.device, self.steps = zm, device, steps
        self.args, self.kwargs = split_inputs(zm.example_inputs)
        self.loss_fn = zm.loss_fn or default_loss
        self.state = {k: v.detach().clone() for k, v in zm.model.state_dict().items()}
        self.names = {p: n for n, p in zm.model.named_parameters()}

    def _reset(self) -> None:
        self.zm.model.load_state_dict(self.state)
        torch.manual_seed(1234)
        if self.device == "cuda":
            torch.cuda.manual_seed_all(1234)

    def _peak_and_grads(self, module: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
        self._reset()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        # measure_step names gradients by module.named_parameters(): map to the model's names
        by_name = dict(module.named_parameters())
        peak, _, grads = measure_step(module, self.args, self.kwargs, self.loss_fn)
        return peak, {self.names[by_name[k]]: g for k, g in grads.items()}

    def _step_ms(self, module: nn.Module, context: Callable[[], Any]) -> float:
        with context():
            if self.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            self.loss_fn(module(*self.args, **self.kwargs)).backward()
            if self.device == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - begin) * 1e3
        module.zero_grad(set_to_none=True)
        return elapsed

    def paired_ms(self, module: nn.Module, context: Callable[[], Any]) -> tuple[float, float]:
        """Median step ms of ``module`` under ``context`` and of the model without
        checkpointing, their steps interleaved (after 2 warm-up steps each), so load from
        other processes hits both alike."""
        plain = contextlib.nullcontext
        samples: tuple[list[float], list[float]] = ([], [])
        for i in range(self.steps + 2):
            base = self._step_ms(self.zm.model, plain)
            ms = self._step_ms(module, context)
            if i >= 2:
                samples[0].append(ms)
                samples[1].append(base)
        self._reset()
        return statistics.median(samples[0]), statistics.median(samples[1])

    def run(self, module: nn.Module, context: Callable[[], Any] = contextlib.nullcontext
            ) -> tuple[int, float, float, dict[str, torch.Tensor]]:
        """Peak bytes, median step ms, median no-checkpointing step ms, gradients."""
        with context():
            peak, grads = self._peak_and_grads(module)
        ms, base = self.paired_ms(module, context)
        return peak, ms, base, grads


def grads_match(reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
                ) -> tuple[bool, float]:
    """Bit-identical, and the largest absolute difference."""
    if reference.keys() != grads.keys():
        return False, math.inf
    diff = max((float((reference[k] - grads[k]).abs().max()) for k in reference), default=0.0)
    return all(torch.equal(reference[k], grads[k]) for k in reference), diff


def bench_model(name: str, kwargs: dict[str, Any], device: str, steps: int, quick: bool,
                timing: str) -> list[dict[str, Any]]:
    zm = zoo.get(name, **kwargs)
    runner = Runner(zm, device, steps)
    rows: list[dict[str, Any]] = []
    short = {"batch": "b", "seq_len": "seq", "num_hidden_layers": "L", "n_layer": "L"}
    model_label = f"{zm.name} " + " ".join(f"{short.get(k, k)}{v}" for k, v in kwargs.items()
                                           if k not in ("device", "size"))
    reference: dict[str, torch.Tensor] = {}

    def row(strategy: str, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"model": model_label, "strategy": strategy, "kind": kind, **fields}
        if "step_ms" in out:
            out["overhead"] = out["step_ms"] / out["base_step_ms"] - 1.0
        rows.append(out)
        print(format_row(out), flush=True)
        return out

    for peer in QUICK_PEERS if quick else PEERS:
        reason = peer_not_run(peer, device)
        if peer == "auto-sac-milp" and reason is None:
            reason = "not run: sac_ilp imported, but no adapter to apply its per-module " \
                     "decisions is written yet"
        if reason:
            row(peer, "peer", status=reason)
            continue
        try:
            peak, ms, base, grads = runner.run(zm.model, functools.partial(peer_context, peer, zm))
        except Exception as error:  # a peer failing is a result to record
            row(peer, "peer", status=f"failed: {type(error).__name__}: {error}"[:300])
            continue
        if peer == "none":
            reference = grads
        equal, diff = grads_match(reference, grads)
        row(peer, "peer", status="ok", peak_bytes=peak, step_ms=ms, base_step_ms=base,
            grads_equal=equal,
            grad_max_abs_diff=diff)

    # our plans, one per distinct peer peak: the first via optimize() (capture + profile +
    # solve, timed), the others reuse its profile (plan_for_profile, timed)
    budgets: list[tuple[int, list[str]]] = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        for b in budgets:
            if abs(b[0] - r["peak_bytes"]) <= 0.005 * b[0]:
                b[1].append(r["strategy"])
                break
        else:
            budgets.append((r["peak_bytes"], [r["strategy"]]))
    budgets.sort()
    profile = None
    args, kw = normalize_inputs(zm.model, zm.example_inputs)
    for budget, peers in budgets:
        label = f"ours @ {'/'.join(peers)}"
        began = time.perf_counter()
        try:
            if profile is None:
                plan = planner.optimize(zm.model, zm.example_inputs, budget_gb=budget / GIB,
                                        loss_fn=zm.loss_fn, timing=timing, progress=False)
                profile = plan.profile
                how = f"optimize(timing={timing!r})"
            else:
                plan = plan_for_profile(profile, budget, _input_specs(args, kw))
                how = "plan_for_profile (profile reused)"
        except InfeasibleBudgetError as error:
            row(label, "ours", status=f"infeasible: {error.args[0][:200]}", budget_bytes=budget)
            continue
        planning_s = time.perf_counter() - began
        module = planner.apply(zm.model, plan)
        peak, ms, base, grads = runner.run(module)
        equal, diff = grads_match(reference, grads)
        row(label, "ours", status="ok", budget_bytes=budget, peak_bytes=peak, step_ms=ms,
            base_step_ms=base,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            peak_error=(plan.predicted_peak_bytes - peak) / peak,
            within_budget=peak <= budget, planning_s=planning_s, planning_how=how,
            solver=plan.solver.name, solver_status=plan.solver.status,
            grads_equal=equal, grad_max_abs_diff=diff)
    return rows


# --------------------------------------------------------------------------- output


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f} %"


def format_row(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"  {r['model']:<24} {r['strategy']:<28} {r['status']}"
    return (f"  {r['model']:<24} {r['strategy']:<28} peak {r['peak_bytes'] / GIB:8.4f} GiB  "
            f"step {r['step_ms']:8.1f} ms  {_pct(r.get('overhead')):>9}  "
            f"grads {'equal' if r['grads_equal'] else 'DIFFER'}")


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Frontier on {result['device_name']} (torch {result['torch']}, "
             f"{result['date']}, {result['mode']} mode, {result['steps']} timed steps)", "",
             "| model | strategy | peak GiB | step ms | no-ckpt ms | overhead | budget GiB "
             "| within | predicted GiB | pred. error | planning s | grads equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status") != "ok":
            budget = f"{r['budget_bytes'] / GIB:.4f}" if "budget_bytes" in r else ""
            status = r["status"] if len(r["status"]) < 120 else r["status"][:117] + "..."
            lines.append(f"| {r['model']} | {r['strategy']} | {status} | | | | {budget} "
                         "| | | | | |")
            continue
        ours = r["kind"] == "ours"
        grads = "yes" if r["grads_equal"] else f"no (max diff {r['grad_max_abs_diff']:.2e})"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['peak_bytes'] / GIB:.4f} | "
            f"{r['step_ms']:.1f} | {r['base_step_ms']:.1f} | {_pct(r.get('overhead'))} | "
            + (f"{r['budget_bytes'] / GIB:.4f} | {'yes' if r['within_budget'] else 'NO'} | "
               f"{r['predicted_peak_bytes'] / GIB:.4f} | {_pct(r['peak_error'])} | "
               f"{r['planning_s']:.1f} | " if ours else "| | | | | ")
            + grads + " |")
    lines += ["", f"Wall time of the whole run: {result['wall_s']:.0f} s. "
              "Overhead: median step time over that of the model without checkpointing, their "
              "steps interleaved in the same loop. Planning s: the first "
              "plan per model is `planner.optimize` (capture, profile, solve); later ones "
              "reuse that profile (`plan_for_profile`)."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    cols = min(2, len(models))
    nrows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 5.2 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        ok = [r for r in result["rows"] if r["model"] == model and r.get("status") == "ok"]
        peers = [r for r in ok if r["kind"] == "peer"]
        ours = sorted((r for r in ok if r["kind"] == "ours"), key=lambda r: r["peak_bytes"])
        for r in peers:
            x, y = r["peak_bytes"] / GIB, 100 * r.get("overhead", 0.0)
            ax.scatter(x, y, s=60, marker="s", zorder=3)
            ax.annotate(r["strategy"], (x, y), textcoords="offset points", xytext=(6, 6),
                        fontsize=9)
        if ours:
            ax.plot([r["peak_bytes"] / GIB for r in ours],
                    [100 * r.get("overhead", 0.0) for r in ours], "o-", color="black",
                    lw=2, label="our plans (budget = a peer's peak)", zorder=4)
            ax.legend(loc="best", fontsize=9)
        ax.margins(x=0.1, y=0.18)  # room for the labels
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(model, fontsize=11)
        ax.set_xlabel("measured peak (GiB)")
        ax.set_ylabel("step-time overhead vs no checkpointing (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    fig.suptitle(f"Memory/time frontier: {result['device_name']}, torch {result['torch']}, "
                 f"{result['date']}", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smallest sizes, 2 timed steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (7; --quick 2)")
    parser.add_argument("--timing", default="measure", choices=["measure", "estimate"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models", nargs="*", default=None, help="zoo names to keep")
    opts = parser.parse_args(argv)
    steps = opts.steps or (2 if opts.quick else 7)
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    started = time.perf_counter()
    device_name = (torch.cuda.get_device_name() if opts.device == "cuda"
                   else f"CPU {platform.processor() or platform.machine()}, "
                        f"{torch.get_num_threads()} threads")
    rows: list[dict[str, Any]] = []
    for name, kwargs in cases(opts.device, opts.quick):
        if opts.models and name not in opts.models:
            continue
        print(f"== {name} {kwargs}", flush=True)
        rows += bench_model(name, kwargs, opts.device, steps, opts.quick, opts.timing)
    result = {
        "torch": torch.__version__, "device": opts.device, "device_name": device_name,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if opts.quick else "full", "steps": steps, "timing": opts.timing,
        "python": platform.python_version(), "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    stem = f"frontier-{opts.device}" + ("-quick" if opts.quick else "")
    (opts.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    table = markdown(result)
    (opts.out / f"{stem}.md").write_text(table)
    plot(result, opts.out / f"{stem}.png")
    print()
    print(table)
    print(f"wrote {opts.out / stem}.{{json,md,png}}")
    return result


if __name__ == "__main__":
    main()
