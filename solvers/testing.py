"""Synthetic problems for tests and benchmarks (numpy only, no torch).

`transformer` builds a GPT-like chain of identical blocks, `dense_block` a DenseNet block
(each layer concatenates every earlier feature), `random_dag` a DAG that is not a chain of
blocks; all are plain `Problem`s with the profiler's conventions (views alias
their base storage, a node that saves only its inputs packs before running).
"""

from __future__ import annotations

import numpy as np

from solvers.problem import Problem

__all__ = ["MiB", "dense_block", "random_dag", "transformer"]

MiB = 2**20

# one transformer block: (name, op kind, out MiB, fwd ms, saves inputs, saves output, inputs)
# inputs are relative indices inside the block (-1 = previous block's output)
_BLOCK = [
    ("ln1", "layer_norm", 8, 0.05, True, False, [-1]),
    ("q", "linear", 8, 0.30, True, False, [0]),
    ("k", "linear", 8, 0.30, True, False, [0]),
    ("v", "linear", 8, 0.30, True, False, [0]),
    ("qv", "view", 0, 0.00, False, False, [1]),
    ("kv", "view", 0, 0.00, False, False, [2]),
    ("scores", "bmm", 32, 0.20, True, False, [4, 5]),
    ("softmax", "softmax", 32, 0.10, False, True, [6]),
    ("drop_att", "dropout", 40, 0.05, True, False, [7]),
    ("ctx", "bmm", 8, 0.20, True, False, [8, 3]),
    ("proj", "linear", 8, 0.30, True, False, [9]),
    ("drop1", "dropout", 10, 0.02, True, False, [10]),
    ("res1", "add", 8, 0.02, False, False, [-1, 11]),
    ("ln2", "layer_norm", 8, 0.05, True, False, [12]),
    ("fc1", "linear", 32, 1.20, True, False, [13]),
    ("gelu", "gelu", 32, 0.10, True, False, [14]),
    ("fc2", "linear", 8, 1.20, True, False, [15]),
    ("drop2", "dropout", 10, 0.02, True, False, [16]),
    ("res2", "add", 8, 0.02, False, False, [12, 17]),
]


def transformer(n_blocks: int, width: int = 2, seed: int = 0, rotary: bool = False) -> Problem:
    """A GPT-like chain: `width` copies of each block op per block (~19 * width nodes).
    `rotary`: as in Llama, every block's q and k also read (and save) one table made before
    the first block."""
    del seed  # blocks are identical, as in a real transformer
    names, kinds, out_b, fwd, saves_in, saves_out, ins, block = [], [], [], [], [], [], [], []

    def add(name, kind, mib, ms, si, so, inputs, b):
        names.append(name)
        kinds.append(kind)
        out_b.append(int(mib * MiB))
        fwd.append(ms)
        saves_in.append(si)
        saves_out.append(so)
        ins.append(inputs)
        block.append(b)
        return len(names) - 1

    table = add("rope", "cos", 1, 0.01, False, False, [], -1) if rotary else None
    prev = add("embed", "embedding", 8, 0.1, False, False, [], -1)
    prev = add("pos", "add", 8, 0.02, False, False, [prev], -1)
    for b in range(n_blocks):
        for w in range(width):
            local: list[int] = []
            for name, kind, mib, ms, si, so, rel in _BLOCK:
                inputs = [prev if r < 0 else local[r] for r in rel]
                if table is not None and name in ("q", "k"):
                    inputs.append(table)
                local.append(add(f"b{b}.{w}.{name}", kind, mib / width, ms / width, si, so,
                                 inputs, b))
            prev = local[-1]
    prev = add("ln_f", "layer_norm", 8, 0.05, True, False, [prev], -1)
    prev = add("lm_head", "linear", 200, 3.0, True, False, [prev], -1)
    add("loss", "cross_entropy", 0, 0.5, True, False, [prev], -1)
    return _build(names, kinds, out_b, fwd, saves_in, saves_out, ins, block, "transformer")


def dense_block(layers: int, feature_mib: float = 4) -> Problem:
    """A DenseNet block after a stem: layer k concatenates the stem's and every earlier
    layer's feature (the concatenation saves none of them, so after the forward only a
    region rerunning a later concatenation holds one, as its input), then batch norm, ReLU
    and a convolution making its own feature; a head reads the last. One block per layer."""
    names, kinds, out_b, fwd, saves_in, ins, block = [], [], [], [], [], [], []

    def add(name: str, kind: str, mib: float, ms: float, saves: bool, inputs: list[int],
            b: int) -> int:
        for items, value in ((names, name), (kinds, kind), (out_b, int(mib * MiB)),
                             (fwd, ms), (saves_in, saves), (ins, inputs), (block, b)):
            items.append(value)
        return len(names) - 1

    features = [add("stem", "convolution", feature_mib, 0.5, False, [], -1)]
    for k in range(layers):
        width = feature_mib * len(features)
        cat = add(f"l{k}.cat", "cat", width, 0.05, False, list(features), k)
        norm = add(f"l{k}.norm", "batch_norm", width, 0.2, True, [cat], k)
        relu = add(f"l{k}.relu", "relu", width, 0.1, False, [norm], k)
        features.append(add(f"l{k}.conv", "convolution", feature_mib, 1.0, True, [relu], k))
    add("head", "mean", 0.001, 0.01, True, [features[-1]], -1)
    return _build(names, kinds, out_b, fwd, saves_in, [False] * len(names), ins, block,
                  "dense_block")


def random_dag(n: int, seed: int = 0, skip: float = 0.05) -> Problem:
    """A random DAG: a main path with local fan-in and occasional long skips."""
    rng = np.random.default_rng(seed)
    ins = [[]]
    for i in range(1, n):
        inputs = [i - 1]
        if i > 2 and rng.random() < 0.3:
            inputs.append(int(rng.integers(max(0, i - 8), i - 1)))
        if i > 10 and rng.random() < skip:
            inputs.append(int(rng.integers(0, i - 1)))
        ins.append(sorted(set(inputs)))
    out_b = [int(x) for x in rng.integers(1, 64, n) * MiB]
    out_b[-1] = 4
    fwd = [float(x) for x in rng.uniform(0.05, 1.0, n)]
    kinds = [str(k) for k in rng.choice(["linear", "relu", "add", "bmm"], n)]
    saves_in = [bool(x) for x in rng.random(n) < 0.8]
    return _build([f"v{i}" for i in range(n)], kinds, out_b, fwd, saves_in, [False] * n, ins,
                  [-1] * n, "random_dag")


def _build(names, kinds, out_b, fwd, saves_in, saves_out, ins, block, name) -> Problem:
    """Nodes of kind "view" alias their input's storage (as torch views do): no storage of
    their own, and readers of the view read (and saves of it hold) the base storage.
    Nodes saving only inputs pack before running (a rerun stopping there skips them)."""
    n = len(names)
    storage_of: list[int] = []
    producer: list[int] = []
    sizes: list[int] = []
    for i in range(n):
        if kinds[i] == "view" and len(ins[i]) == 1:
            storage_of.append(storage_of[ins[i][0]])
        else:
            storage_of.append(len(producer))
            producer.append(i)
            sizes.append(out_b[i])
    node_in = [sorted({storage_of[j] for j in ins[i]}) for i in range(n)]
    node_out = [[storage_of[i]] if producer[storage_of[i]] == i else [] for i in range(n)]
    saved = [sorted(set((node_in[i] if saves_in[i] else []) + (node_out[i] if saves_out[i]
                                                                  else [])))
             for i in range(n)]
    return Problem(
        name=name, node_names=names, fwd_time_ms=fwd, bwd_time_ms=[2 * t for t in fwd],
        fwd_temp_bytes=[0] * n, bwd_temp_bytes=[0] * n, recomputable=[True] * n,
        node_inputs=node_in, node_outputs=node_out, node_saved=saved,
        storage_bytes=sizes, storage_producer=producer, storage_grad_bytes=sizes,
        static_bytes=1024 * MiB, param_grad_bytes=[0] * n,
        block_of_node=block if any(b >= 0 for b in block) else None, op_kind=kinds,
        # autograd packs a node's inputs before it runs, its outputs after
        node_packs_before_running=[bool(saves_in[i]) and not saves_out[i] for i in range(n)])
