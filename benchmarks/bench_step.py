#!/usr/bin/env python
"""Side-by-side training-step benchmark: mpitrain (numpy) against PyTorch eager on the same model, plus DP scaling.

    python benchmarks/bench_step.py [--config configs/bench-small.toml] [--steps 6] [--warmup 2] [--rounds 3]

In one run it measures
  1. this machine's float32 matmul peak (numpy, and torch if present) with 1 thread and with all threads;
  2. mpitrain, 1 rank x all threads (`python -m mpitrain bench step`): tokens/s and MFU;
  3. PyTorch eager with F.scaled_dot_product_attention, the same gpt2 model (same weights), AdamW + grad clipping
     included, all threads, at the config's batch and at twice that batch (plain eager attention: --eager);
  4. mpitrain 1 rank x 1 thread (global batch = micro batch) and 2 ranks x 1 thread under mpiexec (global batch =
     2 x micro batch, i.e. the same work per rank);
and prints three ratios of tokens/s with their targets:
  mpitrain 1 rank x all threads / torch SDPA all threads, same batch               >= 1.0
  mpitrain 2 ranks x 1 thread / torch SDPA all threads, both at twice the batch   >= 1.15
  DP scaling: mpitrain 2 ranks x 1 thread / 1 rank x 1 thread                     >= 1.9

Every measurement runs in its own subprocess with OMP/OPENBLAS/MKL_NUM_THREADS set, so thread counts are exact. The
variants are interleaved in rounds (A B C D E, then E D C B A, ...) because the machine is noisy. Each headline ratio
is the median of the per-round ratios: within a round the two variants ran seconds apart, on the same machine state.
(Until 2026-12-02 it was the ratio of each variant's best round, on the premise that noise only slows a run down. On
the 2-core VM it does not: one round of a variant can run 20-27% faster than its median round, and a single-core
variant can catch one fast core that a two-rank run cannot. The ratio of best rounds then compares two different
machine states: over eight runs its standard deviation was 1.6-1.7x that of the median of per-round ratios for the two
torch ratios (1.2x for DP scaling), and it came out 0.03-0.10 lower on average. Both are printed, and the JSON has
both.) The last line printed is one JSON object with every number.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
TARGETS = {"mpitrain_over_torch_sdpa": 1.0, "dp2_over_torch_sdpa_2x_batch": 1.15, "dp_scaling_2_over_1": 1.9}


# ============================================================================ workers (run in subprocesses)
def _best_matmul_flops(matmul, sync=lambda: None, n: int = 1024, seconds: float = 0.3) -> float:
    """Best FLOP/s of an n x n float32 matmul over ~`seconds` (same method as mpitrain.profile.flops)."""
    matmul()
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        matmul()
        sync()
        best = max(best, 2.0 * n ** 3 / (time.perf_counter() - start))
    return best


def worker_peak(threads: int) -> dict:
    import numpy as np
    n = 1024
    a, b = np.ones((n, n), np.float32), np.ones((n, n), np.float32)
    out = np.empty((n, n), np.float32)
    result = {"threads": threads, "numpy": _best_matmul_flops(lambda: np.matmul(a, b, out=out), n=n)}
    try:
        import torch
    except ImportError:
        result["torch"] = None
    else:
        torch.set_num_threads(threads)
        ta, tb = torch.ones(n, n), torch.ones(n, n)
        tout = torch.empty(n, n)
        result["torch"] = _best_matmul_flops(lambda: torch.matmul(ta, tb, out=tout), n=n)
    return result


def _torch_gpt(cfg, attention: str):
    """A compact PyTorch nn.Module of mpitrain's gpt2 flavour, built from torch's own eager ops."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    m = cfg.model
    c, n_head, f, t_max, eps = m.d_model, m.n_head, m.ff_dim, m.seq_len, m.norm_eps

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(c, eps=eps), nn.LayerNorm(c, eps=eps)
            self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c, bias=False), nn.Linear(c, c)  # no key bias
            self.o = nn.Linear(c, c)
            self.fc, self.proj = nn.Linear(c, f), nn.Linear(f, c)
            self.register_buffer("future", torch.triu(torch.ones(t_max, t_max, dtype=torch.bool), 1),
                                 persistent=False)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = (lin(h).view(b, t, n_head, c // n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
            if attention == "sdpa":
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # plain eager attention, like mpitrain's
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // n_head))
                scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
                a = torch.softmax(scores, dim=-1) @ v
            x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
            return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(m.vocab_size, c)
            self.wpe = nn.Parameter(torch.zeros(t_max, c))
            self.blocks = nn.ModuleList(Block() for _ in range(m.n_layer))
            self.ln_f = nn.LayerNorm(c, eps=eps)
            with torch.no_grad():  # GPT-2 init like mpitrain's (mpitrain's exact weights are copied in for --_check)
                for name, p in self.named_parameters():
                    if p.dim() >= 2:
                        p.normal_(0.0, m.init_std)
                    elif name.endswith(".bias"):
                        p.zero_()

        def forward(self, tokens, targets):
            x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # head tied to the token embedding
            return F.cross_entropy(logits.view(-1, m.vocab_size), targets.view(-1), reduction="sum")

    return GPT2()


def _mpitrain_reference(cfg, inputs, targets):
    """(named weight views, mean loss of one micro-batch) from mpitrain's own model at the config's seed.

    Written against both model APIs mpitrain has had (parameters inside GPT; stateless GPT + ReplicatedState), so a
    refactor there costs this benchmark its parity check at worst, never its timings."""
    from mpitrain.backend import make_backend
    from mpitrain.model.gpt import GPT
    backend = make_backend("cpu", "float32")
    try:
        from mpitrain.state.replicated import ReplicatedState
        gpt = GPT(cfg.model, backend)
        state = ReplicatedState(gpt.layouts, backend, cfg.train.seed)
        loss_sum, params = gpt.forward(state, inputs, targets)[0], state.params
    except (ImportError, TypeError):
        gpt = GPT(cfg.model, backend, cfg.train.seed)
        loss_sum, params = gpt.forward(inputs, targets)[0], gpt.params
    return list(params.named_views()), float(loss_sum) / inputs.size


def _copy_mpitrain_weights(model, named_views) -> None:
    """mpitrain stores linear weights (in, out); nn.Linear wants (out, in)."""
    import torch
    linear = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w_fc": "fc", "w_proj": "proj"}
    bias = {"bq": "q", "bv": "v", "bo": "o", "b_fc": "fc", "b_proj": "proj"}
    norm = {"norm1_w": ("ln1", "weight"), "norm1_b": ("ln1", "bias"),
            "norm2_w": ("ln2", "weight"), "norm2_b": ("ln2", "bias")}
    copied = 0
    with torch.no_grad():
        for name, view in named_views:
            value = torch.from_numpy(view.copy())
            unit, _, tensor = name.rpartition(".")
            if unit == "embed":
                (model.wte.weight if tensor == "wte" else model.wpe).copy_(value)
            elif unit == "head":
                getattr(model.ln_f, "weight" if tensor == "norm_w" else "bias").copy_(value)
            else:
                block = model.blocks[int(unit.split(".")[1])]
                if tensor in linear:
                    getattr(block, linear[tensor]).weight.copy_(value.T)
                elif tensor in bias:
                    getattr(block, bias[tensor]).bias.copy_(value)
                else:
                    module, attr = norm[tensor]
                    getattr(getattr(block, module), attr).copy_(value)
            copied += value.numel()
    n_torch = sum(p.numel() for p in model.parameters())
    if copied != n_torch:
        raise AssertionError(f"copied {copied} mpitrain parameters into a torch model of {n_torch}: not the same model")


def worker_torch(config: str, overrides: list[str], steps: int, warmup: int, threads: int, attention: str,
                 check: bool) -> dict:
    import numpy as np
    import torch

    from mpitrain.config import load_config
    from mpitrain.data.synthetic import SyntheticSampler

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = load_config(config, list(overrides) + ["data.synthetic=true", f"train.steps={warmup + steps}"])
    m, t, o = cfg.model, cfg.train, cfg.optim
    if m.arch != "gpt2":
        raise SystemExit(f"the torch comparison implements model.arch = 'gpt2' only, not {m.arch!r}")
    if t.global_batch % t.micro_batch:
        raise SystemExit("train.global_batch must be a multiple of train.micro_batch")
    accumulation = t.global_batch // t.micro_batch
    tokens_per_step = t.global_batch * m.seq_len

    model = _torch_gpt(cfg, attention)
    sampler = SyntheticSampler(m.vocab_size, m.seq_len, t.global_batch, t.seed)
    result = {"threads": threads, "attention": attention, "n_params": sum(p.numel() for p in model.parameters()),
              "torch_version": torch.__version__}
    if check:  # same model: mpitrain's weights copied in, the first micro-batch's loss must match mpitrain's
        inputs, targets = sampler.global_batch_rows(0, range(t.micro_batch))
        try:
            named_views, mp_loss = _mpitrain_reference(cfg, inputs, targets)
            _copy_mpitrain_weights(model, named_views)
        except Exception as exc:  # noqa: BLE001 - a parity check that cannot run is reported, timings still count
            result["parity"] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            with torch.no_grad():
                th_loss = float(model(torch.from_numpy(inputs), torch.from_numpy(targets))) / inputs.size
            result["parity"] = {"mpitrain_loss": mp_loss, "torch_loss": th_loss,
                                "rel_diff": abs(mp_loss - th_loss) / abs(mp_loss)}

    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices (embeddings included), as mpitrain
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    params = list(model.parameters())
    dloss = 1.0 / tokens_per_step  # mean over every token of the global batch, as mpitrain

    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        for micro in range(accumulation):
            rows = range(micro * t.micro_batch, (micro + 1) * t.micro_batch)
            inputs, targets = sampler.global_batch_rows(step, rows)
            loss = model(torch.from_numpy(inputs), torch.from_numpy(targets)) * dloss
            loss.backward()
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip)
        else:
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    result.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                  final_loss=float(loss.detach()) / dloss / np.prod(inputs.shape))
    return result


# ============================================================================ driver
def _env(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({var: str(threads) for var in THREAD_VARS})
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _run_json(cmd: list[str], threads: int, timeout: float = 120, extra_env: dict | None = None) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads, extra_env), capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))
    return json.loads(lines[-1])


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _human(flops: float | None) -> str:
    return "-" if flops is None else f"{flops / 1e9:,.1f} GFLOP/s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/bench-small.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override passed to every variant (repeatable)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per measurement (median taken)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every variant")
    parser.add_argument("--budget", type=float, default=165,
                        help="seconds: no new round starts if it would likely end after this (default 165)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="'all threads' (default: CPU count)")
    parser.add_argument("--eager", action="store_true",
                        help="also time torch with plain eager attention (matmul + mask + softmax), an extra column")
    parser.add_argument("--_worker", choices=["peak", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--_attention", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--_check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._worker == "peak":
        print(json.dumps(worker_peak(args.threads)))
        return 0
    if args._worker == "torch":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(worker_torch(args.config, args.overrides, args.steps, args.warmup, args.threads,
                                      args._attention, args._check)))
        return 0

    t_start = time.perf_counter()
    load_start = _loadavg()
    sys.path.insert(0, str(ROOT))
    from mpitrain.config import load_config
    cfg = load_config(ROOT / args.config if not Path(args.config).is_absolute() else args.config, args.overrides)
    micro = cfg.train.micro_batch
    all_threads = max(1, args.threads)
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    sets = [a for s in args.overrides for a in ("--set", s)]
    try:
        import torch  # noqa: F401  (only asked whether it is there; the workers import it)
        torch_reason = None
    except ImportError:
        torch_reason = "PyTorch is not installed (pip install torch) - torch columns skipped"
    mpiexec = _mpiexec()
    mpi_reason = None if mpiexec else "no mpiexec found beside python or on PATH - 2-rank DP run skipped"

    print(f"bench_step: {args.config}, {cfg.model.arch} {cfg.model.n_layer}L d{cfg.model.d_model} "
          f"h{cfg.model.n_head} T{cfg.model.seq_len} vocab {cfg.model.vocab_size}, micro-batch {micro}; "
          f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps); {all_threads} threads = all")
    for reason in (torch_reason, mpi_reason):
        if reason:
            print(f"  SKIP: {reason}")
    if load_start and load_start[0] > 0.5:
        print(f"  NOTE: load average {load_start[0]:.2f} at start: other work is running, numbers will be noisy")

    # 1. matmul peaks
    peaks = {}
    for threads in sorted({1, all_threads}):
        peaks[threads] = _run_json(me + ["--_worker", "peak", "--threads", str(threads)], threads)

    # 2-5. the variants, interleaved
    def mpitrain_cmd(global_batch: int, ranks: int) -> list[str]:
        cmd = [sys.executable, "-m", "mpitrain", "bench", "step", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), *sets, "--set", f"train.global_batch={global_batch}",
               "--set", f"train.micro_batch={micro}"]
        return ([mpiexec, "-n", str(ranks)] + cmd) if ranks > 1 else cmd

    def torch_cmd(attention: str, batch: int) -> list[str] | None:
        if torch_reason:
            return None
        return me + common + sets + ["--set", f"train.global_batch={batch}", "--set", f"train.micro_batch={batch}",
                                     "--_worker", "torch", "--threads", str(all_threads), "--_attention", attention]

    variants = {  # name -> (command or None, threads)
        "mpitrain": (mpitrain_cmd(cfg.train.global_batch, 1), all_threads),
        "torch_sdpa": (torch_cmd("sdpa", cfg.train.global_batch), all_threads),
        "torch_eager": (torch_cmd("eager", cfg.train.global_batch) if args.eager else None, all_threads),
        "torch_sdpa_2x_batch": (torch_cmd("sdpa", 2 * micro), all_threads),
        "mpitrain_1rank_1thread": (mpitrain_cmd(micro, 1), 1),
        "mpitrain_2ranks_1thread": (None if mpi_reason else mpitrain_cmd(2 * micro, 2), 1),
    }
    runs: dict[str, list[dict]] = {name: [] for name, (cmd, *_) in variants.items() if cmd}
    t_rounds = time.perf_counter() - t_start
    order = list(runs)
    rounds_done = 0
    for round_index in range(args.rounds):
        elapsed = time.perf_counter() - t_start
        per_round = (elapsed - t_rounds) / max(rounds_done, 1)
        if rounds_done and elapsed + per_round > args.budget:
            print(f"  stopping after {rounds_done} round(s): another would pass the {args.budget:.0f} s budget "
                  f"(the machine is busy?)")
            break
        rounds_done += 1
        for name in (order if round_index % 2 == 0 else order[::-1]):
            if round_index and time.perf_counter() - t_start > args.budget:
                print(f"  skipping the rest of round {round_index + 1}: past the {args.budget:.0f} s budget")
                break
            cmd, threads = variants[name]
            if name == "torch_sdpa" and round_index == 0:
                cmd = cmd + ["--_check"]
            result = _run_json(cmd, threads, timeout=300)
            runs[name].append(result)
            print(f"  round {round_index + 1}/{args.rounds} {name:<24} {result['tokens_per_s']:>9,.0f} tok/s  "
                  f"step {result['step_time_s'] * 1e3:7.1f} ms", flush=True)

    def summary(name):
        if name not in runs:
            return None
        tps = [r["tokens_per_s"] for r in runs[name]]
        best = max(runs[name], key=lambda r: r["tokens_per_s"])
        return {"tokens_per_s": best["tokens_per_s"], "tokens_per_s_median": statistics.median(tps),
                "tokens_per_s_all": tps, "step_time_s": best["step_time_s"], "best": best}

    s = {name: summary(name) for name in variants}
    flops_per_token = s["mpitrain"]["best"]["model_flops_per_token"]

    def ratio(a, b, key="tokens_per_s"):
        return s[a][key] / s[b][key] if s[a] and s[b] else None

    headline = {  # name -> (numerator, denominator, what)
        "mpitrain_over_torch_sdpa": ("mpitrain", "torch_sdpa",
                                     f"mpitrain 1 rank x {all_threads} threads / torch SDPA, batch {micro}"),
        "dp2_over_torch_sdpa_2x_batch": ("mpitrain_2ranks_1thread", "torch_sdpa_2x_batch",
                                         f"mpitrain 2 ranks x 1 thread / torch SDPA, batch {2 * micro}"),
        "dp_scaling_2_over_1": ("mpitrain_2ranks_1thread", "mpitrain_1rank_1thread",
                                "DP scaling: 2 ranks x 1 thread / 1 rank x 1 thread"),
    }
    ratios = {key: (ratio(a, b), ratio(a, b, "tokens_per_s_median")) for key, (a, b, _) in headline.items()}

    def paired(a, b):
        """Each round's ratio (the two variants ran within seconds of each other there): on a VM whose speed drifts
        between rounds these are steadier than ratios of bests or medians taken over different rounds."""
        if not (s[a] and s[b]):
            return []
        return [x / y for x, y in zip(s[a]["tokens_per_s_all"], s[b]["tokens_per_s_all"])]
    per_round = {key: paired(a, b) for key, (a, b, _) in headline.items()}
    headline_ratio = {key: statistics.median(rounds) if rounds else None for key, rounds in per_round.items()}
    numpy_peak_all, torch_peak_all = peaks[all_threads]["numpy"], peaks[all_threads]["torch"]

    def mfu(name, peak):
        return flops_per_token * s[name]["tokens_per_s"] / peak if s[name] and peak else None

    # ---- table
    print()
    print("matmul peak (float32, 1024^3, best of 0.3 s):")
    for threads, p in peaks.items():
        print(f"  {threads} thread(s): numpy {_human(p['numpy'])}   torch {_human(p['torch'])}")
    print()
    header = f"{'variant':<34}{'tokens/s (best)':>16}{'median':>10}{'step ms':>9}{'MFU':>7}"
    print(header)
    print("-" * len(header))
    rows = [("mpitrain", f"mpitrain 1 rank x {all_threads} threads", numpy_peak_all),
            ("torch_sdpa", f"torch SDPA {all_threads} threads", torch_peak_all),
            ("torch_eager", f"torch eager {all_threads} threads (extra)", torch_peak_all),
            ("torch_sdpa_2x_batch", f"torch SDPA {all_threads} threads, gb {2 * micro}", torch_peak_all),
            ("mpitrain_1rank_1thread", f"mpitrain 1 rank x 1 thread, gb {micro}", peaks[1]["numpy"]),
            ("mpitrain_2ranks_1thread", f"mpitrain 2 ranks x 1 thread, gb {2 * micro}", 2 * peaks[1]["numpy"])]
    # MFU against this benchmark's own peak readings (one per library and thread count, taken on a quiet start), not
    # the peak each run reads at its start: 2 ranks reading theirs at once read each other's load (MFU over 100%)
    for name, label, peak in rows:
        if not s[name]:
            continue
        m = mfu(name, peak)
        print(f"{label:<34}{s[name]['tokens_per_s']:>16,.0f}{s[name]['tokens_per_s_median']:>10,.0f}"
              f"{s[name]['step_time_s'] * 1e3:>9.1f}{100 * m:>6.1f}%")
    print()
    print("ratios: the median of the per-round ratios (each round's two runs were seconds apart); beside it the ratio "
          "of the best rounds")
    for key, (_, _, what) in headline.items():
        best, _ = ratios[key]
        if headline_ratio[key] is not None:
            verdict = "OK" if headline_ratio[key] >= TARGETS[key] else "BELOW TARGET"
            print(f"{what:<62} = {headline_ratio[key]:.2f} (best rounds {best:.2f}; target >= {TARGETS[key]}) "
                  f"{verdict}")
            print(f"{'':<62}   per round: {' '.join(f'{r:.2f}' for r in per_round[key])}")
    if s["torch_eager"]:
        print(f"{'mpitrain / torch eager attention (extra)':<62} = {ratio('mpitrain', 'torch_eager'):.2f}")
    parity = runs.get("torch_sdpa", [{}])[0].get("parity") if "torch_sdpa" in runs else None
    if parity and "error" in parity:
        print(f"same model check could not run: {parity['error']}")
    elif parity:
        print(f"same model check: first micro-batch loss mpitrain {parity['mpitrain_loss']:.6f} vs torch "
              f"{parity['torch_loss']:.6f} (rel diff {parity['rel_diff']:.1e}), "
              f"{runs['torch_sdpa'][0]['n_params']:,} parameters each")
    if "torch_sdpa" in runs and runs["torch_sdpa"][0]["n_params"] != s["mpitrain"]["best"]["n_params"]:
        print(f"WARNING: parameter counts differ: mpitrain {s['mpitrain']['best']['n_params']:,}, torch "
              f"{runs['torch_sdpa'][0]['n_params']:,} - not the same model")
    elapsed = time.perf_counter() - t_start
    print(f"total {elapsed:.0f} s")

    def compact(name):
        if not s[name]:
            return None
        out = {k: v for k, v in s[name].items() if k != "best"}
        best = s[name]["best"]
        for key in ("mfu", "peak_flops", "world_size", "threads"):
            if key in best:
                out[key] = best[key]
        return out

    report = {
        "benchmark": "bench_step", "config": args.config, "overrides": args.overrides,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "processor": _cpu_name(), "python": platform.python_version()},
        "steps": args.steps, "warmup": args.warmup, "rounds": rounds_done, "all_threads": all_threads,
        "micro_batch": micro, "seq_len": cfg.model.seq_len, "model_flops_per_token": flops_per_token,
        "peak_flops": {f"numpy_{t}t": p["numpy"] for t, p in peaks.items()}
        | {f"torch_{t}t": p["torch"] for t, p in peaks.items()},
        "results": {name: compact(name) for name in variants},
        "torch_sdpa_mfu": mfu("torch_sdpa", torch_peak_all),
        "ratios": {key: {"headline": headline_ratio[key], "best": best, "of_medians": median,
                         "per_round": per_round[key]} for key, (best, median) in ratios.items()},
        "ratio_mpitrain_over_torch_eager": ratio("mpitrain", "torch_eager"),
        "loadavg_start": load_start, "loadavg_end": _loadavg(), "targets": TARGETS,
        "parity": parity, "skipped": [r for r in (torch_reason, mpi_reason) if r], "elapsed_s": elapsed,
    }
    print(json.dumps(report))
    return 0


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
