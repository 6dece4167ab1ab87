"""Heartbeat files: RUN_DIR/heartbeat/rank_NNNNN.json, one per rank, so that a supervisor or a person sees who stopped.

The rank's watchdog thread (mpitrain/comm/watchdog.py) rewrites its file about every second (every timeout_s / 5
when that is shorter), atomically: a temporary file in the same directory, then a rename, so a reader never sees
half a record. The watchdog also reads its peers' files to find out who did not arrive at a hung operation.

    {"rank": 1, "host": "node07", "pid": 4242, "time": 1764570000.5, "beat": 12, "state": "running", "step": 7,
     "operation": null,
     "entered": {"world@0": 14, "dp@0": 40, "pp@0:0>1": 8}}

    time       seconds since the epoch (the writer's clock) of this beat; beat counts the rewrites
    state      "running"; at the end "finished", "failed" (an exception) or "hang" (its watchdog is aborting the job)
    step       the training step (from 1) the rank is in
    operation  while the rank is blocked on a communication: {"name", "group", "channel", "seq", "nbytes", "peers",
               "describe", "waiting_s"}, else null
    entered    per channel (a group "KIND@FIRST_WORLD_RANK", or one direction "KIND@FIRST:SRC>DST" of point-to-point
               traffic), the sequence number of the last operation the rank entered

A file whose beat stops changing while its state is "running" belongs to a rank that is stopped, dead or
unreachable. `fault.heartbeat = false` turns the files off. Ranks compare their own files, so RUN_DIR must be on a
filesystem every node sees (as checkpoints already require).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from mpitrain.comm.operations import ProgressRecord
from mpitrain.comm.watchdog import start_watchdog
from mpitrain.errors import ConfigError
from mpitrain.resilience.faulty_hosts import record_fault, this_host


class HeartbeatFiles:
    """Write this rank's heartbeat and read any rank's, in one directory (RUN_DIR/heartbeat)."""

    def __init__(self, directory: Path, world_rank: int):
        self.directory = Path(directory)
        self.world_rank = world_rank
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"fault.heartbeat: cannot create {self.directory} ({exc.strerror}); make the run "
                              f"directory writable or set fault.heartbeat = false") from None

    def path(self, world_rank: int) -> Path:
        return self.directory / f"rank_{world_rank:05d}.json"

    def write(self, record: dict) -> None:
        target = self.path(self.world_rank)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps(record) + "\n")
        os.replace(temporary, target)

    def read(self, world_rank: int) -> dict | None:
        """The rank's last heartbeat, or None when it has none (yet) or it cannot be parsed."""
        try:
            record = json.loads(self.path(world_rank).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None


def read_heartbeats(directory: Path) -> dict[int, dict]:
    """Every rank's heartbeat in a directory, by world rank (for a supervisor or `mpitrain` tools)."""
    beats = {}
    for path in sorted(Path(directory).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            beats[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def start_fault_watch(fault, world_comm, run_dir: Path):
    """This rank's watchdog (config [fault]: timeout_s, heartbeat), started, with heartbeats in RUN_DIR/heartbeat and
    suspects of a hang recorded in RUN_DIR/faults.jsonl. Use as `with start_fault_watch(...) as watchdog:`; the
    groups enter their operations in `watchdog.progress` (pass it to the Mesh)."""
    rank = world_comm.Get_rank()
    heartbeats = HeartbeatFiles(Path(run_dir) / "heartbeat", rank) if fault.heartbeat else None
    return start_watchdog(world_comm, ProgressRecord(rank), fault.timeout_s, heartbeats,
                          record_fault=lambda **record: record_fault(run_dir, **record), host=this_host())
