"""How much faster does `mpitrain data prepare` tokenize with several worker processes?

Trains a byte-level BPE once on the Python standard library (or takes `--tokenizer-file`), then runs
`mpitrain data prepare --tokenizer-file ... --workers W` over the same corpus for W = 1 and each `--workers` value,
interleaved over `--rounds` rounds (round 1 in order, round 2 reversed, ...). Prints each run's seconds, checks that
every output file is byte-identical to the one-worker file, and prints the median per-round speed-up against one
worker. On a machine with fewer free cores than workers the speed-up is below the worker count: the parent process
reads, splits and writes, and each worker starts a Python interpreter (spawned, not forked).

    .venv/bin/python benchmarks/bench_prepare.py --workers 2 4 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def prepare(out: Path, tokenizer_file: Path, workers: int, source: str) -> float:
    command = [sys.executable, "-m", "mpitrain", "data", "prepare", "--source", source, "--out", str(out),
               "--tokenizer-file", str(tokenizer_file), "--workers", str(workers)]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def trained_tokenizer(folder: Path, source: str) -> Path:
    """A 4096-token BPE trained on `source` by `mpitrain data prepare --tokenizer bpe`, written as tokenizer.json."""
    from mpitrain.data.dataset import TokenDataset
    data = folder / "bpe.h5"
    subprocess.run([sys.executable, "-m", "mpitrain", "data", "prepare", "--source", source, "--out", str(data),
                    "--tokenizer", "bpe", "--vocab-size", "4096", "--workers", "1"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    path = folder / "tokenizer.json"
    path.write_text(TokenDataset(data).tokenizer.description()["json"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--source", default="python-stdlib")
    parser.add_argument("--tokenizer-file", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        folder = Path(tmp)
        tokenizer = Path(args.tokenizer_file) if args.tokenizer_file else trained_tokenizer(folder, args.source)
        counts = [1] + [w for w in args.workers if w != 1]
        seconds: dict[int, list[float]] = {w: [] for w in counts}
        for round_index in range(args.rounds):
            for workers in counts if round_index % 2 == 0 else counts[::-1]:
                seconds[workers].append(prepare(folder / f"w{workers}.h5", tokenizer, workers, args.source))
                print(f"round {round_index + 1}: {workers} worker(s) {seconds[workers][-1]:.2f} s", flush=True)
            reference = (folder / "w1.h5").read_bytes()
            for workers in counts[1:]:
                if (folder / f"w{workers}.h5").read_bytes() != reference:
                    sys.exit(f"the file written with {workers} workers differs from the one-worker file")
        print("every file byte-identical to the one-worker file")
        for workers in counts[1:]:
            ratios = [one / many for one, many in zip(seconds[1], seconds[workers])]
            print(f"{workers} workers / 1 worker: speed-up {statistics.median(ratios):.2f}x (median of "
                  f"{len(ratios)} rounds; best rounds {min(seconds[1]):.2f} s and {min(seconds[workers]):.2f} s)")


if __name__ == "__main__":
    main()
