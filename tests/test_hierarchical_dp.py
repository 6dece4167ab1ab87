"""Hierarchical data parallelism (state/hierarchical.py, comm/two_level.py): the two-level gradient reduction and
hybrid ZeRO sharding match one process in float64, a checkpoint of hybrid sharding restores under another layout,
and the bytes that cross nodes are the formulas'. Four ranks as two fake nodes; the same on a real two-node SLURM
cluster is in tests/test_slurm.py."""
from __future__ import annotations

from fractions import Fraction

import pytest

from mpitrain.comm.nodes import NodeLayout
from mpitrain.comm.two_level import Sequencer, node_major_order
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.layout_checks import groups_split_by_node
from mpitrain.state.hierarchical import cross_node_bytes, flat_bytes
from tests.mpi_helpers import run_python_mpi_results

# (overrides, zero, zero_shard) of every layout the launch checks
MODES = [(["parallel.zero=0", "parallel.dp_reduce=two_level"], 0, "world"),
         (["parallel.zero=1", "parallel.dp_reduce=two_level"], 1, "world"),
         (["parallel.zero=2", "parallel.dp_reduce=two_level"], 2, "world"),
         (["parallel.zero=3", "parallel.dp_reduce=two_level"], 3, "world"),
         (["parallel.zero=1", "parallel.zero_shard=node"], 1, "node"),
         (["parallel.zero=2", "parallel.zero_shard=node"], 2, "node"),
         (["parallel.zero=3", "parallel.zero_shard=node"], 3, "node"),
         (["parallel.zero=3", "parallel.dp_reduce=two_level", "parallel.reshard_after_forward=false"], 3, "world"),
         # cp 2 x dp 2: the two levels are those of dp_cp, which sums the gradients (the cp pair inside a node)
         (["parallel.cp=2", "parallel.zero=2", "parallel.dp_reduce=two_level"], 2, "world"),
         (["parallel.cp=2", "parallel.zero=3", "parallel.zero_shard=node"], 3, "node")]
SLURM_MODES = [MODES[0], MODES[6]]  # zero 0 two_level, zero 3 node

# Shared with tests/test_slurm.py: runs each layout on the world's ranks and one process (rank 0, COMM_SELF) as the
# reference; prints RESULTS with each layout's worst relative differences and its cross-node bytes per step.
PARITY_JOB = """
import json, os, sys
import numpy as np
from mpi4py import MPI
from mpitrain.checkpoint.store import Checkpoint
from mpitrain.config import load_config
from mpitrain.layout_checks import dp_split_kind
from mpitrain.train import Trainer

world = MPI.COMM_WORLD
STEPS, MODES, CHECKPOINT = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
BASE = ["data.synthetic=true", "logging.peak_flops=1e9", "precision.compute=float64", "train.micro_batch=1",
        "optim.warmup_steps=1", f"train.steps={STEPS + 1}"]


def full_params(trainer, comm):
    # every tensor whole, from the windows of master weights each rank holds (any layout)
    layout = trainer.state.checkpoint_layout()
    geometry, merged = layout.geometry, None
    flat = np.full(geometry.size, np.nan)
    for g0, g1, array, a0 in layout.param_windows:
        flat[g0:g1] = array[a0:a0 + g1 - g0]
    for piece in comm.allgather(flat):
        merged = piece if merged is None else np.where(np.isnan(merged), piece, merged)
    tensors = {}
    for unit, part in enumerate(geometry.layouts):
        offset = geometry.offsets[unit]
        for spec in part.specs:
            tensors[f"{part.name}.{spec.name}"] = merged[offset:offset + spec.size]
            offset += spec.size
    return tensors


def psi_bytes(state, k):
    # the gradient bytes each level reduces: ZeRO's padded geometry, or the buckets padded to k (all-reduce)
    if hasattr(state, "geometry"):
        return state.geometry.size * 8
    return sum(-(-(end - start) // k) * k for start, end, _ in state.buckets) * 8


def run(comm, overrides, steps):
    trainer = Trainer(load_config("configs/tiny.toml", BASE + overrides), comm)
    kind = dp_split_kind(trainer.cfg.parallel)
    across = trainer.mesh.across_nodes.get(kind)
    records = []
    for step in range(steps):
        result = trainer.train_step(step)
        crossed = 0 if across is None else sum(v for k, v in across.counters(exact=True).items() if k != "control")
        records.append({"loss": result.loss, "norm": result.grad_norm, "params": full_params(trainer, comm),
                        "crossed": str(crossed)})
    return trainer, records


def worst(records, reference):
    losses = max(abs(r["loss"] - s["loss"]) / abs(s["loss"]) for r, s in zip(records, reference))
    norms = max(abs(r["norm"] - s["norm"]) / abs(s["norm"]) for r, s in zip(records, reference))
    params = max(np.linalg.norm(r["params"][name] - value) / np.linalg.norm(value)
                 for r, s in zip(records, reference) for name, value in s["params"].items())
    return {"loss": losses, "norm": norms, "params": params}


reference = None
if world.rank == 0:
    fake = os.environ.pop("MPITRAIN_FAKE_NODES", None)  # one process is one node
    reference = run(MPI.COMM_SELF, [], STEPS + 1)[1]
    if fake is not None:
        os.environ["MPITRAIN_FAKE_NODES"] = fake
reference = world.bcast(reference)
results = []
for overrides in MODES:
    trainer, records = run(world, overrides, STEPS)
    state, kind = trainer.state, dp_split_kind(trainer.cfg.parallel)
    results.append({"errors": worst(records, reference), "crossed": [r["crossed"] for r in records],
                    "psi": psi_bytes(state, trainer.mesh.inside_node[kind].size),
                    "k": trainer.mesh.inside_node[kind].size, "n": trainer.mesh.across_nodes[kind].size,
                    "micro_batches": trainer.accumulation, "nodes": trainer.mesh.nodes.describe()})
    # hybrid ZeRO-3's checkpoint, restored under flat ZeRO-1
    if overrides == ["parallel.zero=3", "parallel.zero_shard=node"] and CHECKPOINT != "-":
        trainer.checkpoint_manager(CHECKPOINT, 2).save(STEPS)
        if world.rank == 0:  # each shard held once per node is written once
            Checkpoint.open(os.path.join(CHECKPOINT, f"step_{STEPS:08d}")).verify_coverage()
        other = Trainer(load_config("configs/tiny.toml", BASE + ["parallel.zero=1"]), world)
        step = other.checkpoint_manager(CHECKPOINT, 2).restore(os.path.join(CHECKPOINT, f"step_{STEPS:08d}"))
        loaded = worst([{**records[-1], "params": full_params(other, world)}], [records[-1]])["params"]
        result = other.train_step(STEPS)  # the optimizer state came back too: the next step is the reference's
        after = {"loss": result.loss, "norm": result.grad_norm, "params": full_params(other, world)}
        results[-1]["restored"] = {"step": step, "restore_error": loaded, "next_step": worst([after],
                                                                                            [reference[STEPS]])}
if world.rank == 0:
    print("RESULTS " + json.dumps(results), flush=True)
"""


def expected_crossing(result, overrides, zero: int, zero_shard: str) -> Fraction:
    reshard = "parallel.reshard_after_forward=false" not in overrides
    return cross_node_bytes(zero, zero_shard, result["psi"], result["k"], result["n"], result["micro_batches"],
                            reshard)


def check_parity_and_bytes(results, modes) -> None:
    """Every layout within 1e-10 of one process, step by step, and its cross-node bytes the formula's."""
    for result, (overrides, zero, zero_shard) in zip(results, modes):
        assert result["nodes"].startswith("2 nodes"), result["nodes"]
        assert max(result["errors"].values()) < 1e-10, (overrides, result["errors"])
        expected = expected_crossing(result, overrides, zero, zero_shard)
        assert expected > 0 and all(Fraction(c) == expected for c in result["crossed"]), \
            (overrides, result["crossed"], expected)


def test_two_level_and_hybrid_sharding_match_one_process_and_cross_nodes_as_the_formulas_say(tmp_path):
    import json
    steps = 3
    code = PARITY_JOB.replace("sys.argv[1]", repr(json.dumps(steps))).replace(
        "sys.argv[2]", repr(json.dumps([m[0] for m in MODES]))).replace("sys.argv[3]", repr(str(tmp_path / "ck")))
    results = run_python_mpi_results(4, code, timeout=300, env={"MPITRAIN_FAKE_NODES": "2"})
    check_parity_and_bytes(results, MODES)
    restored = results[MODES.index(SLURM_MODES[1])]["restored"]
    assert restored["step"] == steps and restored["restore_error"] == 0, restored
    assert max(restored["next_step"].values()) < 1e-10, restored


def test_cross_node_formulas():
    psi, k, n = 4000, 4, 2  # 8 ranks on 2 nodes
    assert cross_node_bytes(0, "world", psi, k, n) == Fraction(2 * 1, 2) * 1000  # 2 (n-1)/n Psi/k
    assert cross_node_bytes(0, "world", psi, k, n) * k == flat_bytes(0, psi, n * k) / Fraction(7, 8) * Fraction(1, 2)
    assert cross_node_bytes(2, "world", psi, k, n, micro_batches=3) == 4 * Fraction(1, 2) * 1000
    assert cross_node_bytes(3, "world", psi, k, n, micro_batches=2) == 6 * Fraction(1, 2) * 1000
    assert cross_node_bytes(3, "world", psi, k, n, 2, reshard_after_forward=False) == 4 * Fraction(1, 2) * 1000
    assert cross_node_bytes(3, "node", psi, k, n, micro_batches=2) == 4 * Fraction(1, 2) * 1000
    assert cross_node_bytes(1, "node", psi, k, n, micro_batches=2) == 2 * Fraction(1, 2) * 1000
    assert flat_bytes(3, psi, 8, micro_batches=1) == 3 * Fraction(7, 8) * psi
    assert cross_node_bytes(1, "node", psi, k, 1) == 0  # one node: nothing crosses


def test_node_major_order_puts_each_ranks_block_where_two_levels_deliver_it():
    nodes = NodeLayout.blocks(8, 0, 2)  # ranks 0-3 on fakenode0, 4-7 on fakenode1
    assert node_major_order(list(range(8)), nodes) == [0, 4, 1, 5, 2, 6, 3, 7]
    strided = NodeLayout.from_leaders(0, [0, 1, 0, 1], ["a", "b", "a", "b"])  # nodes interleaved
    assert node_major_order([0, 1, 2, 3], strided) == [0, 1, 2, 3]


class FakeHandle:
    def __init__(self, log, name, ready):
        self.log, self.name, self.ready = log, name, ready
        log.append(f"start {name}")

    def test(self):
        return self.ready[self.name]

    def wait(self):
        self.ready[self.name] = True


def test_sequencer_starts_stages_in_submission_order_whatever_lands_first():
    log, ready = [], {"a1": False, "a2": False, "b1": True, "b2": True}
    sequencer = Sequencer()
    a = sequencer.submit([lambda: FakeHandle(log, "a1", ready), lambda: FakeHandle(log, "a2", ready)])
    b = sequencer.submit([lambda: FakeHandle(log, "b1", ready), lambda: FakeHandle(log, "b2", ready)])
    assert not b.test() and log == ["start a1"]  # b waits behind a: no rank may start b1 before a2 everywhere
    ready["a1"] = True
    assert not a.test() and log == ["start a1", "start a2"]
    b.wait()
    assert a.done and b.done and log == ["start a1", "start a2", "start b1", "start b2"]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.zero_shard=node"], "shards ZeRO's state inside a node and needs parallel.zero >= 1"),
    (["parallel.zero=3", "parallel.zero_shard=node", "parallel.dp_reduce=two_level"], "already reduces in two"),
    (["parallel.dp_reduce=two_level", "precision.grad_reduce=bfloat16"], "has no two-level form"),
    (["parallel.zero=2", "parallel.zero_shard=node", "parallel.ep=2"], "experts summed over"),
    (["parallel.zero_shard=rack"], "config key parallel.zero_shard = 'rack' is not allowed"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as refused:
        load_config("configs/tiny.toml", overrides)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_mesh_splits_the_reduction_group():
    assert groups_split_by_node(load_config("configs/tiny.toml", [])) == ()
    assert groups_split_by_node(load_config("configs/tiny.toml", ["parallel.dp_reduce=two_level"])) == ("dp",)
    assert groups_split_by_node(load_config("configs/tiny.toml", ["parallel.zero=1", "parallel.zero_shard=node",
                                                                  "parallel.cp=2"])) == ("dp_cp",)
