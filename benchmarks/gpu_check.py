#!/usr/bin/env python3
"""The device check of the GPU path: stages run in the order of what they settle, each in its own process under its
own time limit, within one budget. Run it through benchmarks/gpu_check.sh (installs nothing from the network, sets MPI
up, puts the log under $OUT when set); `--dry-run` prints the plan without a GPU.

Stages (`--stages a,b`; default: all; `--sizes` picks the bench models, default 1.3b):
  environment    CuPy, NCCL, the GPU, MPI and mpiexec (always run: it says why later stages fail);
  gpu-tests      the GPU tests (fused kernels, attention's cuBLAS GEMMs and cuDNN graphs, a bf16 step and the gradient
                 reductions against numpy or the CPU); a skipped GPU test counts as a failure;
  attention      the fused causal attention (cuDNN) against cuBLAS's in bf16 on gpt2 and llama (GQA) shapes at 1024
                 and 4096 tokens: output and dq/dk/dv error relative to the largest value (above 2e-2 fails), each
                 path's time and the fused one's speed-up (gpu_check_attention.py);
  nccl           the project's NcclGroup over a one-rank NCCL communicator: each collective on fp32 and bf16 device
                 buffers against numpy (gpu_check_nccl.py);
  cpu-reference  configs/tiny.toml, 10 float64 steps on the CPU (the parity stages need it and add it);
  gpu-parity     one GPU against it: losses and final parameters within 1e-10;
  bench          training steps in bf16 per size with the fused attention on, then off: tokens/s and MFU against 989
                 TFLOP/s per path (the 1.3b one with the fused path must reach 40%), the time breakdown, CuPy's pool
                 high-water mark against what `mpitrain memory` plans (gpu_check_bench.py);
  dp2-staged     2 ranks sharing the GPU (NCCL refuses that: host-staged groups), dp 2, the same parity as gpu-parity;
  cp2-staged     2 ranks sharing the GPU, cp 2 (ring attention's K/V ring on device arrays), the same parity;
  features       4 ranks sharing the GPU on two fake nodes, the newer features on device arrays, each run at the
                 same parity: tp_overlap's ring under tp 2 with hybrid cp 2 (Ulysses inside a node, the ring across),
                 then ZeRO-3 over dp 4 with the two-level reduction (FEATURE_RUNS); first, FP8's GEMMs through
                 cuBLASLt against the emulation per recipe and an FP8 / bf16 GEMM timing at 8192^3, printed as a
                 ratio (gpu_check_fp8.py). Quantized ZeRO's codecs are checked in gpu-tests (bit for bit numpy's
                 on device arrays).
A stage starts only if its whole limit fits in what is left of the budget, else it is "not reached" (not a failure):
run those in a second call with `--stages`. In the default plan every stage through dp2-staged fits even if each
earlier one runs to its limit; cp2-staged and features run when they leave them their limits (print_plan
says so).
The end of the output: SUMMARY (one line per stage: verdict, seconds, its numbers), then "GPU CHECK PASSED",
"GPU CHECK FAILED: ..." (exit 1) or "GPU CHECK INCOMPLETE: ..." with the command that finishes it (exit 2), then
one JSON object with everything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):  # compare_runs reads tests/test_train_parity.py; the stages' modules sit here
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_check_attention import PARITY_LIMIT, attention, attention_inner  # noqa: E402
from gpu_check_bench import BENCH_LIMIT_S, MFU_GOAL, MODELS, bench, bench_inner  # noqa: E402
from gpu_check_fp8 import FP8_LIMIT_S, fp8_check, fp8_inner  # noqa: E402
from gpu_check_nccl import NCCL_CHECKS, NCCL_DTYPES, nccl, nccl_inner  # noqa: E402
from gpu_check_process import (  # noqa: E402
    OPEN_MPI_AS_ROOT,
    ROOT,
    WORK_ROOT,
    failed_output,
    find_mpiexec,
    inner,
    json_lines,
    run,
    subprocess_env,
)

BUDGET_S = 450  # the whole call ends well inside one device command (600 s at most)
DEFAULT_SIZES = ("1.3b",)  # the MFU verdict; the smaller ones in a second call
GPU_TESTS = ("tests/test_gpu_kernels.py", "tests/test_gpu_attention_glue.py", "tests/test_cudnn_graphs.py",
             "tests/test_gpu_paths.py",  # then single tests of files whose other tests are for CPUs (MPI, stand-in)
             "tests/test_gpu_new_features.py::test_codecs_on_the_gpu_give_numpys_bytes",
             "tests/test_fp8_gemm.py::test_fp8_training_on_the_gpu_follows_the_cpu_emulation")  # its GEMMs: features
__all__ = ["NCCL_CHECKS", "NCCL_DTYPES", "PARITY_LIMIT", "nccl_inner", "run", "subprocess_env"]  # for the tests


@dataclass(frozen=True)
class Stage:
    key: str  # what --stages names (bench stages: bench-SIZE, selected by "bench" and --sizes)
    limit_s: float
    settles: str  # what its verdict tells, for the plan and the summary
    needs: tuple[str, ...] = ()  # stages whose results this one reads; added to the plan when not selected


STAGES = (
    Stage("environment", 20, "CuPy, NCCL, the GPU, MPI and mpiexec are there"),
    Stage("gpu-tests", 80, "fused kernels, attention (GEMMs, cuDNN) and a bf16 step match numpy/the CPU on the GPU"),
    Stage("attention", 45, f"fused attention = cuBLAS's in bf16 (within {PARITY_LIMIT:g} of the largest value), "
                           "and its speed-up"),
    Stage("nccl", 40, "NcclGroup's collectives (communicator, stream, events) on fp32/bf16 device buffers"),
    Stage("cpu-reference", 30, "the float64 CPU run the parity stages compare against"),
    Stage("gpu-parity", 45, "one GPU trains as the CPU does (float64, 1e-10)", ("cpu-reference",)),
    Stage("dp2-staged", 40, "dp 2 on ranks sharing the GPU (host-staged) trains as the CPU does", ("cpu-reference",)),
    Stage("cp2-staged", 40, "cp 2 ring attention on ranks sharing the GPU trains as the CPU does",
          ("cpu-reference",)),
    Stage("features", 60 + FP8_LIMIT_S, "FP8 GEMMs through cuBLASLt = the emulation, their speed-up; tp_overlap x "
                                        "hybrid cp, and two-level ZeRO-3, on 4 ranks sharing the GPU train as the "
                                        "CPU does", ("cpu-reference",)),
)
BENCH_BEFORE = "dp2-staged"  # the bench stages go before it: the MFU verdict does not wait on host-staged ranks
STAGE_KEYS = (*(stage.key for stage in STAGES), "bench")


def say(text: str) -> None:
    print(text, flush=True)


# ---- the plan ----------------------------------------------------------------------------------------------------
def plan(stages: list[str] | None = None, sizes: list[str] | None = None) -> list[Stage]:
    """The stages one call runs, in order: the environment always, the stages asked for (all by default) and those
    they need, with one bench stage per size before BENCH_BEFORE's place."""
    wanted = set(STAGE_KEYS if stages is None else [name.strip().lower() for name in stages if name.strip()])
    unknown = wanted - set(STAGE_KEYS)
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(STAGE_KEYS)}")
    sizes = [size.strip().lower() for size in (DEFAULT_SIZES if sizes is None else sizes) if size.strip()]
    unknown = set(sizes) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown size(s) {', '.join(sorted(unknown))}; sizes: {', '.join(MODELS)}")
    wanted |= {"environment"} | {need for stage in STAGES if stage.key in wanted for need in stage.needs}
    benches = [Stage(f"bench-{size}", BENCH_LIMIT_S[size], f"bf16 step speed, fused attention on and off, at {size}"
                     + (f" (MFU >= {MFU_GOAL:.0%} with it on)" if size == "1.3b" else "")) for size in sizes]
    split = [stage.key for stage in STAGES].index(BENCH_BEFORE)
    chosen = [stage for stage in STAGES[:split] if stage.key in wanted]
    chosen += benches if "bench" in wanted else []
    return chosen + [stage for stage in STAGES[split:] if stage.key in wanted]


def sure_to_start(stages: list[Stage], budget_s: float = BUDGET_S) -> list[str]:
    """The stages that start even if every earlier one runs to its limit (the others wait on time left over)."""
    sure, spent = [], 0.0
    for stage in stages:
        spent += stage.limit_s
        if spent > budget_s:
            break
        sure.append(stage.key)
    return sure


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
    try:  # the fused attention's: its absence fails the attention stage, not this one
        import cudnn
        info["cudnn"] = f"frontend {cudnn.__version__}"
        info["cudnn"] += f", library {cudnn.backend_version()}"
    except Exception as exc:  # noqa: BLE001
        missing = " (the cuDNN library, e.g. nvidia-cudnn-cu13's, did not load)" if "cudnn" in info else ""
        info["cudnn_error"] = f"{type(exc).__name__}: {exc}{missing}"
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
    files = [name for name in GPU_TESTS if (ROOT / name.split("::")[0]).exists()]
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


# ---- float64 parity against the CPU path -------------------------------------------------------------------------
def train(out: Path, ranks: int, overrides: tuple[str, ...], limit_s: float, env: dict | None = None
          ) -> tuple[int, str]:
    args = [sys.executable, "-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(out),
            "--set", "data.synthetic=true", "--set", "precision.compute=float64", "--set", "train.steps=10"]
    for setting in overrides:
        args += ["--set", setting]
    if ranks > 1:
        args = [find_mpiexec() or "mpiexec", "-n", str(ranks), *args]
    return run(args, limit_s, env)


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


# features: 4 ranks on two fake nodes (comm/nodes.py MPITRAIN_FAKE_NODES; all share the one GPU, so every
# group is host-staged), one run per layout, each at parity with the CPU reference
FEATURE_RUNS = {
    "tp_overlap-hybrid-cp": ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=true",
                             "parallel.cp=2", "parallel.cp_kind=hybrid"),
    "two_level-zero3": ("parallel.zero=3", "parallel.dp_reduce=two_level", "train.micro_batch=1"),
}
FEATURE_NODES = {"MPITRAIN_FAKE_NODES": "2"}


def features(work: Path, limit_s: float, clock=time.monotonic) -> dict:
    """FP8's check (its own limit), then each FEATURE_RUNS layout on the GPU against the CPU reference, in the time
    the stage has left: a failed FP8 check fails the stage but still leaves the layouts their runs."""
    start, runs = clock(), {}
    fp8 = fp8_check(min(FP8_LIMIT_S, limit_s))
    found = {**fp8_numbers(fp8), "fp8": fp8, **({} if fp8["passed"] else {"failed_run": "fp8"})}
    for name, settings in FEATURE_RUNS.items():
        left = limit_s - (clock() - start)
        status, output = train(work / name, 4, ("train.device=cuda", "train.collectives=nccl", *settings), left,
                               FEATURE_NODES)
        if status:
            return {"passed": False, **found, "failed_run": name, "status": status, "runs": runs,
                    **failed_output(status, output)}
        runs[name] = {**compare_runs(work / "cpu-reference", work / name), "host_staged": "share a GPU" in output}
    return {"passed": fp8["passed"] and all(run["parity_1e-10"] for run in runs.values()), **found, "runs": runs}


def fp8_numbers(fp8: dict) -> dict:
    """The FP8 check's numbers the summary line shows."""
    return {key: fp8[key] for key in ("fp8_speedup", "fp8_worst_error", "fp8_parity_limit")}


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


# ---- running the plan ----------------------------------------------------------------------------------------------
def body_of(stage: Stage, work: Path):
    """The function that runs `stage`, called with its time limit; returns a dict with "passed"."""
    if stage.key == "environment":
        return environment
    if stage.key == "gpu-tests":
        return gpu_tests
    if stage.key == "attention":
        return attention
    if stage.key == "nccl":
        return nccl
    if stage.key == "cpu-reference":
        return lambda limit_s: cpu_reference(work, limit_s)
    if stage.key in PARITY_RUNS:
        return lambda limit_s: parity(stage.key, work, limit_s)
    if stage.key == "features":
        return lambda limit_s: features(work, limit_s)
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
                "planned_bytes", "pool/planned", "breakdown", "mfu_cublas", "tokens_per_s_cublas", "step_time_s_cublas",
                "fused_step_speedup", "worst_error", "parity_limit", "per_shape", "failed_shapes", "error",
                "error_cublas", "switch_error", "gpu", "cupy", "nccl_version", "cudnn", "mpi", "mpiexec",
                "cupy_error", "cudnn_error", "mpi_error", "needs", "budget_left_s", "runs", "failed_run",
                "fp8_speedup", "fp8_worst_error", "fp8_parity_limit")


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
    waiting = [stage.key for stage in stages if stage.key not in sure_to_start(stages)]
    say(f"limits add up to {total:.0f} s of a {BUDGET_S} s budget" + (
        f"; {', '.join(waiting)}: started only if the stages before leave the time, else not reached"
        if waiting else ""))
    env = subprocess_env(dict(os.environ))
    shown = ("PYTHONPATH", "CUPY_CACHE_DIR", *OPEN_MPI_AS_ROOT)
    say("stage processes get: " + " ".join(f"{name}={env[name]}" for name in shown)
        + f"; mpiexec: {find_mpiexec()}")


INNER_PARTS = ("environment", "attention", "nccl", "fp8", *(f"bench-{size}" for size in MODELS))


def run_inner(part: str) -> None:
    if part == "environment":
        environment_inner()
    elif part == "attention":
        attention_inner()
    elif part == "nccl":
        nccl_inner()
    elif part == "fp8":
        fp8_inner()
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
