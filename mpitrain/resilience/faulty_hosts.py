"""Hosts that a fault detector named: RUN_DIR/faults.jsonl, read by slurm/train.sbatch to exclude them.

Format: one JSON object per line, appended by whoever detects a fault on a machine (the watchdog, the replica check):
    {"host": "node7", "kind": "hang", "time": 1764570000.0, "rank": 3, "step": 120, "detail": "all_reduce on dp"}
A replayed bad step's record (attribution.py) also has "verdict": only a "persistent" one names a host to exclude.
"host" and "kind" are required; "time" (Unix seconds) lets a reader ignore faults older than its job; other keys are
for people. `record_fault` appends one line in one write (O_APPEND), so several ranks may report at once.

    python -m mpitrain.resilience.faulty_hosts RUN_DIR [--since UNIX_TIME] [--nodes "node1 node2 ..."]

prints the faulty hosts among --nodes as one comma-separated line (what `srun --exclude` takes), or nothing when
none is named or when excluding them would leave no node of --nodes to run on (said on stderr).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import click

from mpitrain.profile.jsonl import append_record

FAULTS_FILE = "faults.jsonl"


def this_host() -> str:
    """The name SLURM knows this machine by (SLURMD_NODENAME: several slurmd on one machine share a hostname)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def record_fault(run_dir: Path, kind: str, host: str | None = None, **details) -> dict:
    """Append one fault record to RUN_DIR/faults.jsonl; returns the record."""
    record = {"host": host or this_host(), "kind": kind, "time": time.time(), **details}
    append_record(Path(run_dir) / FAULTS_FILE, record)  # several ranks may report at once: one write each
    return record


def read_faults(run_dir: Path, since: float | None = None, warn=None) -> list[dict]:
    """The fault records of RUN_DIR (those at or after `since`, when given). A line that is not a JSON object with
    "host" and "kind" is skipped with a warning naming the file and line (a half-written last line after a crash)."""
    path = Path(run_dir) / FAULTS_FILE
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not record.get("host") or not record.get("kind"):
                raise ValueError("needs \"host\" and \"kind\"")
        except ValueError as exc:
            if warn is not None:
                warn(f"{path}:{number}: skipped, not a fault record ({exc})")
            continue
        if since is not None and float(record.get("time", 0.0)) < since:
            continue
        records.append(record)
    return records


HOST_NOT_AT_FAULT = ("genuine", "transient")  # replayed bad steps (attribution.py) that blame no machine


def faulty_hosts(records: list[dict]) -> list[str]:
    """Hosts named by the records, first-named first, each once; a bad step whose replay found the data or a
    passing glitch at fault ("verdict": genuine or transient) names none."""
    return list(dict.fromkeys(str(record["host"]) for record in records
                              if record.get("verdict") not in HOST_NOT_AT_FAULT))


def hosts_to_exclude(faulty: list[str], nodes: list[str]) -> tuple[list[str], str | None]:
    """The faulty hosts among `nodes` that can be excluded, and why none can (None when there is no reason)."""
    named = [host for host in faulty if host in nodes]
    if not named:
        return [], None
    if len(named) >= len(nodes):
        return [], f"every node of the allocation ({', '.join(nodes)}) was named faulty: excluding none"
    return named, None


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--since", type=float, default=None, help="Ignore faults recorded before this Unix time.")
@click.option("--nodes", default=None, help="The allocation's nodes (space- or comma-separated); default: any host.")
def main(run_dir, since, nodes):
    """Print the hosts to exclude from the next attempt, comma-separated (nothing when none)."""
    def warn(text):
        print(f"faulty_hosts: {text}", file=sys.stderr)
    faulty = faulty_hosts(read_faults(Path(run_dir), since, warn))
    if nodes is not None:
        faulty, why_not = hosts_to_exclude(faulty, nodes.replace(",", " ").split())
        if why_not:
            warn(why_not)
    if faulty:
        print(",".join(faulty))


if __name__ == "__main__":
    main()
