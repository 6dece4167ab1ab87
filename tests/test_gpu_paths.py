"""Three places where the first GPU runs would have crashed, held to the CuPy path:

- the bf16 embedding gradient: CuPy's add.at takes no bfloat16, so `ops.scatter_add_rows` sums a low-precision
  table's rows in float32 (checked on numpy against the numpy branch; on fake device arrays it reaches device work
  where add.at raised TypeError; on a GPU one bf16 forward + backward of a tiny GPT matches the CPU's);
- gradient reduction (state/reduce.py) on device arrays: its buffers are made where the gradients live, so ZeRO's
  `shard[...] = received` and `add_into` get device arrays, and the bf16 wire is filled on the device;
- `memory.offload = host` with several GPUs per node: the offload reader thread copies onto the rank's GPU.

Fake device arrays (tests/fake_device.py) need CuPy installed but no GPU; the GPU tests skip, saying why, without
one.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from mpitrain.backend import BFLOAT16, make_backend
from mpitrain.config import ModelConfig
from mpitrain.kernels import cupy_status
from mpitrain.layers import ops
from mpitrain.model.gpt import GPT
from mpitrain.state.offload import pinned_host_placement
from mpitrain.state.reduce import GradReducer, add_into
from mpitrain.state.replicated import ReplicatedState
from mpitrain.state.strategy import Segment
from tests.fake_device import device_work_error, fake_cupy, fake_device_array, host_allocator

GPU_USABLE, GPU_REASON = cupy_status()
needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"needs a CUDA GPU: {GPU_REASON}")
TINY = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16}


# ---- the bf16 embedding gradient ----------------------------------------------------------------------------------
def embedding_gradient_case(seed: int = 3):
    """A bf16 table, repeated rows and the float32 values the cast rule hands scatter_add_rows."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((9, 5)).astype(ml_dtypes.bfloat16)
    rows = rng.integers(0, 9, size=40)
    return table, rows, rng.standard_normal((40, 5)).astype(np.float32)


def test_the_device_branch_sums_low_precision_rows_as_the_numpy_branch_does():
    """The CuPy branch's algorithm (fp32 sums per touched row, added and rounded once) run on numpy arrays."""
    table, rows, values = embedding_gradient_case()
    on_host, device_way = table.copy(), table.copy()
    ops.scatter_add_rows(on_host, rows, values)
    ops._scatter_add_rows_on_device(np, device_way, rows, values)
    assert device_way.dtype == BFLOAT16
    assert not np.array_equal(device_way, table)
    np.testing.assert_array_equal(device_way.astype(np.float32), on_host.astype(np.float32))


def test_bf16_embedding_gradient_on_cupy_reaches_device_work():
    """CuPy's add.at rejects a bf16 table; scatter_add_rows must not hand it one. (With float32 values, as the cast
    rule hands them, CuPy first casts them to the table's dtype, device work that a fake array cannot pass, and
    raises the same TypeError after it on a GPU: bf16 values show the check here.)"""
    cupy = fake_cupy()
    table, rows, values = embedding_gradient_case()
    table, rows, values = (fake_device_array(cupy, a) for a in (table, rows, values.astype(BFLOAT16)))
    with pytest.raises(TypeError, match="add.at only supports"):
        cupy.add.at(table, rows, values)  # why the bf16 table needs its own path
    with pytest.raises(device_work_error(cupy)):
        ops.scatter_add_rows(table, rows, values)


def tiny_step(device: str, arch: str):
    """Loss and gradients (as float32 on the host) of one bf16 forward + backward of a tiny GPT."""
    cfg = ModelConfig(**TINY, **({"arch": "llama", "n_kv_head": 2} if arch == "llama" else {}))
    backend = make_backend(device, "bfloat16")
    model = GPT(cfg, backend)
    state = ReplicatedState(model.layouts, backend, 0)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, cfg.seq_len))
    loss, saved = model.forward(state, backend.from_host(tokens), backend.from_host(np.roll(tokens, -1, axis=1)))
    model.backward(state, saved, 1.0 / tokens.size)
    return float(loss), backend.to_host(state.grads.data).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_one_bf16_training_step_on_the_gpu_matches_the_cpu(arch):
    loss, grads = tiny_step("cuda", arch)
    cpu_loss, cpu_grads = tiny_step("cpu", arch)
    assert np.isfinite(loss) and np.all(np.isfinite(grads))
    assert loss == pytest.approx(cpu_loss, rel=2e-2)
    assert np.linalg.norm(grads - cpu_grads) <= 5e-2 * np.linalg.norm(cpu_grads)


# ---- gradient reduction on device arrays -------------------------------------------------------------------------
class CopiesGroup:
    """A data-parallel group of `size` ranks that all hold the same gradients, seen from `rank`: what it receives
    is what every rank would send (an all-gather's other blocks are copies of this rank's: only this rank's block
    is right). It records the arrays it is handed; the reductions complete at once."""

    def __init__(self, size: int = 2, rank: int = 1):
        self.size, self.rank, self.handed = size, rank, []

    def _block(self, array, index: int):
        width = array.size // self.size
        return array.reshape(-1)[index * width:(index + 1) * width]

    def iall_reduce(self, buf):
        self.handed.append(buf)
        buf *= self.size

    def ireduce_scatter(self, send, recv):
        self.handed += [send, recv]
        recv[...] = self._block(send, self.rank) * self.size

    def all_to_all(self, send, recv):
        self.handed += [send, recv]
        for index in range(self.size):
            self._block(recv, index)[...] = self._block(send, self.rank)

    def all_gather(self, send, recv):
        self.handed += [send, recv]
        for index in range(self.size):
            self._block(recv, index)[...] = send


class RecordingGroup(CopiesGroup):
    """Records the arrays it is handed and moves nothing (fake device arrays can do no device work)."""

    def iall_reduce(self, buf):
        self.handed.append(buf)

    def ireduce_scatter(self, send, recv):
        self.handed += [send, recv]

    def all_to_all(self, send, recv):
        self.handed += [send, recv]

    all_gather = all_to_all


def reduce_like_zero(xp, grad_dtype, grad_reduce: str):
    """ZeRO's use of one reducer: reduce-scatter, then stage 1's copy and stages 2/3's add of the shard; and the
    replicated state's all-reduce. Returns (the group, the stage 1 shard, the stage 2 shard, the all-reduced)."""
    group = CopiesGroup()
    reducer = GradReducer(group, grad_dtype, grad_reduce)
    grads = xp.asarray(np.arange(1, 9, dtype=np.float32).astype(grad_dtype))
    received = reducer.reduce_scatter(grads).result
    stage1 = grads[4:8].copy()
    stage1[...] = received  # AccumulatedGrads.take
    stage2 = xp.ones(4, dtype=grad_dtype)
    add_into(stage2, received)  # ShardedGrads.take
    reduced = grads.copy()
    reducer.all_reduce(reduced).wait()
    return group, stage1, stage2, reduced


MODES = [(np.float32, "float32"), (BFLOAT16, "float32"), (BFLOAT16, "bfloat16"), (np.float32, "bfloat16")]
MODE_IDS = ["fp32-native", "bf16-in-fp32", "bf16-wire", "fp32-bf16-wire"]


def check_reduced(xp, grad_dtype, grad_reduce):
    group, stage1, stage2, reduced = reduce_like_zero(xp, grad_dtype, grad_reduce)
    assert all(type(array) is xp.ndarray for array in group.handed)
    grads = np.arange(1, 9, dtype=np.float64)
    np.testing.assert_array_equal(xp.asnumpy(stage1) if xp is not np else stage1, 2 * grads[4:8])
    np.testing.assert_array_equal((xp.asnumpy(stage2) if xp is not np else stage2).astype(np.float64),
                                  1 + 2 * grads[4:8])
    reduced = xp.asnumpy(reduced) if xp is not np else reduced
    assert reduced.dtype == np.dtype(grad_dtype)
    np.testing.assert_array_equal(reduced[4:8].astype(np.float64), 2 * grads[4:8])  # this rank's block


@pytest.mark.parametrize("grad_dtype, grad_reduce", MODES, ids=MODE_IDS)
def test_reductions_sum_where_the_gradients_live_on_numpy(grad_dtype, grad_reduce):
    check_reduced(np, grad_dtype, grad_reduce)


@needs_gpu
@pytest.mark.parametrize("grad_dtype, grad_reduce", MODES, ids=MODE_IDS)
def test_reductions_sum_where_the_gradients_live_on_the_gpu(grad_dtype, grad_reduce):
    import cupy
    check_reduced(cupy, grad_dtype, grad_reduce)


def test_reduce_scatter_of_device_gradients_receives_on_the_device():
    """The shard arrives in a device buffer, so ZeRO-1's copy (numpy source: ValueError "non-scalar
    numpy.ndarray cannot be used for fill") and ZeRO-2/3's add (TypeError) reach device work."""
    cupy = fake_cupy()
    group = RecordingGroup()
    with host_allocator(cupy):
        send = fake_device_array(cupy, np.arange(8, dtype=np.float32))
        received = GradReducer(group, np.float32, "float32").reduce_scatter(send).result
        assert [type(array) for array in group.handed] == [cupy.ndarray, cupy.ndarray]
    assert type(received) is cupy.ndarray
    shard = fake_device_array(cupy, np.zeros(4, np.float32))
    with pytest.raises(device_work_error(cupy)):
        shard[...] = received
    with pytest.raises(device_work_error(cupy)):
        add_into(shard, received)


def test_bf16_wire_of_device_gradients_is_filled_on_the_device():
    """grad_reduce = bfloat16: the all-reduce's wire buffer is a device array (a numpy one: TypeError "Implicit
    conversion to a NumPy array"), and the reduce-scatter hands the group device blocks."""
    cupy = fake_cupy()
    group = RecordingGroup()
    reducer = GradReducer(group, BFLOAT16, "bfloat16")
    with host_allocator(cupy):
        grads = fake_device_array(cupy, np.arange(8, dtype=np.float32).astype(BFLOAT16))
        with pytest.raises(device_work_error(cupy)):
            reducer.all_reduce(grads)
        with pytest.raises(device_work_error(cupy)):
            reducer.reduce_scatter(grads)
    assert group.handed and all(type(array) is cupy.ndarray for array in group.handed)


# ---- memory.offload = host: the reader thread on the rank's GPU --------------------------------------------------
class DeviceRecorder:
    """A stand-in for cupy's `cuda.Device` and `asarray`: the current device is `rank_device` on the thread that
    made it and 0 on any other (as CUDA starts every host thread on GPU 0); each copy records (thread, device)."""

    def __init__(self, rank_device: int):
        self.owner, self.rank_device, self.copies = threading.current_thread(), rank_device, []
        self.local = threading.local()
        recorder = self

        class Device:
            def __init__(self, device_id=None):
                self.id = recorder.current() if device_id is None else device_id

            def __enter__(self):
                recorder.local.stack = [*getattr(recorder.local, "stack", []), self.id]
                return self

            def __exit__(self, *exc):
                recorder.local.stack.pop()

        self.xp = SimpleNamespace(cuda=SimpleNamespace(Device=Device), asarray=self.asarray)

    def current(self) -> int:
        stack = getattr(self.local, "stack", [])
        if stack:
            return stack[-1]
        return self.rank_device if threading.current_thread() is self.owner else 0

    def asarray(self, array):
        self.copies.append((threading.current_thread().name, self.current()))
        return np.array(array).view(HostChunk)


class HostChunk(np.ndarray):
    """A "device" chunk of the stand-in: written back with .get(out=...) like a cupy array."""

    def get(self, out):
        out[...] = self


def test_offload_reader_thread_copies_onto_the_ranks_gpu():
    recorder = DeviceRecorder(rank_device=3)
    placement = pinned_host_placement(recorder.xp, chunk_elements=4)
    master, moment = np.zeros(10, np.float32), np.zeros(10, np.float32)
    segments = [Segment(master, np.ones(10, np.float32), [])]
    for segment, moment_chunk in placement.stream(segments, [(0, 10)], [moment]):
        segment.params[...] += 1
        moment_chunk[...] += 2
    np.testing.assert_array_equal(master, 1)
    np.testing.assert_array_equal(moment, 2)
    assert len(recorder.copies) == 6  # 3 chunks x (master, moment)
    assert {device for _, device in recorder.copies} == {3}, recorder.copies
    assert all(thread.startswith("offload-reader") for thread, _ in recorder.copies)
