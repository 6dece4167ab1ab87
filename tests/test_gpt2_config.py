"""configs/gpt2-124m.toml is GPT-2 small: its shapes give GPT-2's parameter count, `mpitrain memory` counts it with
the fused attention a bf16 GPU run takes, and it trains on CPU (narrowed, short sequences, byte-level text)."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from mpitrain.config import load_config, resolve_layout
from mpitrain.data.prepare import prepare_dataset
from mpitrain.plan.memory import rank_param_count
from tests.mpi_helpers import REPO_ROOT, run_python_mpi_results

CONFIG = "configs/gpt2-124m.toml"
GPT2_SMALL = 124_439_808  # Hugging Face's gpt2: tied head, 1,024 learned positions


def test_config_is_gpt2_small_for_one_bf16_gpu():
    cfg = load_config(CONFIG)
    m = cfg.model
    assert (m.arch, m.n_layer, m.d_model, m.n_head, m.vocab_size, m.seq_len) == ("gpt2", 12, 768, 12, 50257, 1024)
    assert (cfg.train.device, cfg.precision.compute, cfg.precision.master) == ("cuda", "bfloat16", "float32")
    resolve_layout(cfg, 1)
    # GPT-2 less its key bias (d per block), which mpitrain leaves out: softmax ignores it (layers/attention.py)
    assert rank_param_count(cfg) == GPT2_SMALL - m.n_layer * m.d_model


def _activations_mib(*args: str) -> tuple[float, bool]:
    done = subprocess.run([sys.executable, "-m", "mpitrain", "memory", CONFIG, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.split()[:1] == ["activations"])
    return float(re.search(r"activations\s+([\d.]+) MiB", line)[1]), "fused attention" in line


def test_memory_counts_the_fused_attention_of_a_bf16_gpu_run():
    """One micro-batch of 32 x 1024 tokens: the unfused count holds 12 blocks of (32, 12, 1024, 1024) bf16
    probabilities (4.5 GiB) that the fused one replaces by outputs and log-sum-exps."""
    fused, said = _activations_mib()
    unfused, _ = _activations_mib("--attention", "unfused")
    on_cpu, said_on_cpu = _activations_mib("--set", "train.device=cpu")
    assert said and not said_on_cpu and on_cpu == unfused
    b, h, t, d, layers = 32, 12, 1024, 64, 12
    assert (unfused - fused) * 2**20 == pytest.approx(layers * b * h * t * (t * 2 - d * 2 - 4), abs=2**20 / 100)


TRAIN_JOB = """
import json
from mpi4py import MPI
from mpitrain.config import load_config
from mpitrain.train import Trainer
cfg = load_config("configs/gpt2-124m.toml", OVERRIDES)
trainer = Trainer(cfg, MPI.COMM_WORLD)
results = [trainer.train_step(step) for step in range(3)]
print("RESULTS " + json.dumps({"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results]}))
"""


def test_trains_on_cpu_with_loss_going_down(tmp_path):
    """All 12 blocks and GPT-2's vocabulary, narrowed to d_model 192 (3 heads of 64, as GPT-2's), 64 tokens,
    float32 on the CPU: three steps on byte-level text (ids below 256 of the 50,257) start near ln(50257) and fall."""
    data = tmp_path / "stdlib.h5"
    prepare_dataset("python-stdlib", data, max_bytes=100_000)
    overrides = ["train.device=cpu", "precision.compute=float32", "model.seq_len=64", "model.d_model=192",
                 "model.n_head=3", f"data.path={data}", "train.global_batch=4", "train.micro_batch=4",
                 "logging.peak_flops=1e9", "optim.warmup_steps=1", "optim.lr=3e-3"]
    found = run_python_mpi_results(1, TRAIN_JOB.replace("OVERRIDES", repr(overrides)), timeout=180)
    losses = found["losses"]
    assert all(math.isfinite(x) for x in losses + found["grad_norms"]), found
    assert abs(losses[0] - math.log(50257)) < 0.5, losses
    assert losses[2] < losses[1] < losses[0] and losses[2] < losses[0] - 0.5, losses
