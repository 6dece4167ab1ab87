"""JSON-lines files that several processes append to and a crash may cut short (faults.jsonl,
injected_faults.jsonl, metrics.jsonl): one helper to append a record, one to read them back."""
from __future__ import annotations

import json
import os
from pathlib import Path


def append_record(path: Path, record: dict, durable: bool = False) -> None:
    """Append `record` as one line in one write (O_APPEND: lines of concurrent writers do not interleave).
    durable: fsync before returning, for a record that must be on disk before the process kills itself."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (json.dumps(record) + "\n").encode())
        if durable:
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_records(path: Path) -> list[dict]:
    """The file's JSON objects in order; none when it is missing. A line that is not one (torn by the crash of
    its writer) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
