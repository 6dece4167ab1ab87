"""memory.offload = disk: master weights and moments in memory-mapped files, streamed in chunks; bitwise the same
run as keeping them in memory, and the process's own arrays smaller by exactly the moved state."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.backend import make_backend
from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.plan.memory import memory_report
from mpitrain.state.offload import Offloaded, OnDevice, make_placement, memmap_allocator
from mpitrain.state.strategy import Segment
from tests.mpi_helpers import run_python_mpi_results
from tests.test_precision import run
from tests.test_train_parity import dataset, final_params, train_run  # noqa: F401 (fixture)


def segments_for(rng, sizes, master_of, grad_dtype=np.float64):
    """Segments over `master_of(size)` arrays with float64 gradients and decay ranges that cross chunk borders."""
    out = []
    for size in sizes:
        params = master_of(size)
        params[...] = rng.standard_normal(size)
        out.append(Segment(params, rng.standard_normal(size).astype(grad_dtype), [(1, size // 2), (size - 3, size)]))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 1000], ids=["one-element", "odd", "whole-segments"])
def test_streamed_adamw_is_bitwise_the_in_memory_one(tmp_path, chunk):
    """Chunks of 7 elements cut segments and decay ranges anywhere; three steps with clipping: equal to the bit."""
    sizes = [23, 5, 64]
    reference = segments_for(np.random.default_rng(0), sizes, np.zeros)
    allocate = memmap_allocator(tmp_path, rank=3)
    placement = Offloaded("disk", allocate, str(tmp_path), chunk)
    masters = iter(range(len(sizes)))
    offloaded = segments_for(np.random.default_rng(0), sizes,
                             lambda n: placement.zeros(f"master{next(masters)}", n, np.float64))
    hyper = AdamWHyper(weight_decay=0.1)
    plain, streamed = AdamW(reference, hyper), AdamW(offloaded, hyper, placement=placement)
    assert isinstance(streamed.exp_avg, np.memmap) and streamed.state_nbytes() == 0
    assert placement.moved_nbytes == 3 * sum(sizes) * 8  # masters + two moments, float64
    for step in range(3):
        for a, b in zip(reference, offloaded):
            b.grads[...] = a.grads = a.grads * 0.5 + step
        plain.step(1e-2, grad_scale=0.7)
        streamed.step(1e-2, grad_scale=0.7)
    for a, b in zip(reference, offloaded):
        assert np.array_equal(a.params, b.params)
    assert np.array_equal(plain.exp_avg, streamed.exp_avg) and np.array_equal(plain.exp_avg_sq, streamed.exp_avg_sq)
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "rank_00003_exp_avg.npy"
    reread = np.load(tmp_path / "rank_00003_exp_avg_sq.npy")  # the files hold the state (what a reader of them sees)
    assert np.array_equal(reread, plain.exp_avg_sq)


def test_the_next_chunk_is_read_in_a_reader_thread(tmp_path):
    placement = Offloaded("disk", memmap_allocator(tmp_path, 0), str(tmp_path), 4)
    readers = set()
    placement.to_device = lambda a: (readers.add(threading.current_thread().name), np.array(a))[1]
    segment = segments_for(np.random.default_rng(1), [10], lambda n: placement.zeros("master", n, np.float64))
    AdamW(segment, AdamWHyper(), placement=placement).step(1e-3)
    assert readers and all(name.startswith("offload-reader") for name in readers), readers


class DeviceArray(np.ndarray):
    """A stand-in for a GPU array: the pinned-host placement must copy chunks to it and back, never alias them."""


def test_pinned_host_streaming_is_bitwise_the_in_memory_one():
    """GPU `memory.offload = host` on CPU stand-ins: pinned arrays are plain numpy arrays off the device, chunks are
    copied to 'device' arrays, updated there and written back through `write_back` (CuPy's `get(out=...)`)."""
    sizes, written = [23, 5, 64], []

    def write_back(target, chunk):
        assert isinstance(chunk, DeviceArray) and not isinstance(target, DeviceArray)
        written.append(chunk.size)
        target[...] = np.asarray(chunk)

    placement = Offloaded("host", lambda name, size, dtype: np.zeros(size, dtype), "pinned host memory", 7,
                          to_device=lambda a: np.array(a).view(DeviceArray),
                          off_device=lambda a: type(a) is np.ndarray, write_back=write_back)
    reference = segments_for(np.random.default_rng(0), sizes, np.zeros)
    offloaded = segments_for(np.random.default_rng(0), sizes, lambda n: placement.zeros("master", n, np.float64))
    plain, streamed = AdamW(reference, AdamWHyper(weight_decay=0.1)), AdamW(offloaded, AdamWHyper(weight_decay=0.1),
                                                                             placement=placement)
    for step in range(3):
        for a, b in zip(reference, offloaded):
            b.grads[...] = a.grads = a.grads * 0.5 + step
        plain.step(1e-2, grad_scale=0.7)
        streamed.step(1e-2, grad_scale=0.7)
    assert all(np.array_equal(a.params, b.params) for a, b in zip(reference, offloaded))
    assert np.array_equal(plain.exp_avg_sq, streamed.exp_avg_sq)
    assert sum(written) == 3 * 3 * sum(sizes)  # every step: master and both moments, each element once


def memory_cfg(**keys):
    return SimpleNamespace(**{"offload": "none", "offload_dir": "", "offload_chunk_mb": 1.0, **keys})


def test_placement_from_config(tmp_path):
    cpu = make_backend("cpu", "float64")
    notes = []
    assert type(make_placement(memory_cfg(offload="host"), "adamw", cpu, 0, tmp_path, notes.append)) is OnDevice
    assert notes and "host memory is the device memory" in notes[0]
    disk = make_placement(memory_cfg(offload="disk", offload_chunk_mb=0.5), "adamw", cpu, 2, tmp_path)
    assert disk.where == str(tmp_path / "offload") and disk.chunk_elements == 2**19 // 8
    with pytest.raises(ConfigError, match="memory.offload_dir"):
        make_placement(memory_cfg(offload="disk"), "adamw", cpu, 0, None)
    for lean in ("adafactor", "adam8bit", "sgd"):  # every optimizer streams its state through the placement
        assert make_placement(memory_cfg(offload="disk"), lean, cpu, 0, tmp_path).kind == "disk"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match="memory.offload_dir = .*a-file.*rank 0"):
        make_placement(memory_cfg(offload="disk", offload_dir=str(blocked / "sub")), "adamw", cpu, 0, None)


# float64: the parameters are their own master, the moments move; bfloat16: the fp32 master moves too (ZeRO-0's
# replicated master is covered by the resume test below; ZeRO-2 reduce-scatters into a sharded gradient)
@pytest.mark.parametrize("compute, zero", [("float64", 0), ("float64", 1), ("bfloat16", 2), ("bfloat16", 3)])
def test_two_ranks_offloaded_run_is_bitwise_the_in_memory_run(tmp_path, dataset, compute, zero):
    """Losses, gradient norms and the final checkpoint's tensors (read through the memory-mapped master and moments)
    are equal to the bit; chunks of 0.01 MB cut every unit's shard into several."""
    common = ["train.steps=4", f"parallel.zero={zero}", f"precision.compute={compute}"]
    plain = train_run(2, tmp_path / "plain", dataset, *common)
    offloaded = train_run(2, tmp_path / "disk", dataset, *common, "memory.offload=disk",
                          "memory.offload_chunk_mb=0.01")
    assert [(m["loss"], m["grad_norm"]) for m in plain[0]] == [(m["loss"], m["grad_norm"]) for m in offloaded[0]]
    assert plain[1].keys() == offloaded[1].keys()
    for name, value in plain[1].items():
        assert np.array_equal(value, offloaded[1][name]), name
    assert sorted(p.name for p in (tmp_path / "disk" / "offload").iterdir())[:2] == [
        "rank_00000_exp_avg.npy", "rank_00000_exp_avg_sq.npy"]


def test_offloaded_state_is_saved_and_restored_through_the_files(tmp_path, dataset):
    """bfloat16 at ZeRO-0 (the fp32 master and moments in files): stopped after step 3 (the checkpoint reads the
    files), resumed in a new process (the checkpoint is written into fresh files): bitwise the uninterrupted run that
    kept everything in memory."""
    common = ["train.steps=6", "precision.compute=bfloat16"]
    offload = ["memory.offload=disk", "memory.offload_chunk_mb=0.01"]
    straight = train_run(2, tmp_path / "plain", dataset, *common)
    run_dir = tmp_path / "disk"
    run(2, run_dir, dataset, *common, *offload, "train.stop_at=3", expect=75)
    resumed = run(2, run_dir, dataset, *common, *offload, resume="auto")
    assert {m["step"]: (m["loss"], m["grad_norm"]) for m in straight[0]} == {
        m["step"]: (m["loss"], m["grad_norm"]) for m in resumed}
    assert [m["step"] for m in resumed] == list(range(1, 7))
    final = final_params(run_dir)
    for name, value in straight[1].items():
        assert np.array_equal(value, final[name]), name


MEMORY_JOB = """
import json, tempfile
from pathlib import Path
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.mesh import Mesh
from mpitrain.config import load_config, resolve_layout
from mpitrain.model.gpt import GPT
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.factory import make_state
from mpitrain.state.offload import make_placement
world = MPI.COMM_WORLD
out = {}
scratch = Path(tempfile.mkdtemp())
for stage in (0, 1, 2, 3):
    for offload in ("none", "disk"):
        cfg = load_config("configs/bench-small.toml", [f"parallel.zero={stage}", "train.micro_batch=1",
                                                       f"train.global_batch={world.size}", "precision.compute=bfloat16",
                                                       f"memory.offload={offload}"])
        resolve_layout(cfg, world.size)
        backend = make_backend("cpu", "bfloat16")
        model = GPT(cfg.model, backend)
        placement = make_placement(cfg.memory, "adamw", backend, world.rank, scratch / f"{stage}")
        state = make_state(cfg, model, backend, Mesh(world, dp=world.size), placement)
        optimizer = AdamW(state.optimizer_segments(), AdamWHyper(), placement=placement)
        held = state.memory()  # the arrays the state keeps in the process (memory-mapped files excluded)
        out[f"{stage}-{offload}"] = {"total": sum(held.values()) + optimizer.state_nbytes(), "psi": model.n_params,
                                     "moved": getattr(placement, "moved_nbytes", 0)}
if world.rank == world.size - 1:
    print("RESULTS " + json.dumps(out))
"""


def test_resident_state_falls_by_the_twelve_bytes_per_parameter_that_moved():
    """bfloat16 with fp32 master and moments, 2 ranks: at every ZeRO stage the process's arrays hold exactly the
    moved bytes less, and those are 12 bytes per parameter of this rank's share (12 Psi, or 12 Psi / N sharded);
    `mpitrain memory` says the same."""
    n = 2
    measured = run_python_mpi_results(n, MEMORY_JOB, timeout=180)
    psi = measured["0-none"]["psi"]
    for stage in (0, 1, 2, 3):
        plain, disk = measured[f"{stage}-none"], measured[f"{stage}-disk"]
        share = 12 * psi / (n if stage else 1)
        assert plain["moved"] == 0 and share <= disk["moved"] <= share + 12 * n * 6  # padding: < n per unit
        assert plain["total"] - disk["total"] == disk["moved"], stage
        cfg = load_config("configs/bench-small.toml", [f"parallel.zero={stage}", "precision.compute=bfloat16",
                                                       "memory.offload=disk"])
        cfg.parallel.dp = n
        report = memory_report(cfg, psi)
        assert report["bytes"]["offloaded"] == pytest.approx(share, rel=1e-12)
        assert report["bytes"]["state"] == pytest.approx(plain["total"] - disk["moved"], abs=16 * n * 6)
        assert "disk" in report["formulas"]["offloaded"]


def test_pinned_host_state_is_not_counted_as_device_memory():
    """GPU `memory.offload = host` on CPU stand-ins (pinned arrays are plain numpy arrays, off the device): the
    master copy and moments in them hold no device memory, whatever their type; on the device they count whole."""
    from mpi4py import MPI

    from mpitrain.comm.group import Group
    from mpitrain.state.params import ParamSpec, UnitLayout
    from mpitrain.state.replicated import ReplicatedState
    from mpitrain.state.zero import ZeroState

    backend = make_backend("cpu", "bfloat16")  # mixed: a separate fp32 master
    layouts = [UnitLayout(f"u{i}", [ParamSpec("w", (n,), "normal", std=0.02)]) for i, n in enumerate([12, 20])]
    psi = 32
    alone = Group(MPI.COMM_SELF, "self")

    def pinned():
        return Offloaded("host", lambda name, size, dtype: np.zeros(size, dtype), "pinned host memory", 8,
                         off_device=lambda a: type(a) is np.ndarray)

    for make in (lambda p: ReplicatedState(layouts, backend, 0, alone, placement=p),
                 lambda p: ZeroState(layouts, backend, 0, alone, stage=1, placement=p)):
        for placement, device_bytes in ((None, 4 * psi), (pinned(), 0)):
            state = make(placement)
            optimizer = AdamW(state.optimizer_segments(), AdamWHyper(), placement=placement)
            assert state.memory()["master"] == device_bytes, (type(state).__name__, placement)
            assert optimizer.state_nbytes() == 2 * device_bytes
