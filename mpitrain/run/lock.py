"""One writer per run directory: RUN_DIR/.lock, taken by rank 0 before anything is written there.

Two jobs writing one run directory would interleave their metrics.jsonl rows, overwrite each other's heartbeats and
checkpoints, and a `--resume` of a live run would restore a state the live run is still changing. So rank 0 takes
the lock first (before config.toml, metrics.jsonl, heartbeats, checkpoints), every rank learns the verdict from it,
and a second job is refused in one line naming the holder, with RUN_DIR_IN_USE_EXIT_CODE:

    {"job": "local", "attempt": 0, "host": "node07", "pid": 1234, "pid_start": 98765, "boot_id": "6c1f...",
     "started": 1764570000.1, "heartbeat": 1764570600.3, "token": "9f8e...", "run_dir": "runs/x"}

    job        SLURM_JOB_ID, else MPITRAIN_JOB_ID (`mpitrain launch --max-restarts` sets it for its attempts),
               else "local"; attempt: MPITRAIN_ATTEMPT, else SLURM_RESTART_COUNT, else 0
    host       this_host(): SLURMD_NODENAME, else the host name
    pid        rank 0's process; pid_start its start time in clock ticks (/proc), so that a reused pid is not taken
               for the holder; boot_id tells two machines that share a host name apart
    started    when the lock was taken; heartbeat: refreshed every REFRESH_S while the job lives (seconds since the
               epoch, the holder's clock)
    token      unique per taking: only the job that took the lock refreshes or removes it

Taking it is atomic on local filesystems and on NFS: the whole record is written to a file of its own, then
hard-linked to `.lock` (os.link fails when `.lock` exists; a link is atomic on NFS, where O_EXCL was not always, and a
reader never sees a half-written lock). On a filesystem without hard links it is created with O_CREAT | O_EXCL, and a
lock found unreadable is looked at again before it counts as abandoned. A lock left by a dead job is taken over with
one line saying so: when it belongs to an earlier attempt of this job (the same SLURM_JOB_ID after a requeue, the
same `mpitrain launch` supervisor: an attempt starts only after the one before it ended, whose last processes may
still be on their way out under a loaded machine); on the same host when its process is gone; from another host when
its heartbeat is older than stale_after_s (max(STALE_AFTER_S, 2 x fault.timeout_s)). The stale lock is first
renamed aside (only one of two jobs racing for it can), then the link is tried again. The lock is removed when the
run ends, normally, with an error or on a stop request; a killed job leaves it, for the rules above.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

from mpitrain.errors import ConfigError
from mpitrain.profile.jsonl import read_json_object as read_lock  # the lock's record, or None
from mpitrain.resilience.faulty_hosts import this_host

LOCK_NAME = ".lock"
RUN_DIR_IN_USE_EXIT_CODE = 73  # EX_CANTCREAT: another live job writes this run directory; not restarted
STALE_AFTER_S = 600.0  # a holder on another host silent this long is taken for dead
REFRESH_S = 30.0
LOOKS = 3  # tries to take the lock (one may be released, taken over or still being written meanwhile)
UNREADABLE_WAIT_S = 0.5  # a lock made without a hard link (see _link) may be read before its record is written
JOB_ID_VARIABLES = ("SLURM_JOB_ID", "MPITRAIN_JOB_ID")


def this_job(environ=os.environ) -> str:
    return next((environ[name] for name in JOB_ID_VARIABLES if environ.get(name)), "local")


def this_attempt(environ=os.environ) -> int:
    """Which attempt of its job this is: `mpitrain launch` and slurm/train.sbatch count them, a requeue counts too."""
    for name in ("MPITRAIN_ATTEMPT", "SLURM_RESTART_COUNT"):
        with contextlib.suppress(ValueError):
            return int(environ.get(name, ""))
    return 0


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc), or None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ")" may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def pid_alive(pid: int, started: int | None) -> bool:
    """Whether process `pid` runs on this machine and is the one that started at `started` (when known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    if _process_state(pid) == "Z":  # exited, not yet reaped (an orphan in a container whose init reaps nothing)
        return False
    now_started = process_start(pid)
    return started is None or now_started is None or now_started == started


def _process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def clock(unix_time: float) -> str:
    same_day = time.localtime(unix_time)[:3] == time.localtime()[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", time.localtime(unix_time))


def describe_holder(holder: dict) -> str:
    return (f"job {holder.get('job', '?')}, pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since "
            f"{clock(float(holder.get('started', 0.0)))}")


def takeover_reason(holder: dict, me: dict, now: float, stale_after_s: float, alive=pid_alive) -> str | None:
    """Why the lock `holder` (a record as above) may be taken over by `me` (this job's record), or None when its job
    must be taken for alive. `alive(pid, pid_start)` checks a process on this machine."""
    earlier, mine = holder.get("attempt", 0), me.get("attempt", 0)
    if me["job"] != "local" and holder.get("job") == me["job"] and isinstance(earlier, int) and earlier < mine:
        return f"attempt {earlier} of job {me['job']}, which ended before this attempt {mine} started"
    same_machine = holder.get("host") == me["host"] and holder.get("boot_id") == me["boot_id"]
    if same_machine:
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return "it names no process"
        if pid == me["pid"]:
            return "it was left by this process"
        if not alive(pid, holder.get("pid_start")):
            return f"its process {pid} is gone"
        return None
    if me["job"] != "local" and holder.get("job") == me["job"]:
        return f"an earlier attempt of job {me['job']}"
    silent = now - float(holder.get("heartbeat", holder.get("started", 0.0)))
    if silent > stale_after_s:
        return f"no heartbeat for {silent:.0f} s (more than {stale_after_s:.0f} s)"
    return None


class RunDirLock:
    """Rank 0's lock on a run directory. `acquire()` returns (taken, line): the line to print (a takeover, or why
    the directory is refused), or None. The holder refreshes its heartbeat in a thread until `release()`."""

    def __init__(self, run_dir: Path, stale_after_s: float = STALE_AFTER_S, refresh_s: float = REFRESH_S,
                 environ=os.environ):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK_NAME
        self.stale_after_s, self.refresh_s = stale_after_s, refresh_s
        now, pid = time.time(), os.getpid()
        self.record = {"job": this_job(environ), "attempt": this_attempt(environ), "host": this_host(), "pid": pid,
                       "pid_start": process_start(pid), "boot_id": boot_id(), "started": now, "heartbeat": now,
                       "token": uuid.uuid4().hex, "run_dir": str(self.run_dir)}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> tuple[bool, str | None]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        said, unreadable = None, 0
        for _ in range(2 * LOOKS):  # a lock released, taken over or being written between our looks: look again
            if self._link():
                self._start_refreshing()
                return True, said
            holder = read_lock(self.path)
            if holder is None:
                if not self.path.exists():
                    continue
                unreadable += 1
                if unreadable < LOOKS:
                    time.sleep(UNREADABLE_WAIT_S)
                    continue
            why = "it is unreadable" if holder is None else takeover_reason(holder, self.record, time.time(),
                                                                            self.stale_after_s)
            if why is None:
                return False, self.refusal(holder)
            if self._move_aside(holder):
                said = (f"run dir: took over {self.path} from "
                        f"{describe_holder(holder) if holder else 'an unknown holder'} ({why})")
        return False, self.refusal(read_lock(self.path))

    def refusal(self, holder: dict | None) -> str:
        if holder is None:
            return (f"{self.run_dir} is in use: its lock {self.path} changed hands under every one of "
                    f"{2 * LOOKS} tries to take it; try again, or train into another --out")
        beat = holder.get("heartbeat")
        heard = f", heartbeat {max(0.0, time.time() - float(beat)):.0f} s ago" if beat else ""
        return (f"{self.run_dir} is in use by {describe_holder(holder)}{heard} ({self.path}); two jobs writing one "
                f"run directory would mix their metrics and checkpoints: wait for it to end, stop it, or train into "
                f"another --out (the lock of a job that is gone is taken over without asking)")

    def _link(self) -> bool:
        """Write the record to a file of its own, then hard-link it to the lock: atomic, also on NFS. Where the
        filesystem has no hard links, an exclusive create (O_CREAT | O_EXCL) and then the record."""
        own = self.path.with_name(f"{LOCK_NAME}.{self.record['token']}")
        own.write_text(json.dumps(self.record) + "\n")
        try:
            os.link(own, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            if own.stat().st_nlink == 2:  # NFS: the link was made, its reply lost
                return True
            return self._create_exclusive()
        finally:
            own.unlink(missing_ok=True)

    def _create_exclusive(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as lock:
            lock.write(json.dumps(self.record) + "\n")
        return True

    def _move_aside(self, holder: dict | None) -> bool:
        """Rename the stale lock aside (of two jobs racing, one renames it); put back one that changed meanwhile."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{self.record['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = read_lock(aside)
        if (moved or {}).get("token") != (holder or {}).get("token"):
            with contextlib.suppress(OSError):  # another job took it over between our look and the rename: put back
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def _start_refreshing(self) -> None:
        self._thread = threading.Thread(target=self._refresh_loop, name="mpitrain-run-dir-lock", daemon=True)
        self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()

    def refresh(self) -> None:
        """Rewrite the heartbeat (replaced whole) while the lock is still this job's."""
        if (read_lock(self.path) or {}).get("token") != self.record["token"]:
            return
        self.record["heartbeat"] = time.time()
        fresh = self.path.with_name(f"{LOCK_NAME}.{self.record['token']}.tmp")
        try:
            fresh.write_text(json.dumps(self.record) + "\n")
            os.replace(fresh, self.path)
        except OSError:  # a full disk must not end the run: the heartbeat only ages
            fresh.unlink(missing_ok=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if (read_lock(self.path) or {}).get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)


class RunDirClaim:
    """Collective over `world_comm` (mpi4py): rank 0 takes the lock, every rank learns the verdict, so that none
    writes into a refused directory and none waits for a rank that stopped. A context manager; `refused` says
    whether the run must end (rank 0 has printed why)."""

    def __init__(self, run_dir: Path, world_comm, stale_after_s: float, echo=print, warn=None):
        self.run_dir, self.world_comm, self.stale_after_s = Path(run_dir), world_comm, stale_after_s
        self.echo, self.warn = echo, warn or echo
        self.lock: RunDirLock | None = None
        self.refused = False

    def __enter__(self) -> RunDirClaim:
        verdict = None
        if self.world_comm.Get_rank() == 0:
            verdict = self._take()
        verdict = self.world_comm.bcast(verdict, root=0) if self.world_comm.Get_size() > 1 else verdict
        kind, line = verdict
        if kind == "error":
            raise ConfigError(line)
        self.refused = kind == "refused"
        return self

    def _take(self) -> tuple[str, str | None]:
        self.lock = RunDirLock(self.run_dir, self.stale_after_s)
        try:
            taken, line = self.lock.acquire()
        except OSError as exc:
            self.lock = None
            return "error", f"cannot create the run directory's lock {self.run_dir / LOCK_NAME} ({exc.strerror})"
        if not taken:
            self.lock = None
            self.warn(f"ERROR: {line}")
            return "refused", line
        if line:
            self.echo(line)
        return "taken", None

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
