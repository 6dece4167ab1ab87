"""ZeRO++'s quantized collectives over hierarchical data parallelism (state/hierarchical_quantized.py): four ranks
as two fake nodes, each layout's quantized run beside its exact run. The bytes crossing nodes equal
`cross_node_step_bytes` (and, exact, state/hierarchical.cross_node_bytes); one two-level reduction stays within the
levels' codec bounds against its float64 sum; the runs stay within test_zero_quantized's bounds of the exact run.
With context parallelism (dp 2 x cp 2) the two levels split the dp x cp group ZeRO shards over."""
from __future__ import annotations

import math
from fractions import Fraction

from mpitrain.comm.quantized import WORST_RELATIVE_ERROR, wire_nbytes
from mpitrain.config import load_config
from mpitrain.optim.schedule import lr_at
from mpitrain.state.hierarchical import cross_node_bytes
from mpitrain.state.hierarchical_quantized import cross_node_step_bytes
from mpitrain.state.zero_quantized import QuantizedComm
from tests.mpi_helpers import run_python_mpi_results
from tests.test_zero_quantized import adam_step_bound

JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.comm.quantized import WORST_RELATIVE_ERROR
from mpitrain.config import load_config
from mpitrain.layout_checks import dp_split_kind
from mpitrain.state.hierarchical_quantized import cross_node_step_bytes, make_grad_reducer
from mpitrain.state.zero_quantized import QuantizedComm
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
BLOCK, STEPS = 64, 4
BASE = ["data.synthetic=true", "logging.peak_flops=1e9", "precision.compute=float64", "train.micro_batch=2",
        f"parallel.zero_quant_block={BLOCK}", "optim.warmup_steps=1", f"train.steps={STEPS}"]
LAYOUTS = {"two_level zero3 fp8/int8": (["parallel.zero=3", "parallel.dp_reduce=two_level"], ("fp8", "int8")),
           "two_level zero2 same/int4": (["parallel.zero=2", "parallel.dp_reduce=two_level"], ("same", "int4")),
           "node zero3 int8/int8": (["parallel.zero=3", "parallel.zero_shard=node"], ("int8", "int8")),
           "node zero1 same/int4": (["parallel.zero=1", "parallel.zero_shard=node"], ("same", "int4")),
           "node zero3 cp2 fp8/int8": (["parallel.zero=3", "parallel.zero_shard=node", "parallel.cp=2"],
                                      ("fp8", "int8"))}


def run(layout, modes):
    gather, grads = modes
    cfg = load_config("configs/tiny.toml", BASE + layout + [f"parallel.zero_gather_dtype={gather}",
                                                            f"parallel.zero_grad_reduce={grads}"])
    trainer = Trainer(cfg, world)
    state, p = trainer.state, cfg.parallel
    across = trainer.mesh.across_nodes[dp_split_kind(p)]
    losses, crossed = [], []
    for step in range(STEPS):
        losses.append(trainer.train_step(step).loss)
        crossed.append({k: str(v) for k, v in across.counters(exact=True).items() if k != "control" and v})
    expected = cross_node_step_bytes(p.zero, p.zero_shard, state.shard_sizes, across.size, 8, 8, state.quantized,
                                     trainer.accumulation, p.reshard_after_forward)
    params = np.concatenate([s.params for s in state.optimizer_segments()]).astype(np.float64)
    held = world.allgather((state.group.rank, params))  # under node: each copy of a shard bit for bit the same
    copies = [(a, b) for i, (place, a) in enumerate(held) for other, b in held[i + 1:] if other == place]
    copies_equal = bool(copies) and all(np.array_equal(a, b) for a, b in copies)  # False where no shard has copies
    return {"losses": losses, "crossed": crossed, "params": params, "state": state, "copies_equal": copies_equal,
            "expected": {k: str(v) for k, v in expected.items() if v},
            "geometry": {"psi": state.geometry.size * 8, "k": state.group.inside.size, "n": across.size,
                         "micro_batches": trainer.accumulation}}


def compare(got, reference):
    diff, ref = got["params"] - reference["params"], reference["params"]
    return {"loss_error": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"])),
            "param_error": (world.allreduce(float(np.sum(diff ** 2))) / world.allreduce(float(np.sum(ref ** 2)))) ** .5,
            "param_max_abs": world.allreduce(float(np.max(np.abs(diff))), op=MPI.MAX)}


def block_absmax(x):
    return np.repeat(np.abs(x.reshape(-1, BLOCK)).max(axis=1), BLOCK)


def reducer_check(group, codec):
    # one reduction of random gradients (each rank's share a whole number of blocks at both levels) against the
    # float64 sum: within delta per contribution (inside), per node's partial sum, inflated by the inside level's
    # bound (across), and under zero_shard = node per element of the sum (the quantized all-gather)
    delta = WORST_RELATIVE_ERROR[codec] * (1 + 1e-6)
    share = 4 * BLOCK * group.across.size
    rng = np.random.default_rng(world.rank)
    send = rng.standard_normal(group.size * share) * np.exp(rng.uniform(-5, 5, group.size * share))
    reducer = make_grad_reducer(group, np.float64, "float32", QuantizedComm("same", codec, BLOCK))
    summed = reducer.reduce_scatter(send).wait()
    pieces = [s.reshape(group.size, share)[group.rank] for s in world.allgather(send)]  # of this rank's share
    nodes = {tuple(members) for members in world.allgather(group.inside.world_ranks)}
    exact = sum(pieces)
    inside = sum(delta * sum(block_absmax(pieces[r]) for r in node) for node in nodes)
    bound = inside + delta * sum(block_absmax(sum(pieces[r] for r in node)) + inside for node in nodes)
    if hasattr(group, "copies"):
        bound = bound + delta * (block_absmax(exact) + bound)
    ratio = float(np.max(np.abs(summed - exact) / bound))
    return world.allreduce(ratio, op=MPI.MAX)


out = {}
for name, (layout, modes) in LAYOUTS.items():
    exact, got = run(layout, ("same", "exact")), run(layout, modes)
    out[name] = {**compare(got, exact), "crossed": got["crossed"], "expected": got["expected"],
                 "exact_crossed": exact["crossed"], "exact_expected": exact["expected"],
                 "geometry": exact["geometry"], "copies_equal": got["copies_equal"],
                 "reducer_ratio": reducer_check(got["state"].group, modes[1])}
if world.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


def test_quantized_hierarchical_zero_crosses_nodes_as_the_formula_says_within_codec_bounds():
    """Per layout: the copies of each shard stay bit for bit the same; every step's cross-node bytes are the
    formula's, quantized and exact, the exact ones also state/hierarchical.cross_node_bytes'; one reduction within
    its bound; the run within test_zero_quantized's bounds (loss: the codec's relative bound; parameters: Adam's
    drift of 2 lr per step)."""
    out = run_python_mpi_results(4, JOB, timeout=300, env={"MPITRAIN_FAKE_NODES": "2"})
    o = load_config("configs/tiny.toml", ["optim.warmup_steps=1", "train.steps=4"]).optim
    drift = sum(2 * adam_step_bound(t + 1) * lr_at(t, o.lr, o.min_lr, o.warmup_steps, 4, o.schedule)
                for t in range(4))
    print(f"\nlayout                     crossed q/exact  loss rel. err  param max abs (bound {drift:.4f})  reducer")
    for name, got in out.items():
        zero, zero_shard = int(name.split()[1][-1]), "node" if name.startswith("node") else "world"
        assert all(step == got["expected"] for step in got["crossed"]), name
        assert got["copies_equal"] == (zero_shard == "node"), name  # two_level: one holder per shard, no copies
        assert all(step == got["exact_expected"] for step in got["exact_crossed"]), name
        g = got["geometry"]
        exact_total = sum(Fraction(v) for v in got["exact_expected"].values())
        assert exact_total == cross_node_bytes(zero, zero_shard, g["psi"], g["k"], g["n"], g["micro_batches"]), name
        quantized_total = sum(Fraction(v) for v in got["expected"].values())
        assert quantized_total < exact_total, name
        delta = max(WORST_RELATIVE_ERROR.get(codec, 0) for codec in name.split()[-1].split("/"))
        assert 0 < got["loss_error"] <= delta and 0 < got["param_max_abs"] <= drift, (name, got)
        assert 0 < got["reducer_ratio"] <= 1, (name, got["reducer_ratio"])
        print(f"{name:26s} {float(quantized_total / exact_total):15.3f} {got['loss_error']:14.2e} "
              f"{got['param_max_abs']:13.2e} {got['reducer_ratio']:28.2f}")


def test_cross_node_step_bytes_by_hand():
    """2 nodes, shards of 10 and 6 elements, blocks of 4, float64 on the wire."""
    q = QuantizedComm("fp8", "int4", 4)
    two_level = cross_node_step_bytes(3, "world", [10, 6], 2, 8, 8, q, micro_batches=2)
    assert two_level == {"all_gather": 2 * 2 * ((10 + 12) + (6 + 8)), "all_to_all": 2 * ((5 + 12) + (3 + 8))}
    node = cross_node_step_bytes(3, "node", [10, 6], 2, 8, 8, q, micro_batches=2)
    pieces = wire_nbytes("int4", 5, 4) + wire_nbytes("int4", 3, 4)  # ceil(10 / 2), ceil(6 / 2) per node
    assert node == {"all_to_all": 2 * pieces, "all_gather": 2 * pieces} and pieces == (3 + 8) + (2 + 4)
    exact = cross_node_step_bytes(1, "node", [10, 6], 2, 8, 8, QuantizedComm(), micro_batches=2)
    assert exact == {"all_reduce": 16 * 8} == {"all_reduce": cross_node_bytes(1, "node", 16 * 8 * 2, 2, 2)}
    assert cross_node_step_bytes(2, "node", [10], 3, 8, 8, q)["all_to_all"] == 2 * wire_nbytes("int4", 4, 4)
    assert math.isclose(sum(cross_node_step_bytes(2, "world", [10], 1, 8, 8, q).values()), 0)  # one node
