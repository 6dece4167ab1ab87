"""`mpitrain doctor hang RUN_DIR`: who stopped a job, read from the ranks' flight records (comm/flight.py).

Each rank that saw the hang wrote RUN_DIR/flight/rank_NNNNN.json: its last operations, each with its group's
sequence number, and how far it got on every channel (`entered`). Sequence numbers line up across ranks without a
clock: the n-th collective of a group is the same operation on every member. So, per channel (a group, or one
direction of point-to-point traffic):

    reached     the highest sequence number any member entered
    stuck       members that entered it and never completed it (their entry says "started")
    not entered members whose last sequence number is lower: they were elsewhere, and the record says where
                (the operation they waited on, their last operation, their phase and step)

A rank with no flight file did not write one: stopped (SIGSTOP, a frozen node) or dead (killed, crashed). That is
itself the answer, and the report says so, with what its heartbeat (RUN_DIR/heartbeat, resilience/heartbeat.py)
last said when there is one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mpitrain.comm.operations import format_bytes, format_ranks
from mpitrain.errors import MpitrainError
from mpitrain.resilience.heartbeat import read_heartbeats

NO_RECORD = "no record: stopped or dead"
ALIVE_MARGIN_S = 2.0  # twice the longest heartbeat interval (comm/watchdog.py beats at least once a second)


def read_flight_records(run_dir: Path) -> dict[int, dict]:
    """Every rank's flight record in RUN_DIR/flight, by world rank; a clear error when there is none."""
    directory = Path(run_dir) / "flight"
    if not directory.is_dir():
        raise MpitrainError(f"no flight records in {directory}: the directory does not exist (is {run_dir} a run "
                            "directory, and was fault.flight_ops > 0?)")
    records = {}
    for path in sorted(directory.glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MpitrainError(f"flight record {path} cannot be read: {exc}") from None
    if not records:
        raise MpitrainError(f"no flight records in {directory}: no rank_*.json file (no rank hung, failed or was "
                            "signalled, or fault.flight_ops = 0)")
    return records


@dataclass
class ChannelView:
    """One channel (a group's collectives, or one direction of point-to-point traffic) across its members."""
    channel: str
    group: str
    members: list[int]
    reached: int = 0  # the highest sequence number any member entered
    last_seq: dict = field(default_factory=dict)  # member -> its last sequence number (flight record or heartbeat)
    stuck: list = field(default_factory=list)  # members that started `reached` and never completed it
    lagging: list = field(default_factory=list)  # members whose last sequence number is below `reached`
    unknown: list = field(default_factory=list)  # members with neither a flight record nor a heartbeat
    from_heartbeat: list = field(default_factory=list)  # members whose last_seq is their heartbeat's (no record)
    operation: dict | None = None  # the ring entry of `reached` on one member that has it

    @property
    def broken(self) -> bool:
        return bool(self.stuck)


def channel_members(channel: str, group_members: list[int]) -> list[int]:
    """A point-to-point channel 'pp@0:2>3' is between ranks 2 and 3 only; a group's channel is all its members."""
    _, _, direction = channel.partition(":")
    if direction:
        source, _, dest = direction.partition(">")
        return [int(source), int(dest)]
    return list(group_members)


def _entry(record: dict, channel: str, seq: int) -> dict | None:
    for op in reversed(record.get("ops", [])):
        if op["channel"] == channel and op["seq"] == seq:
            return op
    return None


def view_channels(records: dict[int, dict], heartbeats: dict[int, dict]) -> list[ChannelView]:
    """Every channel some record names, with who reached what (records first; heartbeats for ranks without)."""
    described = {}
    for record in records.values():
        for channel, info in record.get("channels", {}).items():
            described.setdefault(channel, info)
    views = []
    for channel, info in sorted(described.items()):
        view = ChannelView(channel, info["group"], channel_members(channel, info["members"]))
        for rank in view.members:
            source = records.get(rank) or heartbeats.get(rank)
            if source is None:
                view.unknown.append(rank)
            else:
                view.last_seq[rank] = int(source.get("entered", {}).get(channel, 0))
                if rank not in records:
                    view.from_heartbeat.append(rank)
        view.reached = max(view.last_seq.values(), default=0)
        for rank, seq in sorted(view.last_seq.items()):
            if seq < view.reached:
                view.lagging.append(rank)
            elif rank in records:
                entry = _entry(records[rank], channel, view.reached)
                view.operation = view.operation or entry
                if entry is not None and entry["state"] == "started":
                    view.stuck.append(rank)
        views.append(view)
    return views


def world_ranks(records: dict, heartbeats: dict) -> list[int]:
    ranks = set(records) | set(heartbeats)
    for record in records.values():
        for info in record.get("channels", {}).values():
            ranks.update(info["members"])
    return sorted(ranks)


def alive_without_record(beat: dict | None, newest: float | None) -> bool:
    """A heartbeat newer than ALIVE_MARGIN_S before the last flight record: the rank was still running then (a
    stopped or dead rank's heartbeat is at least fault.timeout_s older than its peers' records)."""
    return bool(beat and newest and beat.get("time", 0.0) >= newest - ALIVE_MARGIN_S)


def describe_rank(rank: int, records: dict, heartbeats: dict, newest: float | None) -> str:
    """What a rank was doing: from its flight record, else what its heartbeat last said, else nothing."""
    record = records.get(rank)
    if record is None:
        beat = heartbeats.get(rank)
        if beat is None:
            return f"rank {rank}: {NO_RECORD} (no heartbeat either)"
        waiting = (beat.get("operation") or {}).get("describe") or "not in a communication"
        said = f"step {beat.get('step')}, state {beat.get('state')}, {waiting}"
        if alive_without_record(beat, newest):
            return (f"rank {rank}: no record, but its heartbeat was alive when the others wrote theirs (the job "
                    f"was ended before its own watchdog fired): {said}")
        age = f", {newest - beat['time']:.0f} s before the last record" if newest and "time" in beat else ""
        return f"rank {rank}: {NO_RECORD}; its last heartbeat{age}: {said}"
    parts = [f"step {record.get('step')}", f"phase {record.get('phase') or 'unknown'}"]
    waiting = record.get("waiting")
    parts.append(f"waiting in {_op_text(waiting)}" if waiting else "not in a communication")
    ops = record.get("ops", [])
    if ops:
        last = ops[-1]
        parts.append(f"last operation {_op_text(last)} ({last['state']})")
    return f"rank {rank} ({record.get('reason')}): " + ", ".join(parts)


def _op_text(op: dict) -> str:
    return f"{op['name']} #{op['seq']} of {format_bytes(op['nbytes'])} on {op['channel']}"


def diagnose(run_dir: Path) -> str:
    """The report of `mpitrain doctor hang`."""
    records = read_flight_records(run_dir)
    heartbeats = read_heartbeats(Path(run_dir) / "heartbeat") if (Path(run_dir) / "heartbeat").is_dir() else {}
    ranks = world_ranks(records, heartbeats)
    missing = [rank for rank in ranks if rank not in records]
    newest = max((record.get("time", 0.0) for record in records.values()), default=None)
    silent = [rank for rank in missing if not alive_without_record(heartbeats.get(rank), newest)]
    lines = [f"flight records of {len(records)} of {len(ranks)} ranks in {Path(run_dir) / 'flight'}"
             + (f"; none from rank(s) {format_ranks(silent)}: {NO_RECORD}" if silent else "")]
    views = view_channels(records, heartbeats)
    broken = [view for view in views if view.broken]
    for view in broken:
        lines += channel_lines(view, records, heartbeats, newest)
    quiet = len(views) - len(broken)
    lines.append(f"{quiet} other channel(s): no member stuck in an operation")
    lines.append(verdict(broken, records, missing, heartbeats, newest))
    return "\n".join(lines)


def channel_lines(view: ChannelView, records: dict, heartbeats: dict, newest: float | None) -> list[str]:
    op = view.operation or {}
    what = f"{op.get('name', 'operation')} #{view.reached}" + (f" of {format_bytes(op['nbytes'])}" if op else "")
    head = f"group {view.group} ({view.channel}, world ranks {format_ranks(view.members)}): highest sequence "
    lines = [head + f"{view.reached} ({what})",
             f"  stuck in it (started, never completed): {_ranks(view.stuck)}"]
    for rank in view.lagging:
        source = ", from its last heartbeat" if rank in view.from_heartbeat else ""
        lines.append(f"  never entered it (last sequence {view.last_seq[rank]}{source}): "
                     + describe_rank(rank, records, heartbeats, newest))
    for rank in view.unknown:
        lines.append("  never entered it: " + describe_rank(rank, records, heartbeats, newest))
    return lines


def verdict(broken: list[ChannelView], records: dict, missing: list[int], heartbeats: dict,
            newest: float | None) -> str:
    """One line: the ranks at the root (behind in a collective others are stuck in, and stuck in nothing
    themselves) and, for each, the collectives (group and sequence) the others wait in for it."""
    if not broken:
        tail = f"; rank(s) {format_ranks(missing)}: {NO_RECORD}" if missing else ""
        return "verdict: no rank is stuck in an operation" + tail
    stuck = {rank for view in broken for rank in view.stuck}
    behind = {rank for view in broken for rank in view.lagging + view.unknown} - stuck
    # a rank without a record whose heartbeat was alive waited elsewhere, ended before it could write: not a root
    roots = sorted(rank for rank in behind if rank in records or not alive_without_record(heartbeats.get(rank), newest))
    roots = roots or sorted(behind)
    if not roots:
        where = "; ".join(f"{_name(view)} #{view.reached} of group {view.group} ({view.channel})" for view in broken)
        return f"verdict: every member arrived, yet ranks are stuck in {where} (MPI or the network is stuck)"
    parts = []
    for rank in roots:
        waits = [f"{_name(view)} #{view.reached} of group {view.group} ({view.channel}), where "
                 f"{_ranks(view.stuck)} {'waits' if len(view.stuck) == 1 else 'wait'}"
                 for view in broken if rank in view.lagging + view.unknown]
        state = f" ({NO_RECORD})" if rank not in records else ""
        parts.append(f"rank {rank}{state} never entered " + ", nor ".join(waits))
    return "verdict: " + "; ".join(parts)


def _name(view: ChannelView) -> str:
    return (view.operation or {}).get("name", "operation")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranks(ranks)
