#!/usr/bin/env python3
"""The device check of the GPU path: stages run in the order of what they settle, each in its own process under its
own time limit, within one budget. Run it through benchmarks/gpu_check.sh (installs nothing from the network, sets MPI
up, puts the log under $OUT when set); `--dry-run` prints the plan without a GPU.

Stages (`--stages a,b`; default: all; `--sizes` picks the bench models, default 1.3b):
  environment    CuPy, NCCL, the GPU, MPI and mpiexec (always run: it says why later stages fail);
  gpu-tests      the GPU tests (fused kernels, attention's cuBLAS GEMMs, a bf16 step and the gradient reductions against
                 numpy or the CPU); a skipped GPU test counts as a failure;
  nccl           the project's NcclGroup over a one-rank NCCL communicator (NCCL accepts one rank; on one GPU every
                 real group shares it, so training never builds one): each collective on fp32 and bf16 device
                 buffers against numpy, through the group's stream, events and handles;
  cpu-reference  configs/tiny.toml, 10 float64 steps on the CPU (the parity stages need it and add it);
  gpu-parity     one GPU against it: losses and final parameters within 1e-10;
  dp2-staged     2 ranks sharing the GPU (NCCL refuses that: host-staged groups), dp 2, the same parity;
  cp2-staged     2 ranks sharing the GPU, cp 2 (ring attention's K/V ring on device arrays), the same parity;
  bench          `bench step` in bf16 per size: tokens/s, MFU against 989 TFLOP/s (the 1.3b one must reach 35%),
                 the time breakdown, CuPy's pool high-water mark against what `mpitrain memory` plans.
A stage starts only if its whole limit fits in what is left of the budget, else it is "not reached" (not a failure):
run those in a second call with `--stages`. The default plan's limits add up to less than the budget.
The end of the output: SUMMARY (one line per stage: verdict, seconds, its numbers), then "GPU CHECK PASSED",
"GPU CHECK FAILED: ..." (exit 1) or "GPU CHECK INCOMPLETE: ..." with the command that finishes it (exit 2), then
one JSON object with everything.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # compare_runs reads tests/test_train_parity.py
    sys.path.insert(0, str(ROOT))
BUDGET_S = 450  # the whole call ends well inside one device command (600 s at most)
WORK_ROOT = Path(tempfile.gettempdir()) / "mpitrain-gpu-check"
H200_BF16_PEAK = 989e12
MODELS = {  # gpt2 shapes, vocabulary 50304, 1024 tokens per sequence
    "125m": {"model.n_layer": 12, "model.d_model": 768, "model.n_head": 12, "train.micro_batch": 8},
    "350m": {"model.n_layer": 24, "model.d_model": 1024, "model.n_head": 16, "train.micro_batch": 8},
    "1.3b": {"model.n_layer": 24, "model.d_model": 2048, "model.n_head": 16, "train.micro_batch": 4},
}
BENCH_LIMIT_S = {"125m": 60, "350m": 80, "1.3b": 140}  # 1.3b: its random init alone is ~1.3e9 host normals
DEFAULT_SIZES = ("1.3b",)  # the MFU verdict; the smaller ones in a second call
MFU_GOAL = 0.35  # the 1.3b bf16 run must reach it; 45%+ is the aim
GPU_TESTS = ("tests/test_gpu_kernels.py", "tests/test_gpu_attention_glue.py", "tests/test_gpu_paths.py")
NCCL_CHECKS = ("all_reduce", "iall_reduce", "reduce_scatter", "ireduce_scatter", "all_gather", "iall_gather",
               "broadcast", "ibroadcast", "all_to_all", "all_to_allv", "send_recv")
NCCL_DTYPES = ("float32", "bfloat16")
# Open MPI's mpiexec refuses to run as root without both; MPICH ignores them.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
SUBPROCESS_DEFAULTS = {"OMP_NUM_THREADS": "4", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
                       "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                       # one kernel cache for every stage, so each process reuses what the earlier ones compiled
                       "CUPY_CACHE_DIR": str(WORK_ROOT / "cupy-kernel-cache")}


@dataclass(frozen=True)
class Stage:
    key: str  # what --stages names (bench stages: bench-SIZE, selected by "bench" and --sizes)
    limit_s: float
    settles: str  # what its verdict tells, for the plan and the summary
    needs: tuple[str, ...] = ()  # stages whose results this one reads; added to the plan when not selected


STAGES = (
    Stage("environment", 20, "CuPy, NCCL, the GPU, MPI and mpiexec are there"),
    Stage("gpu-tests", 80, "the fused kernels, attention's GEMMs and a bf16 step match numpy/the CPU on the GPU"),
    Stage("nccl", 40, "NcclGroup's collectives (communicator, stream, events) on fp32/bf16 device buffers"),
    Stage("cpu-reference", 30, "the float64 CPU run the parity stages compare against"),
    Stage("gpu-parity", 45, "one GPU trains as the CPU does (float64, 1e-10)", ("cpu-reference",)),
    Stage("dp2-staged", 40, "dp 2 on ranks sharing the GPU (host-staged) trains as the CPU does", ("cpu-reference",)),
    Stage("cp2-staged", 40, "cp 2 ring attention on ranks sharing the GPU trains as the CPU does",
          ("cpu-reference",)),
)
STAGE_KEYS = (*(stage.key for stage in STAGES), "bench")


def say(text: str) -> None:
    print(text, flush=True)


# ---- the plan ----------------------------------------------------------------------------------------------------
def plan(stages: list[str] | None = None, sizes: list[str] | None = None) -> list[Stage]:
    """The stages one call runs, in order: the environment always, the stages asked for (all by default) and those
    they need, then one bench stage per size."""
    wanted = set(STAGE_KEYS if stages is None else [name.strip().lower() for name in stages if name.strip()])
    unknown = wanted - set(STAGE_KEYS)
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(STAGE_KEYS)}")
    sizes = [size.strip().lower() for size in (DEFAULT_SIZES if sizes is None else sizes) if size.strip()]
    unknown = set(sizes) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown size(s) {', '.join(sorted(unknown))}; sizes: {', '.join(MODELS)}")
    wanted |= {"environment"} | {need for stage in STAGES if stage.key in wanted for need in stage.needs}
    chosen = [stage for stage in STAGES if stage.key in wanted]
    if "bench" in wanted:
        chosen += [Stage(f"bench-{size}", BENCH_LIMIT_S[size], f"bf16 step speed and memory at {size}"
                         + (f" (MFU >= {MFU_GOAL:.0%})" if size == "1.3b" else "")) for size in sizes]
    return chosen


def subprocess_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of every stage's process: the repository in front of PYTHONPATH (packages carried onto
    PYTHONPATH stay visible), Open MPI allowed to run as root, and the defaults above unless already set."""
    env = {**SUBPROCESS_DEFAULTS, **base, **OPEN_MPI_AS_ROOT}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    return env


def run(command: list[str], limit_s: float, env: dict | None = None) -> tuple[int, str]:
    """Run a command from the repository root in its own session; (exit status, output), 124 when it ran out of
    time. The session is killed at the end: mpiexec's ranks too, which would otherwise keep the GPU and the pipe."""
    process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env({**os.environ, **(env or {})}), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit_s)
        status = process.returncode
    except subprocess.TimeoutExpired:
        _kill_session(process)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a descendant left the session and holds the pipe: give up on the rest
            output = ""
        output, status = (output or "") + f"\n(timed out after {limit_s:.0f} s)", 124
    _kill_session(process)
    return status, output


def _kill_session(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing of it is left
        os.killpg(process.pid, signal.SIGKILL)


def inner(name: str, limit_s: float, env: dict | None = None) -> tuple[int, str]:
    """This script again, in its own process, running one of its --inner parts."""
    return run([sys.executable, str(Path(__file__).resolve()), "--inner", name], limit_s, env)


def json_lines(output: str, prefix: str) -> list[dict]:
    """The JSON objects an inner part printed, one per line after `prefix` (what came before a crash survives)."""
    return [json.loads(line[len(prefix):]) for line in output.splitlines() if line.startswith(prefix)]


def failed_output(status: int, output: str) -> dict:
    return {"output_tail": output[-3000:]} if status else {}


# ---- environment -------------------------------------------------------------------------------------------------
def environment_inner() -> None:
    info: dict = {"python": sys.version.split()[0], "mpiexec": find_mpiexec(),
                  "pythonpath": os.environ.get("PYTHONPATH", ""), "mpi4py_libmpi": os.environ.get("MPI4PY_LIBMPI")}
    try:
        import cupy
        from cupy.cuda import nccl
        info.update(cupy=cupy.__version__, nccl=bool(nccl.available))
        info["nccl_version"] = nccl.get_version() if nccl.available else None
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        info.update(gpu=name.decode() if isinstance(name, bytes) else str(name),
                    gpus=cupy.cuda.runtime.getDeviceCount(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())
    except Exception as exc:  # noqa: BLE001 (report whatever is missing and go on)
        info["cupy_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from mpi4py import MPI
        info["mpi"] = MPI.Get_library_version().splitlines()[0]
    except Exception as exc:  # noqa: BLE001
        info["mpi_error"] = f"{type(exc).__name__}: {exc}"
    print("ENVIRONMENT " + json.dumps(info, default=str), flush=True)


def environment(limit_s: float) -> dict:
    status, output = inner("environment", limit_s)
    found = json_lines(output, "ENVIRONMENT ")
    info = found[-1] if found else {}
    missing = [what for what, present in (("CuPy", "cupy" in info), ("NCCL", info.get("nccl")), ("GPU", "gpu" in info),
                                          ("MPI", "mpi" in info), ("mpiexec", info.get("mpiexec"))) if not present]
    if missing:  # every later stage needs them: say so first, loudly
        info["error"] = "missing: " + ", ".join(missing)
    return {**info, "passed": status == 0 and not missing, **failed_output(status or not found, output)}


# ---- gpu tests ---------------------------------------------------------------------------------------------------
def gpu_tests(limit_s: float) -> dict:
    files = [name for name in GPU_TESTS if (ROOT / name).exists()]
    status, output = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files], limit_s)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    skipped = unexpected_skips(output)
    passed = status == 0 and not skipped  # on the device every GPU test must run
    return {"passed": passed, "files": files, "summary": last, **({"unexpected_skips": skipped} if skipped else {}),
            **failed_output(not passed, output)}


def unexpected_skips(pytest_output: str) -> list[str]:
    """The skips (pytest -rs lines) that a GPU machine should not have: all but those of the tests written for
    machines without one (fake device arrays), whose reason says a GPU is usable."""
    return [line for line in pytest_output.splitlines()
            if line.startswith("SKIPPED") and "a GPU is usable here" not in line]


# ---- nccl: the project's NcclGroup over a one-rank communicator --------------------------------------------------
NCCL_ELEMENTS, NCCL_PART = 1 << 18, 1000  # buffer length; all_to_allv's count (the rest must stay untouched)
P2P_TAG = 0  # the pipeline's forward tag: the group gets an NCCL lane for it


def nccl_inner(group_class=None) -> None:
    """Prints "NCCL {...}" (the group), one "CHECK {...}" per collective and dtype, then "CLOSED {...}". Under
    MPITRAIN_NCCL_STANDIN=1 the same code runs on numpy arrays through the host stand-in (how CI runs it).
    group_class: NcclGroup, or a subclass with a planted defect (the tests show that the checks can fail)."""
    import numpy as np
    from mpi4py import MPI

    from mpitrain.backend import BFLOAT16
    from mpitrain.comm.nccl import HostRuntime, make_runtime
    from mpitrain.comm.nccl_group import NcclGroup
    runtime = make_runtime("cuda")
    xp, api = (np, runtime.standin) if isinstance(runtime, HostRuntime) else (runtime.cupy, runtime.nccl)
    group = (group_class or NcclGroup)(MPI.COMM_SELF, "nccl-check", runtime=runtime, p2p_tags=(P2P_TAG,))
    print("NCCL " + json.dumps({"group": type(group).__name__, "runtime": runtime.description, "size": group.size,
                                "communicators": len(group.communicators())}), flush=True)
    rng = np.random.default_rng(0)
    for dtype_name in NCCL_DTYPES:
        host = rng.standard_normal(NCCL_ELEMENTS).astype(np.float32 if dtype_name == "float32" else BFLOAT16)
        for name in NCCL_CHECKS:
            check = {"name": name, "dtype": dtype_name}
            try:
                got, expected = nccl_case(group, name, host, xp, api, runtime)
                wrong = int((bits(got) != bits(expected)).sum())
                check.update(passed=wrong == 0, **({"wrong_elements": wrong} if wrong else {}))
            except Exception as exc:  # noqa: BLE001 (one check failing must not hide the others)
                check.update(passed=False, error=f"{type(exc).__name__}: {exc}")
            print("CHECK " + json.dumps(check), flush=True)
    for communicator in group.communicators():  # NCCL reports some errors only asynchronously
        if hasattr(communicator, "check_async_error"):
            communicator.check_async_error()
    group.close()
    print("CLOSED " + json.dumps({"communicators_left": len(group.communicators())}), flush=True)


def bits(array):
    """The array's bits as unsigned integers of its width: compared exactly, and bf16 needs no arithmetic."""
    return array.view({2: "uint16", 4: "uint32", 8: "uint64"}[array.dtype.itemsize])


def nccl_case(group, name: str, host, xp, api, runtime):
    """Run `name` on device copies of `host`; (what it wrote, on the host; what numpy expects). On one rank every
    collective hands back its input; an output buffer starts as a sentinel, so a short count shows."""
    import numpy as np
    sentinel = np.full_like(host, -7)
    send, recv = (xp.array(bits(a), copy=True).view(a.dtype) for a in (host, sentinel))
    expected = host
    if name in ("all_reduce", "iall_reduce"):
        out = send
        _done(getattr(group, name)(send, op="sum"))
    elif name in ("reduce_scatter", "ireduce_scatter", "all_gather", "iall_gather", "all_to_all"):
        out = recv
        _done(getattr(group, name)(send, recv))
    elif name in ("broadcast", "ibroadcast"):
        out = send
        _done(getattr(group, name)(send, root=0))
    elif name == "all_to_allv":
        out, expected = recv, np.concatenate([host[:NCCL_PART], sentinel[NCCL_PART:]])
        group.all_to_allv(send, [NCCL_PART], recv, [NCCL_PART])
    elif name == "send_recv":
        # A lone send to itself would hold its lane's stream until the receive queued behind it: NCCL's pattern is
        # the pair inside one group call, issued together at its end (after the handles' events were recorded, so
        # every stream is waited for before reading).
        out = recv
        api.groupStart()
        try:
            handles = [group.isend(send, 0, tag=P2P_TAG), group.irecv(recv, 0, tag=P2P_TAG)]
        finally:
            api.groupEnd()
        wait_for_every_stream(runtime)
        for handle in handles:
            handle.wait()
    else:
        raise ValueError(f"no NCCL check named {name!r}")
    return runtime.to_host(bits(out)).view(host.dtype), expected


def _done(handle) -> None:
    if handle is not None:  # the non-blocking forms: the compute stream waits on the group's event
        handle.wait()


def wait_for_every_stream(runtime) -> None:
    from mpitrain.comm.nccl import HostRuntime
    if isinstance(runtime, HostRuntime):
        for stream in list(runtime.standin._streams.values()):  # the stand-in's streams progress when polled
            stream.synchronize()
    else:
        runtime.cupy.cuda.runtime.deviceSynchronize()


def nccl(limit_s: float) -> dict:
    status, output = inner("nccl", limit_s)
    checks = {f"{c['name']} {c['dtype']}": c for c in json_lines(output, "CHECK ")}
    wanted = [f"{name} {dtype}" for dtype in NCCL_DTYPES for name in NCCL_CHECKS]
    failed = [key for key in wanted if not checks.get(key, {}).get("passed")]
    group = (json_lines(output, "NCCL ") or [{}])[-1]
    closed = bool(json_lines(output, "CLOSED "))
    passed = status == 0 and not failed and closed and group.get("size") == 1
    return {"passed": passed, **group, "checks_passed": len(wanted) - len(failed), "checks": len(wanted),
            "failed_checks": {key: checks.get(key, {"error": "not run"}) for key in failed}, "closed": closed,
            **failed_output(not passed, output)}


# ---- float64 parity against the CPU path -------------------------------------------------------------------------
def find_mpiexec() -> str | None:
    """gpu_check.sh's choice (MPIEXEC: the carried MPICH's), else the one beside this Python, else PATH's."""
    beside = Path(sys.executable).parent / "mpiexec"
    return os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else shutil.which("mpiexec"))


def train(out: Path, ranks: int, overrides: tuple[str, ...], limit_s: float) -> tuple[int, str]:
    args = [sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(out),
            "--set", "data.synthetic=true", "--set", "precision.compute=float64", "--set", "train.steps=10"]
    for setting in overrides:
        args += ["--set", setting]
    if ranks > 1:
        args = [find_mpiexec() or "mpiexec", "-n", str(ranks), *args]
    return run(args, limit_s)


def compare_runs(reference: Path, other: Path) -> dict:
    """Largest relative differences of the per-step losses and of the final parameters."""
    import numpy as np

    from tests.test_train_parity import final_params
    losses = [[json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
              for run_dir in (reference, other)]
    loss_error = max(abs(a - b) / abs(a) for a, b in zip(*losses)) if len(losses[0]) == len(losses[1]) else None
    ref, got = final_params(reference), final_params(other)
    param_error = max(float(np.linalg.norm(got[name] - value) / np.linalg.norm(value)) for name, value in ref.items())
    parity = loss_error is not None and loss_error < 1e-10 and param_error < 1e-10
    return {"steps": len(losses[1]), "loss_rel_error": loss_error, "param_rel_error": param_error,
            "parity_1e-10": parity}


PARITY_RUNS = {  # stage -> (ranks, settings over the CPU reference's)
    "gpu-parity": (1, ("train.device=cuda", "train.collectives=nccl")),
    "dp2-staged": (2, ("train.device=cuda", "train.collectives=nccl", "parallel.dp=2")),
    "cp2-staged": (2, ("train.device=cuda", "train.collectives=nccl", "parallel.cp=2")),
}


def cpu_reference(work: Path, limit_s: float) -> dict:
    status, output = train(work / "cpu-reference", 1, (), limit_s)
    return {"passed": status == 0, **failed_output(status, output)}


def parity(key: str, work: Path, limit_s: float) -> dict:
    ranks, settings = PARITY_RUNS[key]
    status, output = train(work / key, ranks, settings, limit_s)
    if status:
        return {"passed": False, "status": status, **failed_output(status, output)}
    result = compare_runs(work / "cpu-reference", work / key)
    if ranks > 1:
        result["host_staged"] = "share a GPU" in output  # one GPU: NCCL refuses the pair, MPI carries it
    return {"passed": result["parity_1e-10"], **result}


# ---- bench step --------------------------------------------------------------------------------------------------
def bench_settings(size: str) -> list[str]:
    settings = {"model.arch": "gpt2", "model.vocab_size": 50304, "model.seq_len": 1024, **MODELS[size],
                "precision.compute": "bfloat16", "train.device": "cuda", "train.collectives": "nccl",
                "logging.peak_flops": H200_BF16_PEAK}
    settings["train.global_batch"] = settings["train.micro_batch"]
    return [f"{key}={value}" for key, value in settings.items()]


def bench_inner(size: str) -> None:
    """`mpitrain bench step` (prints its JSON), then this process's GPU memory against the plan."""
    import cupy

    from mpitrain.cli import main
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import memory_report, rank_param_count
    settings = bench_settings(size)
    args = ["bench", "step", "configs/bench-small.toml", "--steps", "3", "--warmup", "2"]
    for setting in settings:
        args += ["--set", setting]
    main(args, standalone_mode=False)
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    cfg = load_config(str(ROOT / "configs/bench-small.toml"), settings)
    resolve_layout(cfg, 1)
    plan_bytes = memory_report(cfg, rank_param_count(cfg))
    print("MEMORY " + json.dumps({"pool_high_water_bytes": pool.total_bytes(), "device_used_bytes": total - free,
                                  "planned_bytes": plan_bytes["total"], "planned": plan_bytes["bytes"]}), flush=True)


def bench(size: str, limit_s: float) -> dict:
    # CUPY_TF32: the fp32 matmuls left in a bf16 step (e.g. ring attention, computed in fp32) on tensor cores
    status, output = inner(f"bench-{size}", limit_s, env={"CUPY_TF32": "1"})
    result: dict = {"status": status}
    for line in output.splitlines():
        if line.startswith("{") and '"tokens_per_s"' in line:
            report = json.loads(line)
            result.update({key: report.get(key) for key in ("n_params", "step_time_s", "tokens_per_s", "mfu",
                                                            "breakdown")})
        elif line.startswith("MEMORY "):
            result.update(json.loads(line[len("MEMORY "):]))
    if result.get("pool_high_water_bytes") and result.get("planned_bytes"):
        result["pool/planned"] = round(result["pool_high_water_bytes"] / result["planned_bytes"], 3)
    passed = status == 0 and result.get("mfu") is not None
    if size == "1.3b":  # the verdict of the GPU path's speed
        result["mfu_goal"] = MFU_GOAL
        passed = passed and result["mfu"] >= MFU_GOAL
    return {"passed": passed, **result, **failed_output(status, output)}


# ---- running the plan ----------------------------------------------------------------------------------------------
def body_of(stage: Stage, work: Path):
    """The function that runs `stage`, called with its time limit; returns a dict with "passed"."""
    if stage.key == "environment":
        return environment
    if stage.key == "gpu-tests":
        return gpu_tests
    if stage.key == "nccl":
        return nccl
    if stage.key == "cpu-reference":
        return lambda limit_s: cpu_reference(work, limit_s)
    if stage.key in PARITY_RUNS:
        return lambda limit_s: parity(stage.key, work, limit_s)
    return lambda limit_s: bench(stage.key.removeprefix("bench-"), limit_s)


def run_plan(stages: list[Stage], body_of, budget_s: float = BUDGET_S, clock=time.monotonic) -> dict[str, dict]:
    """Each stage in order, if its whole limit fits in the budget left ("not reached" otherwise) and what it needs
    passed ("blocked" when that failed); a stage's verdict is "passed" or "FAILED"."""
    start, results = clock(), {}
    for stage in stages:
        left = budget_s - (clock() - start)
        needs = {need: results.get(need, {}).get("verdict") for need in stage.needs}
        if stage.limit_s > left or "not reached" in needs.values():
            result = {"verdict": "not reached", "limit_s": stage.limit_s, "budget_left_s": round(left)}
        elif any(verdict != "passed" for verdict in needs.values()):
            result = {"verdict": "blocked", "needs": [need for need, v in needs.items() if v != "passed"]}
        else:
            began = clock()
            try:
                outcome = body_of(stage)(stage.limit_s)
            except Exception as exc:  # noqa: BLE001 (one stage failing must not hide the others)
                outcome = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            verdict = "passed" if outcome.pop("passed", False) else "FAILED"
            result = {"verdict": verdict, "seconds": round(clock() - began), "limit_s": stage.limit_s, **outcome}
        results[stage.key] = result
        say(f"== {stage.key}: {result['verdict']} ({stage.settles})\n"
            f"{json.dumps(result, indent=1, default=str)[:4000]}")
    return results


def finish_command(keys: list[str]) -> str:
    """The call that runs the stages `keys` (bench-SIZE ones through --sizes)."""
    sizes = [key.removeprefix("bench-") for key in keys if key.startswith("bench-")]
    stages = [key for key in keys if not key.startswith("bench-")] + (["bench"] if sizes else [])
    return "bash benchmarks/gpu_check.sh --stages " + ",".join(stages) + (f" --sizes {','.join(sizes)}" if sizes
                                                                           else "")


def verdict(results: dict[str, dict]) -> tuple[int, str]:
    """(exit status, last line): 0 passed, 1 failed, 2 incomplete (some stages not reached, none failed)."""
    of = {kind: [key for key, result in results.items() if result["verdict"] == kind]
          for kind in ("FAILED", "blocked", "not reached")}
    left = f"; not reached: {', '.join(of['not reached'])} (run: {finish_command(of['not reached'])})" if (
        of["not reached"]) else ""
    if of["FAILED"]:
        blocked = f"; blocked by them: {', '.join(of['blocked'])}" if of["blocked"] else ""
        return 1, f"GPU CHECK FAILED: {', '.join(of['FAILED'])}{blocked}{left}"
    if of["not reached"]:
        return 2, "GPU CHECK INCOMPLETE" + left
    return 0, "GPU CHECK PASSED"


SUMMARY_KEYS = ("seconds", "limit_s", "summary", "checks_passed", "checks", "loss_rel_error", "param_rel_error",
                "host_staged", "n_params", "tokens_per_s", "mfu", "mfu_goal", "step_time_s", "pool_high_water_bytes",
                "planned_bytes", "pool/planned", "breakdown", "error", "gpu", "cupy", "nccl_version", "mpi",
                "mpiexec", "cupy_error", "mpi_error", "needs", "budget_left_s")


def summary(results: dict[str, dict]) -> str:
    """One line per stage: its verdict and its numbers, readable in the last lines of the output."""
    lines = ["SUMMARY"]
    for key, result in results.items():
        shown = {name: result[name] for name in SUMMARY_KEYS if name in result}
        failed_checks = sorted(result.get("failed_checks") or ())
        if failed_checks:  # all of them: the group could not be built (the output's last line says why)
            shown["failed_checks"] = failed_checks if len(failed_checks) < result["checks"] else "all"
        if result.get("output_tail", "").strip():  # why it failed, in the output's last line
            shown["last_output_line"] = result["output_tail"].strip().splitlines()[-1][:300]
        lines.append(f"  {key}: {result['verdict']} {json.dumps(shown, default=str)}")
    return "\n".join(lines)


def print_plan(stages: list[Stage]) -> None:
    total = sum(stage.limit_s for stage in stages)
    for stage in stages:
        needs = f" (needs {', '.join(stage.needs)})" if stage.needs else ""
        say(f"  {stage.key:<14} {stage.limit_s:>4.0f} s  {stage.settles}{needs}")
    say(f"limits add up to {total:.0f} s of a {BUDGET_S} s budget"
        + ("" if total < BUDGET_S else ": the last stages will be reported not reached"))
    env = subprocess_env(dict(os.environ))
    shown = ("PYTHONPATH", "CUPY_CACHE_DIR", *OPEN_MPI_AS_ROOT)
    say("stage processes get: " + " ".join(f"{name}={env[name]}" for name in shown)
        + f"; mpiexec: {find_mpiexec()}")


INNER_PARTS = ("environment", "nccl", *(f"bench-{size}" for size in MODELS))


def run_inner(part: str) -> None:
    if part == "environment":
        environment_inner()
    elif part == "nccl":
        nccl_inner()
    else:
        bench_inner(part.removeprefix("bench-"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", help=f"comma-separated, run in plan order: {', '.join(STAGE_KEYS)} (default all)")
    parser.add_argument("--sizes", help=f"the bench models: {', '.join(MODELS)} (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and run nothing (no GPU needed)")
    parser.add_argument("--work", type=Path, default=WORK_ROOT, help="where each call's run directories go")
    parser.add_argument("--inner", choices=INNER_PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        run_inner(args.inner)
        return 0
    try:
        stages = plan(*(value.split(",") if value else None for value in (args.stages, args.sizes)))
    except ValueError as exc:
        parser.error(str(exc))
    if args.dry_run:
        print_plan(stages)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="call-", dir=args.work))  # fresh: `train --out` resumes an old directory
    start = time.monotonic()
    results = run_plan(stages, lambda stage: body_of(stage, work))
    status, last_line = verdict(results)
    say(summary(results))
    say(last_line)
    print(json.dumps({"results": results, "verdict": last_line, "seconds": round(time.monotonic() - start),
                      "budget_s": BUDGET_S}, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
