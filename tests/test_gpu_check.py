"""benchmarks/gpu_check.py without a GPU: the default plan fits its budget, --stages/--sizes select, the stage
processes' environment, a stage that does not fit is "not reached" (not FAILED), a timed-out stage's processes all
end, and the NCCL stage itself, run on numpy through the host stand-in of cupy.cuda.nccl (MPITRAIN_NCCL_STANDIN=1):
every check passes there, and a group with a wrong count fails its check.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mpitrain.backend import BFLOAT16, nbytes_of
from mpitrain.comm.nccl import STANDIN_ENV
from mpitrain.layers import ops

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(gpu_check)


def keys(stages) -> list[str]:
    return [stage.key for stage in stages]


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


# ---- the plan ------------------------------------------------------------------------------------------------------
def test_the_default_plan_fits_its_budget_and_settles_the_most_first():
    stages = gpu_check.plan()
    assert keys(stages) == ["environment", "gpu-tests", "attention", "nccl", "cpu-reference", "gpu-parity",
                            "bench-1.3b", "dp2-staged", "cp2-staged", "features"]
    # the MFU verdict and everything before it start even if every earlier stage runs to its limit
    sure = gpu_check.sure_to_start(stages)
    assert sure == keys(stages)[:-2]
    assert sum(stage.limit_s for stage in stages if stage.key in sure) <= gpu_check.BUDGET_S
    assert set(gpu_check.BENCH_LIMIT_S) == set(gpu_check.MODELS)
    assert gpu_check.MFU_GOAL == 0.40


def test_only_what_fits_after_every_earlier_limit_is_sure_to_start():
    stage = gpu_check.Stage
    stages = [stage("a", 100, ""), stage("b", 300, ""), stage("c", 60, ""), stage("d", 10, "")]
    assert gpu_check.sure_to_start(stages, budget_s=450) == ["a", "b"]
    assert gpu_check.sure_to_start(stages, budget_s=460) == ["a", "b", "c"]


def test_stages_and_sizes_select_with_what_they_need():
    assert keys(gpu_check.plan(["nccl"])) == ["environment", "nccl"]
    assert keys(gpu_check.plan(["dp2-staged", "gpu-parity"])) == ["environment", "cpu-reference", "gpu-parity",
                                                                  "dp2-staged"]
    assert keys(gpu_check.plan(["bench"], ["125M", "350m"])) == ["environment", "bench-125m", "bench-350m"]
    assert keys(gpu_check.plan(["nccl"], ["125m"])) == ["environment", "nccl"]  # sizes only pick bench models
    with pytest.raises(ValueError, match="unknown stage"):
        gpu_check.plan(["ncl"])
    with pytest.raises(ValueError, match="unknown size"):
        gpu_check.plan(None, ["7b"])


def test_dry_run_prints_the_selected_plan_and_runs_nothing(tmp_path):
    done = run_script("--dry-run", "--stages", "bench", "--sizes", "125m,350m", "--work", str(tmp_path))
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert listed == ["environment", "bench-125m", "bench-350m"]
    assert "limits add up to 160 s of a 450 s budget\n" in done.stdout
    assert not list(tmp_path.iterdir())
    default = run_script("--dry-run")
    listed = [line.split()[0] for line in default.stdout.splitlines() if line.startswith("  ")]
    assert listed == keys(gpu_check.plan())
    assert "  attention        45 s  fused attention = cuBLAS's in bf16 (within 0.02 of the largest value)" in (
        default.stdout)
    assert ("limits add up to 570 s of a 450 s budget; cp2-staged, features: started only if the stages before leave "
            "the time, else not reached\n") in default.stdout
    assert keys(gpu_check.plan(["attention"])) == ["environment", "attention"]
    assert run_script("--dry-run", "--stages", "gpu").returncode == 2  # argparse's error: unknown stage


def test_the_shell_script_passes_its_arguments_on():
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--stages", "nccl"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")] == ["environment", "nccl"]


def test_a_skipped_gpu_test_fails_the_gpu_tests_stage_but_not_a_test_meant_for_machines_without_one():
    output = "\n".join([
        "SKIPPED [4] tests/test_gpu_kernels.py:85: fused kernels need a CUDA GPU: CuPy sees no CUDA device",
        "SKIPPED [1] tests/test_gpu_paths.py:58: a GPU is usable here: the GPU tests check this path on real arrays",
        "30 passed, 5 skipped in 6.08s"])
    assert gpu_check.unexpected_skips(output) == [output.splitlines()[0]]
    assert {"tests/test_gpu_paths.py", "tests/test_cudnn_graphs.py"} <= set(gpu_check.GPU_TESTS)


# ---- the stage processes -----------------------------------------------------------------------------------------
def test_stage_processes_get_the_repository_before_an_existing_pythonpath(monkeypatch):
    env = gpu_check.subprocess_env({"PYTHONPATH": "/carried/site-packages", "OMP_NUM_THREADS": "2"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/carried/site-packages"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMP_NUM_THREADS"] == "2"  # what the caller set wins over the defaults
    assert gpu_check.subprocess_env({})["PYTHONPATH"] == str(REPO_ROOT)
    monkeypatch.setenv("PYTHONPATH", "/carried/site-packages")
    names = ("PYTHONPATH", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "CUPY_CACHE_DIR")
    show = f"import json, os; print(json.dumps({{name: os.environ.get(name) for name in {names!r}}}))"
    status, output = gpu_check.run([sys.executable, "-c", show], 60)
    seen = json.loads(output)
    assert status == 0
    assert seen["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/carried/site-packages"]
    assert seen["OMPI_ALLOW_RUN_AS_ROOT"] == seen["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert seen["CUPY_CACHE_DIR"]  # one kernel cache for every stage


def test_a_timed_out_stage_ends_its_whole_session(tmp_path):
    """mpiexec's ranks are its children: killing mpiexec alone would leave them holding the GPU."""
    pid_file = tmp_path / "grandchild.pid"
    parent = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        child.wait()
    """)
    status, output = gpu_check.run([sys.executable, "-c", parent], 3)
    assert status == 124 and "timed out" in output
    pid = int(pid_file.read_text())
    for _ in range(100):  # the kill is sent; its delivery and the reaping are not instant
        if not alive(pid):
            break
        time.sleep(0.1)
    assert not alive(pid), f"process {pid} of the timed-out stage is still running"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# ---- verdicts --------------------------------------------------------------------------------------------------------
def test_a_stage_that_does_not_fit_the_budget_is_not_reached_not_failed():
    now = [0.0]
    stage = gpu_check.Stage
    stages = [stage("environment", 10, ""), stage("cpu-reference", 30, ""),
              stage("gpu-parity", 45, "", ("cpu-reference",)), stage("bench-1.3b", 140, "")]
    spent = {"environment": 5, "cpu-reference": 25, "gpu-parity": 40}

    def body_of(chosen):
        def body(limit_s):
            now[0] += spent[chosen.key]
            return {"passed": True}
        return body

    results = gpu_check.run_plan(stages, body_of, budget_s=100, clock=lambda: now[0])
    assert [r["verdict"] for r in results.values()] == ["passed", "passed", "passed", "not reached"]
    status, line = gpu_check.verdict(results)
    assert status == 2
    assert line.startswith("GPU CHECK INCOMPLETE") and "--stages bench --sizes 1.3b" in line
    assert "bench-1.3b: not reached" in gpu_check.summary(results)


def test_a_stage_whose_input_failed_is_blocked_and_the_check_fails():
    stage = gpu_check.Stage
    stages = [stage("cpu-reference", 30, ""), stage("gpu-parity", 45, "", ("cpu-reference",))]
    results = gpu_check.run_plan(stages, lambda chosen: lambda limit_s: {"passed": False}, budget_s=450)
    assert [r["verdict"] for r in results.values()] == ["FAILED", "blocked"]
    assert gpu_check.verdict(results) == (1, "GPU CHECK FAILED: cpu-reference; blocked by them: gpu-parity")


def test_the_summary_gives_both_attention_paths_and_each_shape_in_one_line_per_stage():
    shape = attention_check.ATTENTION_SHAPES[0].name
    results = {
        "environment": {"verdict": "passed", "cudnn": "frontend 1.32.0, library 92801"},
        "attention": {"verdict": "FAILED", "worst_error": 0.03, "parity_limit": 0.02,
                      "per_shape": {shape: "max error 3.0e-02, fused 2.50x faster"},
                      "failed_shapes": {shape: {"dq": 0.03}}, "shapes": {shape: {"ms": {}}}},
        "bench-1.3b": {"verdict": "FAILED", "mfu": 0.41, "mfu_cublas": 0.30, "fused_step_speedup": 1.2,
                       "tokens_per_s_cublas": 34000.0, "switch_error": "MPITRAIN_ATTENTION=cublas ran cudnn",
                       "breakdown_cublas": {"forward": 0.1}},
    }
    lines = dict(line.strip().split(": ", 1) for line in gpu_check.summary(results).splitlines()[1:])
    assert "frontend 1.32.0" in lines["environment"]
    shown = json.loads(lines["attention"].removeprefix("FAILED "))
    assert shown == {"worst_error": 0.03, "parity_limit": 0.02, "per_shape": results["attention"]["per_shape"],
                     "failed_shapes": results["attention"]["failed_shapes"]}  # not every shape's record
    shown = json.loads(lines["bench-1.3b"].removeprefix("FAILED "))
    assert shown == {key: value for key, value in results["bench-1.3b"].items()
                     if key not in ("verdict", "breakdown_cublas")}


def test_finish_command_runs_what_was_not_reached():
    assert gpu_check.finish_command(["cp2-staged", "bench-125m", "bench-1.3b"]) == (
        "bash benchmarks/gpu_check.sh --stages cp2-staged,bench --sizes 125m,1.3b")
    assert keys(gpu_check.plan(["cp2-staged", "bench"], ["125m", "1.3b"])) == [
        "environment", "cpu-reference", "bench-125m", "bench-1.3b", "cp2-staged"]


# ---- the fused-attention stage -------------------------------------------------------------------------------------
attention_check = importlib.import_module("gpu_check_attention")  # beside gpu_check, which put it on sys.path


def test_the_attention_stage_covers_gpt2_and_llama_shapes_at_1024_and_4096_tokens():
    shapes = {(s.model, s.heads, s.kv_heads, s.head_dim, s.tokens) for s in attention_check.ATTENTION_SHAPES}
    assert shapes == {(model, heads, kv, d, t) for model, heads, kv, d in (("gpt2", 12, 12, 64), ("llama", 8, 2, 64),
                                                                           ("llama", 8, 2, 128)) for t in (1024, 4096)}
    assert attention_check.PARITY_LIMIT == 2e-2
    assert attention_check.PATHS == ("cudnn", "cublas")


def test_the_error_is_the_largest_difference_relative_to_the_largest_value():
    rng = np.random.default_rng(0)
    want = rng.standard_normal((16, 32))
    largest = np.abs(want).max()
    assert attention_check.relative_to_largest(want.copy(), want) == 0.0
    for planted in (0.01, 0.05):  # one element off by `planted` of the largest value, anywhere, either sign
        got = want.copy()
        got[3, 7] -= planted * largest
        assert attention_check.relative_to_largest(got, want) == pytest.approx(planted)
        assert attention_check.relative_to_largest(1e3 * got, 1e3 * want) == pytest.approx(planted)  # any scale
    near_zero = np.argmin(np.abs(want))
    got = want.copy()
    got.flat[near_zero] += 1e-3 * largest  # huge relative to that element, small against the tensor
    assert attention_check.relative_to_largest(got, want) == pytest.approx(1e-3)
    got.flat[0] = np.nan
    assert attention_check.relative_to_largest(got, want) == math.inf
    assert attention_check.relative_to_largest(want, np.where(want > 0, np.inf, want)) == math.inf
    assert attention_check.relative_to_largest(np.zeros(4), np.zeros(4)) == 0.0
    assert attention_check.relative_to_largest(np.ones(4), np.zeros(4)) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        attention_check.relative_to_largest(want, want.T)


def attention_results(q, k, v, dout, bias):
    """out, dq, dk, dv of the project's numpy attention (the CPU path), as float32."""
    (out, _), saved = ops.attention_forward(q, k, v, bias)
    grads = ops.attention_backward(saved, dout)
    return {name: np.asarray(array, np.float32) for name, array in zip(("out", "dq", "dk", "dv"), (out, *grads))}


def test_bf16_rounding_passes_the_parity_limit_and_a_forgotten_mask_or_a_wrong_gradient_fails_it():
    rng = np.random.default_rng(1)
    b, h, kv, t, d = 2, 4, 2, 48, 16  # grouped-query, as llama's
    q, dout = (rng.standard_normal((b, h, t, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, kv, t, d)) for _ in range(2))
    reference = attention_results(q, k, v, dout, ops.causal_bias(t, t, np, np.float64))
    low = [array.astype(BFLOAT16) for array in (q, k, v, dout)]
    bf16 = attention_results(*low, ops.causal_bias(t, t, np, BFLOAT16))
    errors = attention_check.parity_errors(bf16, reference)
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert 0 < max(errors.values()) < attention_check.PARITY_LIMIT / 2, errors
    assert attention_check.within_limit(errors)
    unmasked = attention_results(*low, np.zeros((t, t), BFLOAT16))  # a fused path that forgot it is causal
    assert not attention_check.within_limit(attention_check.parity_errors(unmasked, reference))
    wrong_dk = {**bf16, "dk": bf16["dk"] * 1.05}
    errors = attention_check.parity_errors(wrong_dk, reference)
    assert errors["dk"] > attention_check.PARITY_LIMIT and not attention_check.within_limit(errors)
    assert not attention_check.within_limit({**errors, "dk": math.nan})


def test_the_attention_verdict_needs_every_shape_within_the_limit():
    shapes = attention_check.ATTENTION_SHAPES[:2]
    times = {"cudnn": {"forward": 1.0, "backward": 3.0}, "cublas": {"forward": 4.0, "backward": 6.0}}
    speedup = attention_check.speedups(times)
    assert speedup == {"forward": 4.0, "backward": 2.0, "both": 2.5}

    def record(shape, error):
        errors = {"out": 1e-3, "dq": error, "dk": 2e-3, "dv": 2e-3}
        return {"shape": shape.name, "errors": errors, "passed": attention_check.within_limit(errors),
                "speedup": speedup}

    good = [record(shape, 4e-3) for shape in shapes]
    result = attention_check.attention_verdict(0, good, shapes)
    assert result["passed"] and result["worst_error"] == 4e-3 and "failed_shapes" not in result
    assert result["per_shape"][shapes[0].name] == (
        "max error 4.0e-03, fused 2.50x faster (forward 4.00x, backward 2.00x)")
    planted = [good[0], record(shapes[1], 3e-2)]
    result = attention_check.attention_verdict(0, planted, shapes)
    assert not result["passed"] and list(result["failed_shapes"]) == [shapes[1].name]
    assert result["worst_error"] == 3e-2
    result = attention_check.attention_verdict(0, good[:1], shapes)
    assert not result["passed"] and result["failed_shapes"] == {shapes[1].name: "not run"}
    assert not attention_check.attention_verdict(1, good, shapes)["passed"]  # the process failed


def test_which_path_ran_is_read_off_what_attention_saved():
    t, d = 40, 8
    q = np.ones((1, 2, t, d), np.float32)
    _, numpy_saved = ops.attention_forward(q, q, q, ops.causal_bias(t, t, np, np.float32))
    assert attention_check.ran_path(numpy_saved, t) == "cublas"  # it keeps the probabilities, as cuBLAS's path
    fused_saved = {"q": q, "k": q, "v": q, "out": q, "stats": np.ones((1, 2, t, 1), np.float32), "causal": True}
    assert attention_check.ran_path(fused_saved, t) == "cudnn"
    assert attention_check.ran_path(fused_saved, d) == "cublas"  # T must not be a head width


class FakeCupy:
    """The few CuPy names shape_record uses, over numpy (events time nothing: every call takes "1 ms")."""
    float32 = np.float32
    asarray = staticmethod(np.asarray)
    asnumpy = staticmethod(np.asarray)

    class cuda:  # cupy.cuda
        class Event:
            def record(self):
                pass

            def synchronize(self):
                pass

        @staticmethod
        def get_elapsed_time(start, end):
            return 1.0 * attention_check.REPEATS


class FakeOps:
    """ops' attention switched by the stage's switch: "cublas" runs the numpy ops (which save the T x T
    probabilities, as the cuBLAS path does); "cudnn" runs `fused`, which saves q, k, v and the mask only."""
    def __init__(self, fused_bias=None, keeps_probs=False):
        self.fused_bias, self.keeps_probs = fused_bias, keeps_probs

    @staticmethod
    def causal_bias(t_q, t_k, xp, dtype):
        return ops.causal_bias(t_q, t_k, np, dtype)  # xp is FakeCupy

    def attention_forward(self, q, k, v, bias):
        if os.environ[attention_check.ATTENTION_SWITCH] == "cublas":
            return ops.attention_forward(q, k, v, bias)
        bias = bias if self.fused_bias is None else self.fused_bias
        result, saved = ops.attention_forward(q, k, v, bias)
        return result, (saved if self.keeps_probs else ("fused", q, k, v, Mask(bias)))

    def attention_backward(self, saved, dout):
        if isinstance(saved[0], str):  # ("fused", q, k, v, Mask)
            saved = ops.attention_forward(*saved[1:4], saved[4].bias)[1]
        return ops.attention_backward(saved, dout)


class Mask:
    """The fused fake's mask, out of sight of ran_path (the real fused path keeps none)."""
    def __init__(self, bias):
        self.bias = bias


def test_a_shape_record_compares_the_fused_results_with_cublas_and_sees_a_fallback():
    shape = attention_check.AttentionShape("llama", 4, 2, 16, 2048)  # batch 4
    assert shape.batch == attention_check.TOKENS_PER_SHAPE // 2048
    small = shape._replace(tokens=32)
    record = attention_check.shape_record(FakeCupy, FakeOps(), nbytes_of, small)
    assert record["passed"] and max(record["errors"].values()) < 1e-6, record
    assert record["speedup"] == {"forward": 1.0, "backward": 1.0, "both": 1.0}
    assert record["saved_bytes"]["cudnn"] < record["saved_bytes"]["cublas"]
    unmasked = attention_check.shape_record(FakeCupy, FakeOps(fused_bias=np.zeros((32, 32), BFLOAT16)), nbytes_of,
                                            small)
    assert not unmasked["passed"] and unmasked["errors"]["out"] > attention_check.PARITY_LIMIT
    fell_back = attention_check.shape_record(FakeCupy, FakeOps(keeps_probs=True), nbytes_of, small)
    assert not fell_back["passed"]
    assert fell_back["error"] == "the switch did not take: MPITRAIN_ATTENTION=cudnn ran cublas"
    assert os.environ.get(attention_check.ATTENTION_SWITCH) is None  # the switch is put back


# ---- the bench stage -----------------------------------------------------------------------------------------------
bench_check = importlib.import_module("gpu_check_bench")


def bench_output(mfu_fused, mfu_cublas=0.30, cublas_error=None, fused_ran="cudnn"):
    cublas = {"error": cublas_error} if cublas_error else {"ran": "cublas", "step_time_s": 0.12,
                                                           "tokens_per_s": 34000.0, "mfu": mfu_cublas, "breakdown": {}}
    return "\n".join([
        "MODEL " + json.dumps({"n_params": 1_300_000_000}),
        "PATH " + json.dumps({"path": "cudnn", "ran": fused_ran, "step_time_s": 0.1, "tokens_per_s": 41000.0,
                              "mfu": mfu_fused, "breakdown": {}}),
        "MEMORY " + json.dumps({"pool_high_water_bytes": 30e9, "planned_bytes": 25e9, "planned": {}}),
        "PATH " + json.dumps({"path": "cublas", **cublas})])


def test_the_bench_reports_both_paths_and_the_1_3b_fused_run_settles_the_mfu_goal():
    result = bench_check.bench_verdict("1.3b", 0, bench_output(0.41))
    assert result["passed"] and result["mfu"] == 0.41 and result["mfu_cublas"] == 0.30
    assert result["fused_step_speedup"] == 1.2 and result["pool/planned"] == 1.2 and result["mfu_goal"] == 0.40
    assert result["n_params"] == 1_300_000_000
    assert not bench_check.bench_verdict("1.3b", 0, bench_output(0.39))["passed"]  # below the goal
    assert bench_check.bench_verdict("125m", 0, bench_output(0.25))["passed"]  # the goal is 1.3b's
    off_failed = bench_check.bench_verdict("1.3b", 0, bench_output(0.45, cublas_error="CUDARuntimeError: x"))
    assert not off_failed["passed"] and off_failed["error_cublas"] == "CUDARuntimeError: x"
    assert not bench_check.bench_verdict("1.3b", 1, bench_output(0.45))["passed"]
    fell_back = bench_check.bench_verdict("1.3b", 0, bench_output(0.45, fused_ran="cublas"))
    assert not fell_back["passed"] and fell_back["switch_error"] == "MPITRAIN_ATTENTION=cudnn ran cublas"
    settings = dict(setting.split("=", 1) for setting in bench_check.bench_settings("1.3b"))
    assert settings["precision.compute"] == "bfloat16" and settings["model.d_model"] == "2048"
    steps = len(bench_check.PATHS) * (bench_check.WARMUP_STEPS + bench_check.TIMED_STEPS)
    assert settings["train.steps"] == str(steps)


def test_the_bench_times_steps_through_the_trainer_on_the_cpu():
    """time_steps on configs/tiny.toml in float32 on the CPU: the Trainer's names it reads exist and add up."""
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.train import Trainer
    cfg = load_config(str(REPO_ROOT / "configs/tiny.toml"), ["data.synthetic=true", "train.steps=12",
                                                           "logging.peak_flops=1e12"])
    trainer = Trainer(cfg, MPI.COMM_SELF)
    report = bench_check.time_steps(trainer, bench_check.WARMUP_STEPS + bench_check.TIMED_STEPS)
    assert report["tokens_per_s"] == pytest.approx(trainer.tokens_per_step / report["step_time_s"])
    assert report["mfu"] == pytest.approx(trainer.model.flops_per_token() * report["tokens_per_s"] / 1e12)
    assert report["breakdown"]


# ---- the NCCL stage ----------------------------------------------------------------------------------------------
def test_the_nccl_stage_names_each_collective_on_fp32_and_bf16():
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send_recv"):
        assert name in gpu_check.NCCL_CHECKS
    assert gpu_check.NCCL_DTYPES == ("float32", "bfloat16")
    assert "nccl" in keys(gpu_check.plan())


def test_the_nccl_stage_passes_through_the_host_standin(monkeypatch):
    monkeypatch.setenv(STANDIN_ENV, "1")
    result = gpu_check.nccl(120)
    assert result["passed"], result
    assert result["group"] == "NcclGroup" and result["size"] == 1 and result["closed"]
    assert result["checks_passed"] == result["checks"] == len(gpu_check.NCCL_CHECKS) * len(gpu_check.NCCL_DTYPES)


SHORT_COUNT_GROUP = """
import importlib.util, sys
from mpitrain.comm.nccl_group import NcclGroup
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

class ShortAllToAllv(NcclGroup):
    '''Sends and receives one element fewer than asked: the last one stays the sentinel.'''
    def all_to_allv(self, send, send_counts, recv, recv_counts):
        super().all_to_allv(send, [c - 1 for c in send_counts], recv, [c - 1 for c in recv_counts])

gpu_check.nccl_inner(ShortAllToAllv)
"""


def test_the_nccl_stage_reports_a_wrong_count():
    done = subprocess.run([sys.executable, "-c", SHORT_COUNT_GROUP, str(SCRIPT)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=gpu_check.subprocess_env({**os.environ, STANDIN_ENV: "1"}))
    assert done.returncode == 0, done.stderr
    checks = gpu_check.json_lines(done.stdout, "CHECK ")
    failed = {(c["name"], c["dtype"]): c.get("wrong_elements") for c in checks if not c["passed"]}
    assert failed == {("all_to_allv", "float32"): 1, ("all_to_allv", "bfloat16"): 1}
    assert len(checks) == len(gpu_check.NCCL_CHECKS) * len(gpu_check.NCCL_DTYPES)


def test_a_call_runs_its_stages_and_ends_with_the_summary(tmp_path):
    done = run_script("--stages", "nccl", "--work", str(tmp_path), env={STANDIN_ENV: "1"})
    lines = done.stdout.splitlines()
    summary = lines[lines.index("SUMMARY") + 1:-2]
    assert [line.split(":")[0].strip() for line in summary] == ["environment", "nccl"]
    assert summary[1].startswith("  nccl: passed")
    environment_passed = summary[0].startswith("  environment: passed")  # only where a GPU, MPI and mpiexec are
    assert done.returncode == (0 if environment_passed else 1)
    assert lines[-2] == ("GPU CHECK PASSED" if environment_passed else "GPU CHECK FAILED: environment")
    assert json.loads(lines[-1])["results"]["nccl"]["checks_passed"] == 22


def test_a_failed_fp8_check_fails_the_features_stage_but_its_layouts_still_run(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "fp8_check", lambda limit_s: {
        "passed": False, "fp8_speedup": None, "fp8_worst_error": 0.5, "fp8_parity_limit": 5e-3})
    monkeypatch.setattr(gpu_check, "train", lambda *args: (0, ""))
    monkeypatch.setattr(gpu_check, "compare_runs", lambda *args: {"parity_1e-10": True})
    result = gpu_check.features(tmp_path, 60.0)
    assert not result["passed"] and result["failed_run"] == "fp8" and result["fp8_worst_error"] == 0.5
    assert set(result["runs"]) == set(gpu_check.FEATURE_RUNS)
