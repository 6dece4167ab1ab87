"""gpu_check's bench stages: training steps in bf16 at one model size, with the fused attention on and off, in one
process on one model (its random init is most of a stage's time at 1.3b, so the second path costs a few steps):
tokens/s and MFU against 989 TFLOP/s per path, the time breakdown, and CuPy's pool high-water mark after the fused
steps against what `mpitrain memory` plans. The 1.3b run with the fused path settles the MFU goal.
"""
from __future__ import annotations

import json
import statistics

from gpu_check_attention import ATTENTION_SWITCH, PATHS, attention_path, path_in_use
from gpu_check_process import ROOT, failed_output, inner, json_lines

H200_BF16_PEAK = 989e12
MODELS = {  # gpt2 shapes, vocabulary 50304, 1024 tokens per sequence
    "125m": {"model.n_layer": 12, "model.d_model": 768, "model.n_head": 12, "train.micro_batch": 8},
    "350m": {"model.n_layer": 24, "model.d_model": 1024, "model.n_head": 16, "train.micro_batch": 8},
    "1.3b": {"model.n_layer": 24, "model.d_model": 2048, "model.n_head": 16, "train.micro_batch": 4},
}
BENCH_LIMIT_S = {"125m": 60, "350m": 80, "1.3b": 140}  # 1.3b: its random init alone is ~1.3e9 host normals
MFU_GOAL = 0.40  # the 1.3b bf16 run with the fused attention must reach it
WARMUP_STEPS, TIMED_STEPS = 2, 4  # per path
BENCH_CONFIG = "configs/bench-small.toml"


def bench_settings(size: str) -> list[str]:
    settings = {"model.arch": "gpt2", "model.vocab_size": 50304, "model.seq_len": 1024, **MODELS[size],
                "precision.compute": "bfloat16", "train.device": "cuda", "train.collectives": "nccl",
                "logging.peak_flops": H200_BF16_PEAK, "data.synthetic": "true",
                "train.steps": len(PATHS) * (WARMUP_STEPS + TIMED_STEPS)}
    settings["train.global_batch"] = settings["train.micro_batch"]
    return [f"{key}={value}" for key, value in settings.items()]


def time_steps(trainer, first_step: int) -> dict:
    """WARMUP_STEPS untimed steps, then TIMED_STEPS: the median step, tokens/s, MFU and the mean breakdown."""
    from mpitrain.profile.breakdown import RunSummary, gather_summary
    times, breakdown = [], RunSummary()
    for step in range(first_step, first_step + WARMUP_STEPS + TIMED_STEPS):
        result = trainer.train_step(step)
        if step >= first_step + WARMUP_STEPS:
            times.append(result.seconds)
            breakdown.add(result.breakdown)
    step_time = statistics.median(times)
    tokens_per_s = trainer.tokens_per_step / step_time
    return {"step_time_s": step_time, "tokens_per_s": tokens_per_s,
            "mfu": trainer.model.flops_per_token() * tokens_per_s / trainer.cluster_peak_flops,
            "breakdown": gather_summary(trainer.mesh.world, breakdown)}


def pool_against_plan(cupy, size: str) -> dict:
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import memory_report, rank_param_count
    cfg = load_config(str(ROOT / BENCH_CONFIG), bench_settings(size))  # its own: resolve_layout writes into it
    resolve_layout(cfg, 1)
    planned = memory_report(cfg, rank_param_count(cfg))
    free, total = cupy.cuda.runtime.memGetInfo()
    return {"pool_high_water_bytes": cupy.get_default_memory_pool().total_bytes(), "device_used_bytes": total - free,
            "planned_bytes": planned["total"], "planned": planned["bytes"]}


def bench_inner(size: str) -> None:
    """Prints "MODEL {...}", one "PATH {...}" per attention path (fused first, then "MEMORY {...}": the pool then
    holds the fused steps' high-water mark), an exception being that path's error; "ran": the path a small
    attention call took under the same switch."""
    import cupy
    from mpi4py import MPI

    from mpitrain.config import load_config
    from mpitrain.layers import ops
    from mpitrain.train import Trainer
    cfg = load_config(str(ROOT / BENCH_CONFIG), bench_settings(size))
    trainer = Trainer(cfg, MPI.COMM_WORLD)
    print("MODEL " + json.dumps({"n_params": trainer.model.n_params}), flush=True)
    for number, path in enumerate(PATHS):
        try:
            with attention_path(path):
                report = {"path": path, "ran": path_in_use(cupy, ops),
                          **time_steps(trainer, number * (WARMUP_STEPS + TIMED_STEPS))}
        except Exception as exc:  # noqa: BLE001 (the other path still measures)
            report = {"path": path, "error": f"{type(exc).__name__}: {exc}"}
        print("PATH " + json.dumps(report, default=str), flush=True)
        if number == 0:
            cupy.cuda.Device().synchronize()
            print("MEMORY " + json.dumps(pool_against_plan(cupy, size)), flush=True)


def bench_verdict(size: str, status: int, output: str) -> dict:
    """The fused path's numbers as the stage's own (mfu, tokens_per_s, ...), the cuBLAS ones with _cublas, the
    step's speed-up; passed: both paths ran (and at 1.3b the fused one reached MFU_GOAL)."""
    result: dict = {"status": status, **(json_lines(output, "MODEL ") or [{}])[-1]}
    paths = {report.pop("path"): report for report in json_lines(output, "PATH ")}
    for path, suffix in zip(PATHS, ("", "_cublas")):
        result.update({key + suffix: value for key, value in paths.get(path, {"error": "not run"}).items()})
    if result.get("step_time_s") and result.get("step_time_s_cublas"):
        result["fused_step_speedup"] = round(result["step_time_s_cublas"] / result["step_time_s"], 3)
    for memory in json_lines(output, "MEMORY "):
        result.update(memory)
    if result.get("pool_high_water_bytes") and result.get("planned_bytes"):
        result["pool/planned"] = round(result["pool_high_water_bytes"] / result["planned_bytes"], 3)
    wrong = {f"{ATTENTION_SWITCH}={path}": paths[path]["ran"] for path in PATHS
             if paths.get(path, {}).get("ran", path) != path}
    if wrong:  # the two numbers would not be the fused path on and off
        result["switch_error"] = ", ".join(f"{switch} ran {ran}" for switch, ran in wrong.items())
    passed = status == 0 and not wrong and result.get("mfu") is not None and result.get("mfu_cublas") is not None
    if size == "1.3b":  # the verdict of the GPU path's speed
        result["mfu_goal"] = MFU_GOAL
        passed = passed and result["mfu"] >= MFU_GOAL
    return {"passed": passed, **result}


def bench(size: str, limit_s: float) -> dict:
    # CUPY_TF32: the fp32 matmuls left in a bf16 step (e.g. ring attention, computed in fp32) on tensor cores
    status, output = inner(f"bench-{size}", limit_s, env={"CUPY_TF32": "1"})
    result = bench_verdict(size, status, output)
    return {**result, **failed_output(not result["passed"], output)}
