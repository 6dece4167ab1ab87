"""Batch-level auxiliary loss against DeepSeek-V3's auxiliary-loss-free bias balancing, side by side.

Trains the quick-start model (configs/quickstart.toml: 4 layers, d_model 128) with every block's MLP replaced by
`--experts` experts (top `--top-k`), expert-parallel over `-n` ranks, twice on the default corpus (data/stdlib.h5,
made here if missing) for `--steps` steps: once with model.moe.balance = "aux_loss" (coefficient `--aux-loss`), once
with balance = "bias" (rate `--bias-rate`, sequence-level loss `--seq-aux-loss`). Prints, for each, the busiest
expert's share over the uniform 1/E per MoE block (mean over the last `--last` logged steps; 1.0 = perfect balance),
the worst block, and the last validation loss.

    nice -n 10 .venv/bin/python benchmarks/bench_moe_balance.py -n 2 --experts 4 --top-k 2 --steps 300
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def train(args, data: Path, balance: str) -> list[dict]:
    """One run; its metrics.jsonl rows."""
    if balance == "aux_loss":
        moe = f"{{experts = {args.experts}, top_k = {args.top_k}, aux_loss = {args.aux_loss}}}"
    else:
        moe = (f"{{experts = {args.experts}, top_k = {args.top_k}, balance = 'bias', bias_rate = {args.bias_rate}, "
               f"seq_aux_loss = {args.seq_aux_loss}}}")
    out = Path(args.out) / balance
    if args.reuse and (REPO / out / "metrics.jsonl").exists():  # a finished run of the same settings
        return [json.loads(line) for line in (REPO / out / "metrics.jsonl").read_text().splitlines()]
    settings = [f"model.moe={moe}", f"parallel.ep={args.n}", f"train.steps={args.steps}", "train.log_every=10",
                f"train.eval_every={args.eval_every}", "train.sample_tokens=0", f"data.path={data}"]
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", str(args.n), "configs/quickstart.toml",
               "--out", str(out)]
    for setting in settings:
        command += ["--set", setting]
    subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                   stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (REPO / out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], last: int) -> dict:
    """Per MoE block: the busiest expert over uniform, averaged over the last logged steps; and the losses."""
    tail = [r["expert_load"] for r in records if "expert_load" in r][-last:]
    busiest = {block: float(np.mean([t[block]["max_over_uniform"] for t in tail])) for block in tail[0]}
    shares = [r["expert_shares"] for r in records if "expert_shares" in r][-last:]
    mean_shares = {block: np.mean([s[block] for s in shares], axis=0) for block in shares[0]}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"busiest": busiest, "worst": max(busiest.values()), "shares": mean_shares,
            "val_loss": val[-1] if val else float("nan"), "loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (= parallel.ep)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--aux-loss", type=float, default=0.01)
    parser.add_argument("--bias-rate", type=float, default=0.01)  # 300 steps: 1e-3 (DeepSeek-V3's) moves too little
    parser.add_argument("--seq-aux-loss", type=float, default=0.0)
    parser.add_argument("--out", default="runs/bench_moe_balance")
    parser.add_argument("--last", type=int, default=5, help="logged steps the loads are averaged over")
    parser.add_argument("--reuse", action="store_true", help="read the metrics of runs already in --out")
    args = parser.parse_args()
    data = REPO / "data" / "stdlib.h5"
    if not data.exists():
        from mpitrain.data.prepare import prepare_dataset
        prepare_dataset("python-stdlib", data)
    results = {balance: summary(train(args, data, balance), args.last) for balance in ("aux_loss", "bias")}
    print(f"\n{args.experts} experts, top {args.top_k}, {args.steps} steps on {args.n} ranks; busiest expert's share "
          f"over uniform 1/{args.experts} (mean of the last {args.last} logged steps; 1.00 = balanced)")
    print(f"{'':24}{'aux_loss ' + str(args.aux_loss):>24}{'bias ' + str(args.bias_rate):>24}")
    for block in results["aux_loss"]["busiest"]:
        print(f"{'block ' + block:24}" + "".join(f"{results[b]['busiest'][block]:>24.3f}" for b in results))
        print(f"{'  shares':24}" + "".join(f"{' '.join(f'{s:.3f}' for s in results[b]['shares'][block]):>24}"
                                           for b in results))
    for key, label in (("worst", "worst block"), ("loss", "train loss (last)"), ("val_loss", "val loss (last)")):
        print(f"{label:24}" + "".join(f"{results[b][key]:>24.4f}" for b in results))
    bias = results["bias"]
    print(f"bias keeps every expert within 1.3x of uniform: {'yes' if bias['worst'] <= 1.3 else 'NO'}; "
          f"val loss bias - aux_loss: {bias['val_loss'] - results['aux_loss']['val_loss']:+.4f}")
    print(json.dumps({b: {k: v for k, v in r.items() if k != "shares"} for b, r in results.items()}))


if __name__ == "__main__":
    main()
