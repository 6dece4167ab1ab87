"""The GPU path of the newer features, checked as far as a CPU allows:

- parallel.tp_overlap's ring and hybrid cp's ring (on the node-split group "cp_across") travel on NCCL lanes
  (comm/nccl.py p2p_tags): one 4-rank job on two fake nodes builds the mesh's groups through the NCCL stand-in
  (comm/nccl_standin.py), checks that the rings' tags have lanes and that the lanes carried their messages, and that
  the overlapped operators equal the plain MPI ones bit for bit; a float64 training run of tp 2 (tp_overlap) x cp 2
  (hybrid) through the stand-in matches one process at 1e-10;
- hierarchical data parallelism (comm/two_level.py) over NCCL groups: the same job runs TwoLevelGroup's and
  NodeShardGroup's operations on NCCL groups against the MPI ones; dp 4 runs through the stand-in on two fake nodes
  (ZeRO-3 two_level, ZeRO-2 sharded by node) match one process at 1e-10; on fake CuPy arrays its scratch buffers
  are device arrays;
- quantized ZeRO (comm/quantized.py, state/zero_quantized.py): the codecs' device route for fp8 (arithmetic, since
  CuPy has no float8 dtype) is ml_dtypes' cast bit for bit; the quantized gather and reduce-scatter on NCCL groups
  give the MPI groups' bytes; on fake CuPy arrays (tests/fake_device.py) encode and decode get past every
  Python-level check to device work;
- the config refusals of these features on train.device = "cuda" / train.collectives = "nccl" are gone.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from mpitrain.comm.nccl import STANDIN_ENV, p2p_tags
from mpitrain.comm.quantized import decode, e4m3fn_codes, e4m3fn_values, encode
from mpitrain.comm.two_level import TwoLevelGroup
from mpitrain.config import load_config
from mpitrain.kernels import cupy_status
from mpitrain.layers.tp_overlap import RING_TAG
from mpitrain.parallel.context import GRAD_TAG, KV_TAG
from tests.fake_device import device_work_error, fake_cupy, fake_device_array, host_allocator
from tests.mpi_helpers import describe, run_mpi, run_python_mpi_results
from tests.test_context_parallel import ARCH, assert_same_run
from tests.test_context_parallel import train_run as one_process_run
from tests.test_train_parity import PARITY_STEPS, final_params

GPU_USABLE, GPU_REASON = cupy_status()
needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"needs a CUDA GPU: {GPU_REASON}")


# ---- lanes and refusals (no MPI) ----------------------------------------------------------------------------------
def test_every_ring_tag_has_lanes_on_its_group_kind():
    assert p2p_tags("tp") == (RING_TAG,)
    assert p2p_tags("cp") == p2p_tags("cp_across") == (KV_TAG, GRAD_TAG)  # hybrid cp's ring runs across nodes
    assert p2p_tags("cp_inside") == p2p_tags("dp_across") == p2p_tags("dp") == ()  # collectives only


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true", "train.collectives=nccl",
     "train.device=cuda"],
    ["parallel.cp=2", "parallel.cp_kind=hybrid", "train.collectives=nccl", "train.device=cuda"],
    ["parallel.dp_reduce=two_level", "train.device=cuda", "train.collectives=nccl"],
    ["parallel.zero=3", "parallel.zero_shard=node", "train.device=cuda"],
    ["parallel.zero=3", "parallel.zero_gather_dtype=fp8", "parallel.zero_grad_reduce=int4", "train.device=cuda",
     "train.collectives=nccl"],
], ids=["tp_overlap", "hybrid-cp", "two_level", "zero_shard-node", "quantized-zero"])
def test_the_gpu_path_of_each_feature_is_accepted(overrides):
    cfg = load_config("configs/tiny.toml", overrides)
    assert cfg.train.device == "cuda"


# ---- the fp8 codec's device route ---------------------------------------------------------------------------------
def fp8_probe_values() -> np.ndarray:
    """Every finite e4m3fn value, the midpoints between neighbours (ties) and one float32 ulp either side of them,
    subnormals, signed zeros, NaN, and random values over the whole range."""
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(every[np.isfinite(every)])
    ties = (finite[:-1] + finite[1:]) / 2
    rng = np.random.default_rng(7)
    return np.concatenate([finite, ties, -ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(500)),
                           rng.uniform(-448, 448, 20_000), rng.standard_normal(2_000) * 2.0 ** -8,
                           [0.0, -0.0, np.nan, -np.nan]]).astype(np.float32)


def test_fp8_codes_by_arithmetic_are_ml_dtypes_cast_bit_for_bit():
    """The route CuPy takes (no float8 dtype there), run on numpy: encode rounds to nearest even exactly as
    ml_dtypes' cast (ties, subnormals, -0, NaN), and decode gives every one of the 256 codes' values."""
    values = fp8_probe_values()
    expected = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = e4m3fn_codes(np, values)
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, f"{wrong.size} codes differ, first {values[wrong[:3]]}: {got[wrong[:3]]}"
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(e4m3fn_values(np, codes),
                                  codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


@needs_gpu
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_codecs_on_the_gpu_give_numpys_bytes(codec):
    """On a GPU (benchmarks/gpu_check.py runs this): payload, scales and decoded values of CuPy arrays are the numpy
    path's bit for bit, and the fp8 codes of every probe value (NaN included) are ml_dtypes' cast."""
    import cupy
    rng = np.random.default_rng(3)
    values = np.concatenate([np.nan_to_num(fp8_probe_values()), rng.standard_normal(1000) * np.exp(rng.uniform(
        -20, 20, 1000))]).astype(np.float32)
    payload, scales = encode(values, 64, codec)
    on_device = encode(cupy.asarray(values), 64, codec)
    assert all(isinstance(part, cupy.ndarray) for part in on_device)
    np.testing.assert_array_equal(cupy.asnumpy(on_device[0]), payload)
    np.testing.assert_array_equal(cupy.asnumpy(on_device[1]), scales)
    np.testing.assert_array_equal(cupy.asnumpy(decode(*on_device, values.size, 64, codec)),
                                  decode(payload, scales, values.size, 64, codec))
    probes = fp8_probe_values()
    np.testing.assert_array_equal(cupy.asnumpy(e4m3fn_codes(cupy, cupy.asarray(probes))),
                                  probes.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_codecs_on_fake_device_arrays_reach_device_work(codec):
    """encode and decode on CuPy arrays: no numpy-only call (a float8 view, np.concatenate of device arrays) stops
    them before the first kernel, which a fake array cannot run."""
    cupy = fake_cupy()
    x = fake_device_array(cupy, np.random.default_rng(1).standard_normal(100).astype(np.float32))
    with pytest.raises(device_work_error(cupy)):
        encode(x, 32, codec)
    payload, scales = encode(np.zeros(100, np.float32), 32, codec)
    with pytest.raises(device_work_error(cupy)):
        decode(fake_device_array(cupy, payload), fake_device_array(cupy, scales), 100, 32, codec)



# ---- FP8 recipes' emulation on device arrays -----------------------------------------------------------------------
FP8_RECIPES = ("tensor", "delayed", "block", "mxfp8")


def fp8_operands(rng):
    """An activation (2, 3, 64), a weight (64, 96) and an output gradient (2, 3, 96), float32, spread over
    several binades."""
    def spread(*shape):
        return (rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))).astype(np.float32)
    return spread(2, 3, 64), spread(64, 96), spread(2, 3, 96) * np.float32(1e-3)


def fp8_stages(module, x, w, dy, recipe):
    """Each stage of a recipe on x's array module, as its own call, so that every one is reached."""
    from mpitrain.comm.quantized import fp8_round
    from mpitrain.layers import fp8

    grid = x[0, :, :2]
    return [lambda: fp8_round(module, x, "e5m2"), lambda: fp8.cast_saturating(x, "e4m3"),
            lambda: fp8.tensor_scale(grid, "e4m3"), lambda: fp8.mx_scale(grid, "e5m2"),
            lambda: fp8.block_amax(w, (32, 1)), lambda: fp8.expand_blocks(grid, (1, 32), (3, 64)),
            lambda: fp8.Quantized(x[0], grid, (1, 32)).dequantize(), lambda: fp8.on_host(grid),
            lambda: fp8.Fp8Gemms(recipe).inputs(["x"], [x]), lambda: fp8.Fp8Gemms(recipe).output_grads(["dy"], [dy]),
            lambda: fp8.Fp8Gemms(recipe).weights(["w"], [w], -1)]


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_recipes_on_fake_device_arrays_reach_device_work(recipe):
    """Every stage of the FP8 emulation (rounding, scales, blocks, dequantization, the GEMM operands) on CuPy arrays
    gets past numpy's and CuPy's Python-level checks (no float8 or e8m0 dtype, no np.asarray of a device array) to
    its first kernel, which a fake array cannot run. The arithmetic itself is the numpy path's (tests/test_fp8.py)."""
    cupy = fake_cupy()
    x, w, dy = (fake_device_array(cupy, a) for a in fp8_operands(np.random.default_rng(4)))
    for index, stage in enumerate(fp8_stages(cupy, x, w, dy, recipe)):
        with pytest.raises(device_work_error(cupy)):
            stage()
            pytest.fail(f"stage {index} ran without device work")


@needs_gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_operands_on_the_gpu_are_numpys_values(recipe):
    """On a GPU: the dequantized GEMM operands of each recipe (input e4m3, output gradient e5m2, weight e4m3) from
    CuPy arrays equal the numpy path's bit for bit, and the recorded scales agree."""
    import cupy

    from mpitrain.layers import fp8

    host = fp8_operands(np.random.default_rng(4))
    device = [cupy.asarray(a) for a in host]
    results = []
    for x, w, dy in (host, device):
        gemms = fp8.Fp8Gemms(recipe)
        operands = gemms.inputs(["x"], [x]) + gemms.output_grads(["dy"], [dy]) + gemms.weights(["w"], [w], -1)
        results.append(([fp8.on_host(a) for a in operands], gemms.scales))
    (expected, expected_scales), (got, got_scales) = results
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(g, e)
    assert got_scales == expected_scales


# ---- two-level collectives on fake device arrays ------------------------------------------------------------------
class PendingLevel:
    """One level of a two-level group that records the arrays it is handed; its operations never land, so a
    two-level operation stops after its first stage (fake device arrays can do no device work)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank, self.handed = size, rank, []

    def _record(self, *arrays):
        self.handed += arrays
        return SimpleNamespace(test=lambda: False, wait=lambda: None)

    def ireduce_scatter(self, send, recv, op="sum"):
        return self._record(send, recv)

    def iall_gather(self, send, recv):
        return self._record(send, recv)


def test_two_level_scratch_buffers_are_made_on_the_device():
    """TwoLevelGroup's pieces and padding are made where the gradients live: each level is handed device arrays
    (np.empty there would hand it host buffers), and the reduce-scatter's node-major reorder is device work."""
    cupy = fake_cupy()
    flat = SimpleNamespace(name="dp", rank=1, size=4, world_ranks=[0, 1, 2, 3])
    levels = []
    with host_allocator(cupy):
        for operation in ("iall_reduce", "iall_gather"):
            inside, across = PendingLevel(2, 1), PendingLevel(2, 0)
            group = TwoLevelGroup(flat, inside, across, [0, 2, 1, 3])
            send = fake_device_array(cupy, np.arange(8, dtype=np.float32))
            if operation == "iall_reduce":
                group.iall_reduce(send)
            else:
                group.iall_gather(send, fake_device_array(cupy, np.zeros(32, np.float32)))
            levels += [inside, across]
        with pytest.raises(device_work_error(cupy)):
            TwoLevelGroup(flat, PendingLevel(2, 1), PendingLevel(2, 0), [0, 2, 1, 3]).ireduce_scatter(
                send, fake_device_array(cupy, np.zeros(2, np.float32)))
    handed = [array for level in levels for array in level.handed]
    assert len(handed) == 4 and all(type(array) is cupy.ndarray for array in handed), [type(a) for a in handed]

# ---- the groups through the NCCL stand-in (one 4-rank job on two fake nodes) ------------------------------------
GROUPS_JOB = r"""
import json
import ml_dtypes
import numpy as np
from mpi4py import MPI
from mpitrain.comm.group import Group
from mpitrain.comm.mesh import Mesh
from mpitrain.comm.nccl import make_group_factory
from mpitrain.comm.nccl_group import NcclGroup
from mpitrain.comm.two_level import NodeShardGroup, TwoLevelGroup, node_major_order
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.parallel.context import GRAD_TAG, KV_TAG
from mpitrain.state.zero_quantized import QuantizedGradReducer, pack, split_messages, unpack

world = MPI.COMM_WORLD
rank = world.Get_rank()
nccl = make_group_factory("nccl", "cpu")
rng = np.random.default_rng(10 + rank)
out = {}


def mpi_twin(group):
    return Group(world.Split(min(group.world_ranks), rank), group.name)


def lane_messages(group, tag):
    return sum(len(c.issued) for (t, _, _), (c, _) in group._lanes.items() if t == tag)


# tp 2 inside each node, cp 2 across the nodes (hybrid: cp_inside has one rank, the ring runs on cp_across)
mesh = Mesh(world, tp=2, cp=2, split_by_node=("cp",), group_factory=nccl)
tp, across = mesh.tp, mesh.across_nodes["cp"]
out["nccl_groups"] = [isinstance(tp, NcclGroup), isinstance(across, NcclGroup)]
out["lane_tags"] = [sorted({t for t, _, _ in tp._lanes}), sorted({t for t, _, _ in across._lanes})]

before = lane_messages(tp, 61)
plain, over = TensorParallel(mpi_twin(tp), True), TensorParallel(tp, True, overlap=True)
for dtype in (np.float64, ml_dtypes.bfloat16):
    x, full = rng.standard_normal((2, 3, 4)).astype(dtype), rng.standard_normal((2, 6, 4)).astype(dtype)
    h, (y,) = over.enter_and_apply(x, lambda chunk: [chunk * 3])
    gathered = plain.enter(x)
    want = plain.exit(full.copy())
    got = over.exit_of(lambda positions: full[:, positions].copy(), 6)
    out[f"tp_overlap_bitwise_{np.dtype(dtype).name}"] = bool(
        np.array_equal(h, gathered) and np.array_equal(y, gathered * 3) and np.array_equal(got, want))
out["tp_lane_messages"] = lane_messages(tp, 61) - before

# tp 4: the ring wraps around (rank 3 -> 0 and 0 -> 3 share lanes with the neighbours' traffic), twice in a row
tp4 = Mesh(world, tp=4, group_factory=nccl, allow_cross_node_tp=True).tp
plain4, over4 = TensorParallel(Group(world.Dup(), "tp"), True), TensorParallel(tp4, True, overlap=True)
worst = 0.0
for _ in range(2):
    x, full = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 12, 4))
    h, (y,) = over4.enter_and_apply(x, lambda chunk: [chunk * 3])
    want = plain4.exit(full.copy())
    got = over4.exit_of(lambda positions: full[:, positions].copy(), 12)
    worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    out["tp4_gather_bitwise"] = bool(np.array_equal(h, plain4.enter(x)) and np.array_equal(y, h * 3))
out["tp4_ring_rel"] = worst

ring_mpi = mpi_twin(across)
peer = 1 - across.rank
before = [lane_messages(across, KV_TAG), lane_messages(across, GRAD_TAG)]
results = []
for group in (across, ring_mpi):
    got = []
    for tag in (KV_TAG, GRAD_TAG):
        block, received = np.random.default_rng(20 + rank + tag).standard_normal(10), np.zeros(10)  # same for both
        handles = [group.irecv(received, peer, tag), group.isend(block, peer, tag, kind="cp_ring")]
        for handle in handles:
            handle.wait()
        got.append(received)
    results.append(got)
out["cp_ring_equal"] = all(np.array_equal(a, b) for a, b in zip(*results))
out["cp_lane_messages"] = [lane_messages(across, KV_TAG) - before[0], lane_messages(across, GRAD_TAG) - before[1]]

# data parallelism over 4 ranks, 2 per node: both levels NCCL groups
dp_mesh = Mesh(world, dp=4, split_by_node=("dp",), group_factory=nccl)
flat, inside, across_dp = dp_mesh.dp, dp_mesh.inside_node["dp"], dp_mesh.across_nodes["dp"]
reference = Group(world.Dup(), "dp")
out["dp_levels_nccl"] = [isinstance(g, NcclGroup) for g in (flat, inside, across_dp)]
two_level = TwoLevelGroup(flat, inside, across_dp, node_major_order(flat.world_ranks, dp_mesh.nodes))
data = np.random.default_rng(30 + rank).standard_normal(4 * 6)
summed, scattered, gathered = data.copy(), np.zeros(6), np.zeros(4 * 6)
reference.all_reduce(summed)
reference.reduce_scatter(data.copy(), scattered)
reference.all_gather(data[:6].copy(), gathered)
a, b, c = data.copy(), np.zeros(6), np.zeros(4 * 6)
handles = [two_level.iall_reduce(a), two_level.ireduce_scatter(data.copy(), b),
           two_level.iall_gather(data[:6].copy(), c)]
for handle in handles:
    handle.wait()
out["two_level_rel"] = max(float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                           for got, want in ((a, summed), (b, scattered)))
out["two_level_gather_bitwise"] = bool(np.array_equal(c, gathered))
node_shard = NodeShardGroup(inside, across_dp)
shard = np.zeros(12)
node_shard.ireduce_scatter(data.copy(), shard).wait()
out["node_shard_rel"] = float(np.max(np.abs(shard - summed.reshape(2, 12)[inside.rank])) / np.max(np.abs(summed)))
out["across_counted"] = across_dp.counters(exact=True)["all_reduce"] > 0

# quantized ZeRO's messages on the NCCL dp group against the MPI group: the same bytes, so the same numbers
send = np.random.default_rng(40 + rank).standard_normal(4 * 50)
for codec in ("int8", "int4", "fp8"):
    sums = [QuantizedGradReducer(group, np.float64, codec, 16).reduce_scatter(send.copy()).wait()
            for group in (flat, reference)]
    message = pack(send[:50], 16, codec)
    gathered = []
    for group in (flat, reference):
        received = np.empty(4 * message.size, np.uint8)
        group.iall_gather(message, received).wait()
        gathered.append(np.concatenate([unpack(m, 50, 16, codec) for m in split_messages(received, 4)]))
    out[f"quantized_{codec}_equal"] = bool(np.array_equal(*sums) and np.array_equal(*gathered))
rows = world.gather(out)
if rank == 0:
    print("RESULTS " + json.dumps(rows))
"""


@pytest.fixture(scope="module")
def group_results():
    return run_python_mpi_results(4, GROUPS_JOB, timeout=180, env={STANDIN_ENV: "1", "MPITRAIN_FAKE_NODES": "2"})


def test_rings_of_tp_overlap_and_hybrid_cp_travel_on_nccl_lanes(group_results):
    for row in group_results:
        assert row["nccl_groups"] == [True, True]
        assert row["lane_tags"] == [[RING_TAG], [KV_TAG, GRAD_TAG]]
        assert row["tp_overlap_bitwise_float64"] and row["tp_overlap_bitwise_bfloat16"]
        assert row["tp_lane_messages"] == 8, row  # 2 dtypes x (a gather and a reduce) x (one send, one receive)
        assert row["cp_ring_equal"] and row["cp_lane_messages"] == [2, 2], row
        assert row["tp4_gather_bitwise"] and row["tp4_ring_rel"] < 1e-12, row


def test_two_level_groups_and_quantized_messages_over_nccl_groups(group_results):
    for row in group_results:
        assert row["two_level_rel"] < 1e-12 and row["node_shard_rel"] < 1e-12, row
        assert row["dp_levels_nccl"] == [True, True, True], row
        assert row["two_level_gather_bitwise"] and row["across_counted"], row
        assert all(row[f"quantized_{codec}_equal"] for codec in ("int8", "int4", "fp8")), row


# ---- float64 training through the stand-in against one process --------------------------------------------------
def standin_run(run_dir, *overrides):
    """A 4-rank run on two fake nodes through the NCCL stand-in; checks the run says so."""
    settings = ["data.synthetic=true", "precision.compute=float64", f"train.steps={PARITY_STEPS}",
                "train.eval_batches=1", "train.collectives=nccl", *ARCH["llama"], *overrides]
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(4, args, timeout=300, env={STANDIN_ENV: "1", "MPITRAIN_FAKE_NODES": "2"})
    assert result.returncode == 0, describe(result)
    assert "collectives: nccl host stand-in" in result.stdout, describe(result)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, final_params(run_dir)


@pytest.fixture(scope="module")
def single_llama(tmp_path_factory):
    return one_process_run(1, tmp_path_factory.mktemp("single-llama"), *ARCH["llama"])


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true", "parallel.cp=2",
     "parallel.cp_kind=hybrid"],
    ["parallel.zero=3", "parallel.dp_reduce=two_level", "train.micro_batch=1"],
    ["parallel.zero=2", "parallel.zero_shard=node", "train.micro_batch=1"],
], ids=["tp_overlap-tp2-x-hybrid-cp2", "two_level-zero3-dp4", "node-sharded-zero2-dp4"])
def test_new_features_through_nccl_groups_match_one_process(tmp_path, single_llama, overrides):
    assert_same_run(single_llama, standin_run(tmp_path / "run", *overrides), " ".join(overrides))


# ---- what the device check runs of these features (benchmarks/gpu_check.py) ---------------------------------------
def test_the_device_check_runs_these_features():
    """The layouts of gpu_check's features stage are valid on cuda with 4 ranks, and the device tests it names here
    exist, so the next machine with a GPU runs them instead of failing on a stale name."""
    from tests.test_gpu_check import gpu_check
    for settings in gpu_check.FEATURE_RUNS.values():
        cfg = load_config("configs/tiny.toml", ["train.device=cuda", "train.collectives=nccl", *settings])
        assert cfg.train.device == "cuda"
    named = [name.split("::")[1] for name in gpu_check.GPU_TESTS if name.startswith("tests/test_gpu_new_features.py")]
    assert named and all(name in globals() for name in named)
    assert gpu_check.plan(["features"])[-1].key == "features"
