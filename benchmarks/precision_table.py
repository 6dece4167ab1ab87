"""The quickstart config trained in bf16 and under each FP8 recipe (precision.fp8): validation loss and its
difference from bf16, as a markdown table (README.md, "Low precision").

    python benchmarks/precision_table.py [--steps 500] [--ranks 1] [--recipes none,tensor,delayed,block,mxfp8]
                                         [--data data/stdlib.h5] [--out /tmp/precision-table]

Each run is `mpitrain launch -n RANKS configs/quickstart.toml --set precision.compute=bfloat16 --set
precision.fp8=RECIPE --set train.steps=STEPS`, evaluated at its last step (train.eval_every = STEPS) on the same
validation batches; the same seed, so the same initial weights and batches, and only the precision differs. The
data file is prepared first when missing (`mpitrain data prepare --source python-stdlib`). The last line is one JSON
object with every number.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "quickstart.toml"


def prepare(data: Path) -> None:
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "mpitrain", "data", "prepare", "--source", "python-stdlib", "--out",
                        str(data)], check=True, cwd=REPO)


def run(recipe: str, steps: int, ranks: int, data: Path, out: Path) -> dict:
    """One training run; its last validation loss and wall time."""
    run_dir = out / recipe
    settings = ["precision.compute=bfloat16", f"precision.fp8={recipe}", f"train.steps={steps}",
                f"train.eval_every={steps}", f"data.path={data}", "train.sample_tokens=0", "checkpoint.every=0"]
    command = [sys.executable, "-m", "mpitrain", "launch", "-n", str(ranks), str(CONFIG), "--out", str(run_dir)]
    command += [arg for setting in settings for arg in ("--set", setting)]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"precision_table: the {recipe} run failed ({result.returncode}): "
                         f"{(result.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r for r in records if "val_loss" in r]
    if not evaluated:
        raise SystemExit(f"precision_table: the {recipe} run logged no validation loss ({run_dir / 'metrics.jsonl'})")
    return {"recipe": recipe, "val_loss": evaluated[-1]["val_loss"], "train_loss": records[-1].get("loss"),
            "seconds": round(seconds, 1)}


def table(results: list[dict], steps: int, ranks: int) -> str:
    base = next((r["val_loss"] for r in results if r["recipe"] == "none"), None)
    lines = [f"quickstart (configs/quickstart.toml), {steps} steps, {ranks} rank(s), bfloat16 compute",
             "", "| precision.fp8 | validation loss | difference from bf16 | run time |", "|---|---|---|---|"]
    for r in results:
        name = "none (bf16)" if r["recipe"] == "none" else r["recipe"]
        difference = "" if base is None or r["recipe"] == "none" else f"{r['val_loss'] - base:+.4f}"
        lines.append(f"| {name} | {r['val_loss']:.4f} | {difference} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--recipes", default="none,tensor,delayed,block,mxfp8")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "stdlib.h5")
    parser.add_argument("--out", type=Path, default=Path("/tmp/precision-table"))
    args = parser.parse_args()
    prepare(args.data)
    results = []
    for recipe in args.recipes.split(","):
        results.append(run(recipe, args.steps, args.ranks, args.data.resolve(), args.out))
        print(f"{recipe}: validation loss {results[-1]['val_loss']:.4f} ({results[-1]['seconds']:.0f} s)", flush=True)
    print(table(results, args.steps, args.ranks))
    print(json.dumps({"steps": args.steps, "ranks": args.ranks, "results": results}))


if __name__ == "__main__":
    main()
