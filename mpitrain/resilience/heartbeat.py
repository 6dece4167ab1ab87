"""Heartbeat files: RUN_DIR/heartbeat/node_NNNNN.json, one per node, so that a supervisor or a person sees who stopped.

Every rank's watchdog thread (mpitrain/comm/watchdog.py) publishes its record about every second (every timeout_s / 5
when that is shorter) into its slot of memory shared by the ranks of its node (an MPI shared window over the node's
ranks: no message, no wait). The node's first rank writes the records of all its node's ranks as ONE file, replaced
whole (a temporary file in the same directory, then a rename), so a reader never sees half a file and the shared
filesystem sees one writer per node instead of one per rank. Ranks of one node read each other's records from the
shared memory itself; a rank on another node reads the node's file.

    {"node": 0, "writer": 0, "host": "node07", "time": 1764570000.5,
     "ranks": {"0": RECORD, "1": RECORD, ...}}

    RECORD:
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

A record whose beat stops changing while its state is "running" belongs to a rank that is stopped, dead or
unreachable; when a node's writer stops, the whole node's records stop in its file (a stopped or lost node is what
that usually is). `read_heartbeats` returns every rank's record from a directory (node files, and the per-rank files
rank_NNNNN.json that `HeartbeatFiles` writes where no shared window can be made). `fault.heartbeat = false` turns
the files off. Ranks compare their peers' files, so RUN_DIR must be on a filesystem every node sees (as checkpoints
already require).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from mpitrain.comm.operations import ProgressRecord
from mpitrain.comm.watchdog import start_watchdog
from mpitrain.errors import ConfigError
from mpitrain.profile.jsonl import read_json_object, write_json_atomically
from mpitrain.resilience.faulty_hosts import record_fault, this_host

SLOT_BYTES = 1 << 16  # a rank's record in its node's shared memory (a record takes about 1 kB)
HEADER = 2  # uint64 words before the record: its version (odd while a write is under way) and its length
FINAL_WAIT_S = 5.0  # how long a node's writer, finishing, waits for its ranks' last records


def make_directory(directory: Path) -> Path:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"fault.heartbeat: cannot create {directory} ({exc.strerror}); make the run "
                          f"directory writable or set fault.heartbeat = false") from None
    return directory


class HeartbeatFiles:
    """Write this rank's heartbeat and read any rank's, one file per rank in one directory (RUN_DIR/heartbeat): where
    no shared window can be made, and in tests of the watchdog."""

    def __init__(self, directory: Path, world_rank: int):
        self.directory = make_directory(Path(directory))
        self.world_rank = world_rank

    def path(self, world_rank: int) -> Path:
        return self.directory / f"rank_{world_rank:05d}.json"

    def write(self, record: dict) -> None:
        write_json_atomically(self.path(self.world_rank), record)

    def read(self, world_rank: int) -> dict | None:
        """The rank's last heartbeat, or None when it has none (yet) or it cannot be parsed."""
        return read_json_object(self.path(world_rank))


class NodeSlots:
    """One slot per rank of a node, in memory that every rank of the node maps (`array`: ranks x SLOT_BYTES bytes).
    A rank writes its own slot (`mine`) and reads any: the slot's version is odd while a write is under way and
    changes with each, so a read that overlapped a write is done again. `keep`: what holds the memory (MPI objects)."""

    def __init__(self, array: np.ndarray, mine: int, keep=()):
        self.array, self.mine, self._keep = array, mine, keep

    def put(self, payload: bytes) -> None:
        if len(payload) > SLOT_BYTES - 8 * HEADER:
            raise ValueError(f"a heartbeat record of {len(payload)} bytes does not fit its slot of {SLOT_BYTES}")
        slot = self.array[self.mine]
        header = slot[:8 * HEADER].view(np.uint64)
        header[0] += 1  # odd: being written
        slot[8 * HEADER:8 * HEADER + len(payload)] = np.frombuffer(payload, np.uint8)
        header[1] = len(payload)
        header[0] += 1

    def get(self, index: int) -> dict | None:
        """The record in slot `index`, or None when it has none (yet)."""
        slot = self.array[index]
        header = slot[:8 * HEADER].view(np.uint64)
        for _ in range(1000):
            version = int(header[0])
            if version % 2 == 0:
                payload = slot[8 * HEADER:8 * HEADER + int(header[1])].tobytes()
                if int(header[0]) == version:
                    return json.loads(payload) if version else None
            time.sleep(0)  # its writer is half-way: let it finish
        return None


class NodeHeartbeats:
    """The heartbeats of a node's ranks: this rank's record goes to its slot of `slots`; the node's first rank
    (`node_ranks[0]`) also writes all of them as RUN_DIR/heartbeat/node_NNNNN.json. Reads come from the slots for
    ranks of this node, from their node's file for the others. `node_of_rank`: every world rank's node index."""

    def __init__(self, directory: Path, world_rank: int, node_of_rank: list[int], slots: NodeSlots,
                 final_wait_s: float = FINAL_WAIT_S):
        self.directory = make_directory(Path(directory))
        self.world_rank, self.node_of_rank, self.slots = world_rank, list(node_of_rank), slots
        self.node = self.node_of_rank[world_rank]
        self.node_ranks = [rank for rank, node in enumerate(self.node_of_rank) if node == self.node]
        self.writer = self.node_ranks[0] == world_rank
        self.final_wait_s = final_wait_s
        self._files: dict[int, tuple[tuple, dict]] = {}  # node -> (file's identity, parsed): read again when changed

    def path(self, node: int) -> Path:
        return self.directory / f"node_{node:05d}.json"

    def write(self, record: dict) -> None:
        self.slots.put(json.dumps(record).encode())
        if not self.writer:
            return
        if record.get("state") == "finished":  # the file keeps the node's last records: wait for its ranks' own
            deadline = time.monotonic() + self.final_wait_s
            while time.monotonic() < deadline and any((beat or {}).get("state") == "running"
                                                      for beat in self._node_records().values()):
                time.sleep(0.02)
        write_json_atomically(self.path(self.node), {"node": self.node, "writer": self.world_rank,
                                                     "host": record.get("host"), "time": record.get("time"),
                                                     "ranks": self._node_records()})

    def _node_records(self) -> dict[str, dict]:
        records = {str(rank): self.slots.get(index) for index, rank in enumerate(self.node_ranks)}
        return {rank: record for rank, record in records.items() if record is not None}

    def read(self, world_rank: int) -> dict | None:
        """The rank's last heartbeat, or None when it has none (yet) or it cannot be parsed."""
        node = self.node_of_rank[world_rank]
        if node == self.node:
            return self.slots.get(self.node_ranks.index(world_rank))
        path = self.path(node)
        try:
            status = path.stat()
        except OSError:
            return None
        # each write is a new file (a rename): its inode tells it apart where mtime is coarse (1 s on some NFS)
        changed = (status.st_ino, status.st_mtime_ns, status.st_size)
        if node not in self._files or self._files[node][0] != changed:
            self._files[node] = (changed, read_json_object(path) or {})
        ranks = self._files[node][1].get("ranks")
        return ranks.get(str(world_rank)) if isinstance(ranks, dict) else None


def read_heartbeats(directory: Path) -> dict[int, dict]:
    """Every rank's heartbeat in a directory, by world rank (for a supervisor or `mpitrain` tools): from the node
    files and from per-rank files; a rank found in several keeps its newest record."""
    directory = Path(directory)
    records = [read_json_object(path) for path in sorted(directory.glob("rank_*.json"))]
    for node in (read_json_object(path) for path in sorted(directory.glob("node_*.json"))):
        ranks = (node or {}).get("ranks")
        records += list(ranks.values()) if isinstance(ranks, dict) else []
    beats: dict[int, dict] = {}
    for record in records:
        try:
            rank, when = int(record["rank"]), float(record.get("time", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        if rank not in beats or when >= float(beats[rank].get("time", 0.0)):
            beats[rank] = record
    return beats


def node_heartbeats(directory: Path, world_comm) -> NodeHeartbeats | HeartbeatFiles:
    """Collective over `world_comm`: the node's shared slots (an MPI shared window over the ranks that share
    memory) and every rank's node. Rank 0 first removes the heartbeat files of an earlier attempt of the run (their
    ranks may sit on other nodes now). Per-rank files where MPI cannot make a shared window."""
    from mpi4py import MPI

    rank = world_comm.Get_rank()
    directory = make_directory(Path(directory))
    if rank == 0:
        for stale in [*directory.glob("node_*.json"), *directory.glob("rank_*.json")]:
            stale.unlink(missing_ok=True)
    local = world_comm.Split_type(split_type=MPI.COMM_TYPE_SHARED, key=rank)
    local_ranks = local.allgather(rank)
    leaders = world_comm.allgather(local_ranks[0]) if world_comm.Get_size() > 1 else [0]
    node_index = {leader: node for node, leader in enumerate(sorted(set(leaders)))}
    try:
        window = MPI.Win.Allocate_shared(SLOT_BYTES * len(local_ranks) if local.Get_rank() == 0 else 0, 1,
                                         comm=local)
    except (MPI.Exception, NotImplementedError):
        world_comm.Barrier()
        return HeartbeatFiles(directory, rank)
    memory, _ = window.Shared_query(0)
    array = np.ndarray((len(local_ranks), SLOT_BYTES), dtype=np.uint8, buffer=memory)
    array[local.Get_rank(), :8 * HEADER] = 0  # an empty slot (version 0)
    world_comm.Barrier()  # every slot empty, stale files gone, before anyone beats
    slots = NodeSlots(array, local.Get_rank(), keep=(window, local))
    return NodeHeartbeats(directory, rank, [node_index[leader] for leader in leaders], slots)


def start_fault_watch(fault, world_comm, run_dir: Path):
    """This rank's watchdog (config [fault]: timeout_s, heartbeat), started, with heartbeats in RUN_DIR/heartbeat and
    suspects of a hang recorded in RUN_DIR/faults.jsonl. Use as `with start_fault_watch(...) as watchdog:`; the
    groups enter their operations in `watchdog.progress` (pass it to the Mesh)."""
    rank = world_comm.Get_rank()
    heartbeats = node_heartbeats(Path(run_dir) / "heartbeat", world_comm) if fault.heartbeat else None
    return start_watchdog(world_comm, ProgressRecord(rank), fault.timeout_s, heartbeats,
                          record_fault=lambda **record: record_fault(run_dir, **record), host=this_host())
