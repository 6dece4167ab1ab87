"""Process groups: the only place parallel code talks to MPI.

`GroupBase` is the interface every group offers (the MPI `Group` below on host arrays; `NcclGroup` and
`HostStagedGroup` in comm/nccl.py on GPU arrays, with the same methods). All buffer methods work in place on
contiguous arrays, counted in elements of the buffers' dtype, with ranks local to the group.

Byte counters (`group.bytes_sent[kind]`) hold what this rank sends under the ring algorithm of each operation
(comm/counters.py has the table), so that tests and reports can be checked against theory.

Every operation is entered in the rank's progress record (operations.py), which the watchdog reads to find a
hang and who caused it; blocking calls and `Handle.wait` record what the rank waits on.

A test hook gives the operations of some groups a deterministic transfer time (comm/latency.py).
"""

from __future__ import annotations

import abc
import pickle
import time
from fractions import Fraction

import numpy as np

from mpitrain.comm.counters import COUNTER_KINDS, ring_bytes
from mpitrain.comm.latency import LateRequest, latency_of
from mpitrain.comm.operations import Handle, Operation, ProgressRecord

REDUCE_OPS = ("sum", "max", "min")


class GroupBase(abc.ABC):
    """Interface of a process group, plus the byte counters every implementation shares.

    Subclasses set `comm`, `name`, `rank`, `size`, `world_ranks` and implement the buffer methods.
    """

    name: str
    rank: int
    size: int
    world_ranks: list[int]
    # True where buffers may stay in device memory (NCCL); MPI groups take host buffers (docs/architecture.md, Backends)
    moves_device_memory = False

    def __init__(self):
        self._sent = {kind: Fraction(0) for kind in COUNTER_KINDS}

    # ---- counters ------------------------------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> dict[str, int]:
        return self.counters()

    def counters(self, exact: bool = False) -> dict:
        """A copy of the byte counters: ints (rounded), or the exact Fractions with exact=True."""
        return dict(self._sent) if exact else {kind: round(value) for kind, value in self._sent.items()}

    def reset_counters(self) -> None:
        for kind in self._sent:
            self._sent[kind] = Fraction(0)

    def _count(self, kind: str, nbytes: int, is_root: bool = False) -> None:
        self._sent[kind] += ring_bytes(kind, nbytes, self.size, is_root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, rank {self.rank} of {self.size}, world ranks {self.world_ranks})"

    # ---- the interface -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, buf, op: str = "sum") -> None:
        """Reduce `buf` over the group, in place ("sum", "max" or "min")."""

    @abc.abstractmethod
    def all_reduce_scalar(self, x: float, op: str = "sum") -> float:
        """Reduce one number (loss, grad norm, flags); counted under "control"."""

    @abc.abstractmethod
    def all_reduce_bits(self, bits: int) -> int:
        """Bitwise OR of one 64-bit word (flags every rank must see, e.g. a step's verdict and a stop request in one
        message); counted under "control"."""

    @abc.abstractmethod
    def reduce_scatter(self, send, recv, op: str = "sum") -> None:
        """`send` holds size blocks of len(recv); rank r receives the reduction of block r."""

    @abc.abstractmethod
    def all_gather(self, send, recv) -> None:
        """`recv` holds size blocks of len(send); block r is rank r's `send`."""

    @abc.abstractmethod
    def broadcast(self, buf, root: int) -> None:
        """Copy `buf` of rank `root` into `buf` everywhere."""

    @abc.abstractmethod
    def send(self, buf, dest: int, tag: int = 0) -> None: ...

    @abc.abstractmethod
    def recv(self, buf, source: int, tag: int = 0) -> None: ...

    @abc.abstractmethod
    def all_to_all(self, send, recv) -> None:
        """Block r of `send` goes to rank r; block r of `recv` comes from rank r (equal blocks)."""

    @abc.abstractmethod
    def all_to_allv(self, send, send_counts, recv, recv_counts) -> None:
        """Like all_to_all with per-rank element counts (blocks packed back to back in rank order)."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def gather_object(self, obj, root: int = 0) -> list | None:
        """Every rank's picklable `obj` as a list on `root` (None elsewhere); counted under "control"."""

    @abc.abstractmethod
    def broadcast_object(self, obj, root: int = 0):
        """`root`'s picklable `obj` on every rank; counted under "control"."""

    @abc.abstractmethod
    def iall_reduce(self, buf, op: str = "sum") -> Handle: ...

    @abc.abstractmethod
    def ireduce_scatter(self, send, recv, op: str = "sum") -> Handle: ...

    @abc.abstractmethod
    def iall_gather(self, send, recv) -> Handle: ...

    @abc.abstractmethod
    def ibroadcast(self, buf, root: int) -> Handle: ...

    @abc.abstractmethod
    def isend(self, buf, dest: int, tag: int = 0, kind: str = "send") -> Handle:
        """kind: the counter the bytes go to ("send", or "cp_ring" for the context-parallel ring)."""

    @abc.abstractmethod
    def irecv(self, buf, source: int, tag: int = 0) -> Handle: ...


# ---- buffer checks shared by implementations -----------------------------------------------------------------------
def check_blocks(send, recv, send_blocks: int, recv_blocks: int, what: str, size: int) -> None:
    """send.size * send_blocks == recv.size * recv_blocks, same dtype (e.g. reduce_scatter: send = size x recv)."""
    if send.dtype != recv.dtype:
        raise ValueError(f"{what}: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
    if send.size * send_blocks != recv.size * recv_blocks:
        raise ValueError(
            f"{what} on {size} ranks: send has {send.size} elements and recv {recv.size}; "
            f"expected send.size * {send_blocks} == recv.size * {recv_blocks}"
        )


def _check_host(buf, role: str, writable: bool = False) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        kind = type(buf).__module__.split(".")[0] + "." + type(buf).__name__
        if hasattr(buf, "__cuda_array_interface__"):
            raise TypeError(
                f"{role} is a GPU array ({kind}); MPI groups take numpy arrays only "
                "(MPI is not CUDA-aware here; GPU arrays go through the NCCL groups: train.collectives)"
            )
        raise TypeError(f"{role} must be a numpy array, got {kind}")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{role} must be C-contiguous (shape {buf.shape}, strides {buf.strides}); "
            "communicate a flat buffer or np.ascontiguousarray(...) of it"
        )
    if writable and not buf.flags.writeable:
        raise ValueError(f"{role} is read-only but receives data")
    return buf


def _check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    return op


def _mpi():
    # Imported on first use so that pure helpers (mesh coordinates, ring_bytes) never initialise MPI.
    from mpi4py import MPI

    return MPI


def _mpi_op(op: str):
    MPI = _mpi()
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[_check_op(op)]


def _flat(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1)  # a view: buffers are checked contiguous first


class Group(GroupBase):
    """A process group over an mpi4py communicator, on numpy arrays (mpi4py's uppercase buffer methods).

    progress: the rank's record of operations, shared by all its groups (the Mesh passes one); a fresh one if None.
    """

    def __init__(self, comm, name: str, progress: ProgressRecord | None = None):
        super().__init__()
        MPI = _mpi()
        self.comm = comm
        self.name = name
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.world_ranks = [int(r) for r in group.Translate_ranks(list(range(self.size)), world_group)]
        group.Free()
        world_group.Free()
        self.progress = progress if progress is not None else ProgressRecord(MPI.COMM_WORLD.Get_rank())
        me = self.world_ranks[self.rank]
        self._members = tuple(self.world_ranks)
        self._channel = f"{name}@{self.world_ranks[0]}"  # groups of one kind partition the world: unique
        self._others = tuple(r for r in self.world_ranks if r != me)
        self.latency_s = latency_of(name) if self.size > 1 else 0.0  # the test hook (module docstring)

    # ---- watched calls: every MPI operation is entered in the progress record -----------------------------------
    def _enter(self, name: str, nbytes: int) -> Operation:
        return self.progress.enter(name, self.name, self._members, self._channel, self._others, nbytes)

    def _enter_p2p(self, name: str, nbytes: int, peer: int, sending: bool) -> Operation:
        me, other = self.world_ranks[self.rank], self.world_ranks[peer]
        source, dest = (me, other) if sending else (other, me)
        channel = f"{self._channel}:{source}>{dest}"
        return self.progress.enter(name, self.name, self._members, channel, (other,), nbytes)

    def _blocking(self, operation: Operation, run, start=None) -> None:
        """Run the blocking call `run()`, recorded as what this rank waits on. Without thread support for the
        watchdog, the non-blocking form `start()` is polled against the deadline instead (object calls have none)."""
        if self.latency_s:
            run, start = self._late(run, start)
        if self.progress.poll_timeout_s and start is not None:
            Handle(start(), (), operation, self.progress).wait()
        else:
            self.progress.wait_for(operation, run)

    def _late(self, run, start):
        """A blocking call under the latency hook: `run` sleeps the latency first; `start`'s request completes no
        earlier than that."""
        ready = time.monotonic() + self.latency_s

        def late_run():
            time.sleep(self.latency_s)
            run()
        return late_run, None if start is None else (lambda: LateRequest(start(), ready))

    def _handle(self, operation: Operation, request, buffers) -> Handle:
        if self.latency_s:
            request = LateRequest(request, time.monotonic() + self.latency_s)
        return Handle(request, buffers, operation, self.progress)

    # ---- collectives ---------------------------------------------------------------------------------------------
    def all_reduce(self, buf, op="sum"):
        _check_host(buf, f"{self.name}.all_reduce buffer", writable=True)
        self._count("all_reduce", buf.nbytes)
        if self.size > 1:
            mpi_op, entered = _mpi_op(op), self._enter("all_reduce", buf.nbytes)
            self._blocking(entered, lambda: self.comm.Allreduce(_mpi().IN_PLACE, buf, op=mpi_op),
                           lambda: self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=mpi_op))
        else:
            _check_op(op)

    def all_reduce_scalar(self, x, op="sum"):
        buf = np.array([x], dtype=np.float64)
        self._count("control", buf.nbytes)
        if self.size > 1:
            mpi_op, entered = _mpi_op(op), self._enter("all_reduce_scalar", buf.nbytes)
            self._blocking(entered, lambda: self.comm.Allreduce(_mpi().IN_PLACE, buf, op=mpi_op),
                           lambda: self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=mpi_op))
        else:
            _check_op(op)
        return float(buf[0])

    def all_reduce_bits(self, bits):
        buf = np.array([bits], dtype=np.uint64)
        self._count("control", buf.nbytes)
        if self.size > 1:
            entered = self._enter("all_reduce_bits", buf.nbytes)
            self._blocking(entered, lambda: self.comm.Allreduce(_mpi().IN_PLACE, buf, op=_mpi().BOR),
                           lambda: self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=_mpi().BOR))
        return int(buf[0])

    def reduce_scatter(self, send, recv, op="sum"):
        self._start_reduce_scatter(send, recv, op, blocking=True)

    def all_gather(self, send, recv):
        self._start_all_gather(send, recv, blocking=True)

    def broadcast(self, buf, root):
        self._start_broadcast(buf, root, blocking=True)

    def all_to_all(self, send, recv):
        _check_host(send, f"{self.name}.all_to_all send")
        _check_host(recv, f"{self.name}.all_to_all recv", writable=True)
        check_blocks(send, recv, 1, 1, f"{self.name}.all_to_all", self.size)
        if send.size % self.size:
            raise ValueError(f"{self.name}.all_to_all: {send.size} elements do not split into {self.size} blocks")
        self._count("all_to_all", send.nbytes)
        if self.size > 1:
            self._blocking(self._enter("all_to_all", send.nbytes), lambda: self.comm.Alltoall(send, recv),
                           lambda: self.comm.Ialltoall(send, recv))
        else:
            np.copyto(_flat(recv), _flat(send))

    def all_to_allv(self, send, send_counts, recv, recv_counts):
        _check_host(send, f"{self.name}.all_to_allv send")
        _check_host(recv, f"{self.name}.all_to_allv recv", writable=True)
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(send_counts) != self.size or len(recv_counts) != self.size:
            raise ValueError(f"{self.name}.all_to_allv needs {self.size} send and recv counts")
        if sum(send_counts) > send.size or sum(recv_counts) > recv.size:
            raise ValueError(f"{self.name}.all_to_allv: counts exceed the buffers ({send.size} / {recv.size} elements)")
        if send.dtype != recv.dtype:
            raise ValueError(f"{self.name}.all_to_allv: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
        to_others = (sum(send_counts) - send_counts[self.rank]) * send.itemsize
        self._sent["all_to_all"] += to_others  # exact, not a ring formula
        if self.size > 1:
            spec = [send, (send_counts, _offsets(send_counts))], [recv, (recv_counts, _offsets(recv_counts))]
            self._blocking(self._enter("all_to_allv", to_others), lambda: self.comm.Alltoallv(*spec),
                           lambda: self.comm.Ialltoallv(*spec))
        else:
            _flat(recv)[: send_counts[0]] = _flat(send)[: send_counts[0]]

    def barrier(self):
        if self.size > 1:
            self._blocking(self._enter("barrier", 0), self.comm.Barrier, self.comm.Ibarrier)

    # ---- small Python objects (control plane: checkpoint indexes, timelines), counted under "control" ------------
    def gather_object(self, obj, root: int = 0) -> list | None:
        """Every rank's `obj` as a list on `root` (None elsewhere)."""
        nbytes = len(pickle.dumps(obj))
        self._count("control", nbytes)
        if self.size == 1:
            return [obj]
        gathered = []
        self._blocking(self._enter("gather_object", nbytes), lambda: gathered.append(self.comm.gather(obj, root)))
        return gathered[0]

    def broadcast_object(self, obj, root: int = 0):
        if self.size == 1:
            return obj
        nbytes = len(pickle.dumps(obj)) if self.rank == root else 0
        if self.rank == root:
            self._count("control", nbytes)
        received = []
        self._blocking(self._enter("broadcast_object", nbytes), lambda: received.append(self.comm.bcast(obj, root)))
        return received[0]

    # ---- point to point (always through MPI, also on a group of one) ---------------------------------------------
    def send(self, buf, dest, tag=0):
        _check_host(buf, f"{self.name}.send buffer")
        self._count("send", buf.nbytes)
        self._blocking(self._enter_p2p("send", buf.nbytes, dest, sending=True),
                       lambda: self.comm.Send(buf, dest=dest, tag=tag), lambda: self.comm.Isend(buf, dest, tag))

    def recv(self, buf, source, tag=0):
        _check_host(buf, f"{self.name}.recv buffer", writable=True)
        self._blocking(self._enter_p2p("recv", buf.nbytes, source, sending=False),
                       lambda: self.comm.Recv(buf, source=source, tag=tag), lambda: self.comm.Irecv(buf, source, tag))

    def isend(self, buf, dest, tag=0, kind="send"):
        _check_host(buf, f"{self.name}.isend buffer")
        self._count(kind, buf.nbytes)
        entered = self._enter_p2p("isend", buf.nbytes, dest, sending=True)
        return self._handle(entered, self.comm.Isend(buf, dest=dest, tag=tag), (buf,))

    def irecv(self, buf, source, tag=0):
        _check_host(buf, f"{self.name}.irecv buffer", writable=True)
        entered = self._enter_p2p("irecv", buf.nbytes, source, sending=False)
        return self._handle(entered, self.comm.Irecv(buf, source=source, tag=tag), (buf,))

    # ---- non-blocking collectives --------------------------------------------------------------------------------
    def iall_reduce(self, buf, op="sum"):
        _check_host(buf, f"{self.name}.iall_reduce buffer", writable=True)
        self._count("all_reduce", buf.nbytes)
        if self.size == 1:
            _check_op(op)
            return Handle()
        entered = self._enter("iall_reduce", buf.nbytes)
        return self._handle(entered, self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=_mpi_op(op)), (buf,))

    def ireduce_scatter(self, send, recv, op="sum"):
        return self._start_reduce_scatter(send, recv, op, blocking=False)

    def iall_gather(self, send, recv):
        return self._start_all_gather(send, recv, blocking=False)

    def ibroadcast(self, buf, root):
        return self._start_broadcast(buf, root, blocking=False)

    # ---- shared bodies of the blocking and non-blocking forms ----------------------------------------------------
    def _start_reduce_scatter(self, send, recv, op, blocking):
        what = f"{self.name}.reduce_scatter"
        _check_host(send, f"{what} send")
        _check_host(recv, f"{what} recv", writable=True)
        check_blocks(send, recv, 1, self.size, what, self.size)
        self._count("reduce_scatter", send.nbytes)
        if self.size == 1:
            _check_op(op)
            np.copyto(_flat(recv), _flat(send))
            return Handle()
        mpi_op = _mpi_op(op)
        return self._start(("i" if not blocking else "") + "reduce_scatter", send.nbytes, blocking,
                           lambda: self.comm.Reduce_scatter_block(send, recv, op=mpi_op),
                           lambda: self.comm.Ireduce_scatter_block(send, recv, op=mpi_op), (send, recv))

    def _start_all_gather(self, send, recv, blocking):
        what = f"{self.name}.all_gather"
        _check_host(send, f"{what} send")
        _check_host(recv, f"{what} recv", writable=True)
        check_blocks(send, recv, self.size, 1, what, self.size)
        self._count("all_gather", recv.nbytes)
        if self.size == 1:
            np.copyto(_flat(recv), _flat(send))
            return Handle()
        return self._start(("i" if not blocking else "") + "all_gather", recv.nbytes, blocking,
                           lambda: self.comm.Allgather(send, recv), lambda: self.comm.Iallgather(send, recv),
                           (send, recv))

    def _start_broadcast(self, buf, root, blocking):
        _check_host(buf, f"{self.name}.broadcast buffer", writable=self.rank != root)
        if not 0 <= root < self.size:
            raise ValueError(f"{self.name}.broadcast: root {root} is not a rank of this group of {self.size}")
        self._count("broadcast", buf.nbytes, is_root=self.rank == root)
        if self.size == 1:
            return Handle()
        return self._start(("i" if not blocking else "") + "broadcast", buf.nbytes, blocking,
                           lambda: self.comm.Bcast(buf, root=root), lambda: self.comm.Ibcast(buf, root=root), (buf,))

    def _start(self, name, nbytes, blocking, run, start, buffers):
        """Enter the operation, then run it to completion (blocking) or return its Handle."""
        entered = self._enter(name, nbytes)
        if blocking:
            self._blocking(entered, run, start)
            return None
        return self._handle(entered, start(), buffers)


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]
