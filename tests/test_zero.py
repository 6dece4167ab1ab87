"""ZeRO-1/2/3: exact against one process, and state memory and traffic as the formulas say."""
from __future__ import annotations

import numpy as np
import pytest

from mpitrain.backend import make_backend, nbytes_of
from mpitrain.config import load_config
from mpitrain.model.gpt import GPT
from mpitrain.plan.memory import activation_bytes, memory_report
from mpitrain.state.replicated import ReplicatedState
from tests.mpi_helpers import run_python_mpi_results
from tests.test_train_parity import assert_same_run, dataset, train_run  # noqa: F401 (fixture)

# 3 heads of 10 and a 259-token vocabulary: a parameter count that neither 4 nor (for some units) 4 divides.
ODD = ["model.d_model=30", "model.n_head=3", "model.vocab_size=259", "model.seq_len=24"]


@pytest.mark.parametrize("extra", [[], ODD], ids=["tiny", "odd-sizes"])
def test_every_zero_stage_matches_the_single_process(tmp_path, dataset, extra):
    single = train_run(1, tmp_path / "single", dataset, "train.micro_batch=1", *extra)
    for stage in (1, 2, 3):
        for dp in (2, 4):
            run = train_run(dp, tmp_path / f"z{stage}dp{dp}", dataset, "train.micro_batch=1",
                            f"parallel.zero={stage}", *extra)
            assert_same_run(single, run)


def test_odd_sizes_really_need_padding():
    cfg = load_config("configs/tiny.toml", ODD)
    sizes = [layout.size for layout in GPT(cfg.model, make_backend("cpu", "float64")).layouts]
    assert sum(sizes) % 4 and any(size % 4 for size in sizes), sizes


@pytest.mark.parametrize("overrides", [["model.arch=llama", "model.n_kv_head=2"],
                                       ["parallel.reshard_after_forward=false"],
                                       ["parallel.overlap=false"]], ids=["llama", "keep-params", "no-overlap"])
def test_zero3_variants_match_the_single_process(tmp_path, dataset, overrides):
    single = train_run(1, tmp_path / "single", dataset, *overrides)
    assert_same_run(single, train_run(2, tmp_path / "z3", dataset, "parallel.zero=3", *overrides))


@pytest.mark.parametrize("stage, reshard, factor", [(0, True, 2), (1, True, 2), (2, True, 2), (3, True, 3),
                                                    (3, False, 2)])
def test_traffic_per_step_is_k_times_n_minus_1_over_n_psi(tmp_path, dataset, stage, reshard, factor):
    """Plain DP, ZeRO-1 and ZeRO-2 move 2(N-1)/N Psi bytes per rank and step, ZeRO-3 3(N-1)/N Psi (1.5x)."""
    n = 4
    metrics, params = train_run(n, tmp_path / "run", dataset, "train.steps=2", "train.micro_batch=2",
                                f"parallel.zero={stage}", f"parallel.reshard_after_forward={str(reshard).lower()}")
    psi = sum(v.size for v in params.values()) * 8
    expected = factor * (n - 1) / n * psi
    for record in metrics:
        moved = sum(v for k, v in record["comm_bytes"].items() if k != "control")
        assert moved == pytest.approx(expected, rel=0.01), record["comm_bytes"]


MEMORY_JOB = """
import json
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.mesh import Mesh
from mpitrain.config import load_config, resolve_layout
from mpitrain.model.gpt import GPT
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.factory import make_state
world = MPI.COMM_WORLD
out = {}
for stage in (0, 1, 2, 3):
    cfg = load_config("configs/bench-small.toml", [f"parallel.zero={stage}", "train.micro_batch=1",
                                                   f"train.global_batch={world.size}", "precision.compute=COMPUTE"])
    resolve_layout(cfg, world.size)
    backend = make_backend("cpu", "COMPUTE")
    model = GPT(cfg.model, backend)
    state = make_state(cfg, model, backend, Mesh(world, dp=world.size))
    optimizer = AdamW(state.optimizer_segments(), AdamWHyper())
    held = state.memory()
    out[stage] = {"total": sum(held.values()) + optimizer.state_nbytes(), "psi": model.n_params}
if world.rank == world.size - 1:
    print("RESULTS " + json.dumps(out))
"""


# bytes per parameter kept between steps: (whole, sharded over N) per ZeRO stage, as mpitrain/plan/memory.py says
STATE_BYTES = {"float32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},  # the params are the master
               "bfloat16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}}  # 2 + 2 + fp32 master, m, v


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_state_memory_per_rank_falls_as_the_formulas_say(n, compute):
    """Bytes of the arrays a rank really holds (params, grads, master, moments) against the formulas: at bfloat16
    16 Psi (ZeRO-0), 4 + 12/N (ZeRO-1), 2 + 14/N (ZeRO-2), 16/N (ZeRO-3) bytes per parameter; and what
    `mpitrain memory` prints for the same layout."""
    measured = {int(k): v for k, v in run_python_mpi_results(n, MEMORY_JOB.replace("COMPUTE", compute),
                                                             timeout=120).items()}
    psi = measured[0]["psi"]
    padding = 4 * 4 * n * (4 + 2)  # at most n-1 padding elements per unit, 6 units, in 4 arrays of 4 bytes
    for stage, (whole, sharded) in STATE_BYTES[compute].items():
        expected = (whole + sharded / n) * psi
        total = measured[stage]["total"]
        assert expected <= total <= expected + padding, (stage, total, expected)
        cfg = load_config("configs/bench-small.toml", [f"parallel.zero={stage}", f"precision.compute={compute}"])
        cfg.parallel.dp = n
        report = memory_report(cfg, psi)
        assert report["bytes"]["state"] == pytest.approx(expected, rel=1e-12)
        printed = " + ".join(([str(whole)] if whole else []) + ([f"{sharded}/N"] if sharded else []))
        assert report["formulas"]["state"] == printed + " bytes per parameter"


def test_activation_estimate_is_what_the_saved_state_holds():
    for overrides in ([], ["model.arch=llama", "model.n_kv_head=2"]):
        cfg = load_config("configs/tiny.toml", ["precision.compute=float64", *overrides])
        backend = make_backend("cpu", "float64")
        model = GPT(cfg.model, backend)
        state = ReplicatedState(model.layouts, backend, 0)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 256, (cfg.train.micro_batch, cfg.model.seq_len))
        _, saved = model.forward(state, tokens, rng.integers(0, 256, tokens.shape))
        assert nbytes_of(saved) == activation_bytes(cfg), overrides


FROZEN_JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import make_backend
from mpitrain.comm.group import Group
from mpitrain.optim.adamw import AdamW, AdamWHyper
from mpitrain.state.params import ParamSpec, UnitLayout
from mpitrain.state.replicated import ReplicatedState
from mpitrain.state.zero import ZeroState
group = Group(MPI.COMM_WORLD, "dp")
backend = make_backend("cpu", "COMPUTE")
out = {}
for stage in (0, 1, 2, 3):
    layouts = [UnitLayout(f"u{i}", [ParamSpec("w", (5, 3), "normal", 0.1),
                                    ParamSpec("base", (7, 3), "normal", 0.1, trainable=False)]) for i in range(2)]
    state = (ReplicatedState(layouts, backend, 0, group) if stage == 0 else
             ZeroState(layouts, backend, 0, group, stage))
    optimizer = AdamW(state.optimizer_segments(), AdamWHyper())
    before = {u: {k: np.array(v, dtype=np.float64) for k, v in state.acquire(u, "forward").items()} for u in (0, 1)}
    state.zero_grads()
    state.begin_micro_batch(last=True)
    names = set()
    for u in (1, 0):
        names |= set(state.acquire(u, "backward"))
        grads = state.grad_views(u)
        assert set(grads) == {"w"}, grads.keys()
        grads["w"][...] = 1.0
        state.release(u, "backward")
        state.unit_done(u)
    state.finish()
    optimizer.step(1e-2)
    state.after_step()
    after = {u: {k: np.array(v, dtype=np.float64) for k, v in state.acquire(u, "forward").items()} for u in (0, 1)}
    out[stage] = {"names": sorted(names), "moments": int(optimizer.exp_avg.size), "grads": state.memory()["grads"],
                  "frozen_same": all(np.array_equal(before[u]["base"], after[u]["base"]) for u in (0, 1)),
                  "trained": all(not np.array_equal(before[u]["w"], after[u]["w"]) for u in (0, 1)),
                  "checkpointed": sum(u.size for u in state.checkpoint_layout().frozen.layouts),
                  "params": state.memory()["params"]}
if group.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("compute", ["float64", "bfloat16"])
def test_frozen_tensors_get_no_gradient_no_optimizer_state_and_stay_put(compute):
    """Two units of a trained (5, 3) and a frozen (7, 3) tensor on 2 ranks: stages 0-2 hold the frozen ones whole,
    stage 3 its shard of each (11 of 22 padded elements), gathered for forward and backward and never changed."""
    n, trainable, frozen, itemsize = 2, 2 * 15, 2 * 21, {"float64": 8, "bfloat16": 2}[compute]
    for stage, held in run_python_mpi_results(n, FROZEN_JOB.replace("COMPUTE", compute)).items():
        assert held["names"] == ["base", "w"] and held["frozen_same"] and held["trained"], (stage, held)
        shards = 1 if stage == "0" else n
        assert held["moments"] <= trainable // shards + 2 * (n - 1), (stage, held)  # padding: n-1 per unit
        assert held["grads"] <= (trainable // (n if stage in "23" else 1) + 2 * (n - 1)) * itemsize, (stage, held)
        assert held["checkpointed"] == frozen
        # ZeRO-3 shards the frozen tensors as the parameters (each unit padded to a multiple of n): 1/n per rank
        whole = (trainable + (2 * (n - 1) if stage != "0" else 0) + frozen) * itemsize
        assert held["params"] == (whole if stage != "3" else (2 * 8 + 2 * 11) * itemsize), (stage, held)


HELD_GRADS_JOB = """
import json
import numpy as np
from mpi4py import MPI
from mpitrain.backend import nbytes_of
from mpitrain.config import load_config
from mpitrain.train import Trainer
world = MPI.COMM_WORLD
out = {}
for lora in (False, True):
    overrides = ["data.synthetic=true", "logging.peak_flops=1e9", "parallel.pp=2", "parallel.dp=2",
                 "parallel.zero=3", "train.micro_batch=1", "train.global_batch=8"] + (LORA if lora else [])
    trainer = Trainer(load_config("configs/tiny.toml", overrides), world)
    zero, model, held = trainer.state, trainer.pipeline.model, []
    backward = model.backward

    def counting_backward(*args, **kwargs):
        result = backward(*args, **kwargs)  # one chunk of one micro-batch: its units are done
        held.append(zero.grads.nbytes + nbytes_of([buffer.data for buffer in zero.grads.in_backward.values()]))
        return result

    model.backward = counting_backward
    trainer.train_step(0)
    full = zero.geometry.size * np.dtype(zero.backend.dtype).itemsize  # the whole trainable gradient, what DP holds
    out[str(lora)] = world.gather((held, zero.grads.nbytes, full, trainer.accumulation))
if world.rank == 0:
    print("RESULTS " + json.dumps(out))
"""


def test_lora_under_zero3_and_pp_frees_each_micro_batch_gradient_as_zero3_does():
    """Frozen tensors (LoRA's base) must not change how often a sharding state reduces: under ZeRO-3 every
    micro-batch's gradient is reduce-scattered and freed as its backward ends, so a rank holds only its gradient
    shard after each one, with LoRA as without it; never the whole gradient data parallelism keeps."""
    from tests.test_lora import LORA
    results = run_python_mpi_results(4, HELD_GRADS_JOB.replace("LORA if", f"{LORA!r} if"), timeout=180)
    for lora, ranks in results.items():
        for held, shard, full, micro_batches in ranks:
            assert len(held) == micro_batches > 1, (lora, held)
            assert held == [shard] * micro_batches and shard < full, (lora, held, shard, full)
