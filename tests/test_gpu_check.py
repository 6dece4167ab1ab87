"""benchmarks/gpu_check.py without a GPU: the default plan fits its budget, --stages/--sizes select, the stage
processes' environment, a stage that does not fit is "not reached" (not FAILED), a timed-out stage's processes all
end, and the NCCL stage itself, run on numpy through the host stand-in of cupy.cuda.nccl (MPITRAIN_NCCL_STANDIN=1):
every check passes there, and a group with a wrong count fails its check.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpitrain.comm.nccl import STANDIN_ENV

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
    assert sum(stage.limit_s for stage in stages) < gpu_check.BUDGET_S
    assert keys(stages) == ["environment", "gpu-tests", "nccl", "cpu-reference", "gpu-parity", "dp2-staged",
                            "cp2-staged", "bench-1.3b"]
    assert set(gpu_check.BENCH_LIMIT_S) == set(gpu_check.MODELS)


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
    assert "limits add up to 160 s of a 450 s budget" in done.stdout
    assert not list(tmp_path.iterdir())
    default = run_script("--dry-run")
    assert "limits add up to 435 s of a 450 s budget\n" in default.stdout
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
    assert "tests/test_gpu_paths.py" in gpu_check.GPU_TESTS


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


def test_finish_command_runs_what_was_not_reached():
    assert gpu_check.finish_command(["cp2-staged", "bench-125m", "bench-1.3b"]) == (
        "bash benchmarks/gpu_check.sh --stages cp2-staged,bench --sizes 125m,1.3b")
    assert keys(gpu_check.plan(["cp2-staged", "bench"], ["125m", "1.3b"])) == [
        "environment", "cpu-reference", "cp2-staged", "bench-125m", "bench-1.3b"]


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
