"""JSON-lines files that several processes append to and a crash may cut short (faults.jsonl,
injected_faults.jsonl, metrics.jsonl): one helper to append a record, one to read them back. And JSON files that one
process rewrites while others read them (heartbeats, flight records, the run directory's lock): one helper to replace
such a file whole, one to read it tolerating a missing or torn one."""
from __future__ import annotations

import json
import os
import threading
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


def write_json_atomically(path: Path, record: dict) -> None:
    """Write `record` as `path`, replaced by a rename so that a reader never sees half of it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps(record) + "\n")
    os.replace(temporary, path)


def read_json_object(path: Path) -> dict | None:
    """The JSON object in `path`; None when the file is missing, unreadable, cut short or not an object."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
