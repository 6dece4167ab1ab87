"""`NcclGroup`: the Group interface (group.py) over NCCL communicators, with the MPI group's byte counters and
progress record; its control plane (scalars, objects, barrier) and tags without an NCCL lane stay on MPI. How the
lanes and streams are laid out, and why, is in nccl.py's docstring. The same code drives CuPy's `cupy.cuda.nccl`
on a GPU and the host stand-in (nccl_standin.py) in CI; `runtime` is what differs between them.
"""

from __future__ import annotations

import atexit
import sys
import weakref

import numpy as np

from mpitrain.backend import BFLOAT16
from mpitrain.comm.group import Group, _check_op, check_blocks
from mpitrain.comm.operations import Handle

NCCL_OPS = {"sum": 0, "max": 2, "min": 3}
NCCL_DTYPE_CODES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
                    np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6,
                    np.dtype(np.float32): 7, np.dtype(np.float64): 8, BFLOAT16: 9}
UINT8 = 1


def nccl_dtype(dtype, reducing: bool) -> tuple[int, int]:
    """(NCCL dtype code, elements per array element). Copies of types NCCL lacks (bf16's uint16 wire view) travel
    as bytes; reductions need the real type."""
    dtype = np.dtype(dtype)
    if dtype in NCCL_DTYPE_CODES:
        return NCCL_DTYPE_CODES[dtype], 1
    if reducing:
        raise ValueError(f"NCCL cannot reduce {dtype.name} arrays; reduce float16/bfloat16/float32/float64")
    return UINT8, dtype.itemsize



def copied_back(runtime, handle: Handle, copy_back) -> Handle:
    """`handle` of an MPI operation on host copies, whose copies go back into the device buffers once it completes
    (MPI point-to-point without an NCCL lane here, every operation of nccl.py's HostStagedGroup)."""
    copy_back = list(copy_back)

    def copy() -> None:
        for target, source in copy_back:
            runtime.copy_into(target, source)
    return Handle.after(handle).then(copy)


# ---- requests: what a Handle waits on ---------------------------------------------------------------------------
class _EventRequest:
    """Completion of work queued on a stream: `event` recorded after it; host buffers copied back once done."""

    def __init__(self, runtime, event, copy_back=()):
        self._runtime, self._event, self._copy_back = runtime, event, list(copy_back)

    def Test(self) -> bool:
        if self._event is not None and self._event.done:
            self._finish()
        return self._event is None

    def Wait(self) -> None:
        if self._event is None:
            return
        if self._copy_back:
            self._event.synchronize()  # the host reads the result
        else:
            self._runtime.current_stream().wait_event(self._event)  # later compute waits, the host does not
        self._finish()

    def _finish(self) -> None:
        for target, source in self._copy_back:
            self._runtime.copy_into(target, source)
        self._event, self._copy_back = None, []




class NcclGroup(Group):
    """A process group of size > 1 whose buffer operations run through NCCL (see the module docstring).

    runtime: nccl.CudaRuntime or nccl.HostRuntime. p2p_tags: the tags that get NCCL point-to-point lanes (others
    go through MPI, staged through host memory when the buffer is on the device).
    """

    moves_device_memory = True  # device buffers go to NCCL as they are; host buffers would be staged both ways

    def __init__(self, comm, name, progress=None, runtime=None, p2p_tags=()):
        super().__init__(comm, name, progress)
        self.runtime = runtime
        self._api = runtime.api(comm)
        self._main = (self._communicator(), runtime.stream())
        # lane (tag, upward, sender parity) -> (communicator, stream); created now: creation is collective
        self._lanes = {(tag, upward, parity): (self._communicator(), runtime.stream())
                       for tag in p2p_tags for upward in (True, False) for parity in (0, 1)}
        self._connect_lanes()

        _LIVE_GROUPS.add(self)
        _register_exit_hook()

    def _connect_lanes(self) -> None:
        """NCCL connects two ranks for point-to-point at their first exchange, inside the host's call, with both hosts
        taking part: a receive posted early on one lane would hold its host until the peer's first send on that lane,
        which may wait for data this host has not sent yet. So every lane exchanges one byte between the neighbours
        that use it (the pipeline's and the cp ring's only peers) now, lane by lane in the same order on every rank,
        each lane's sends and receives in one group call (nccl.py, "Ordering")."""
        neighbours = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        tokens = []
        for key in sorted(self._lanes):
            (communicator, stream), (_, upward, parity) = self._lanes[key], key
            self._api.groupStart()
            try:
                for peer in neighbours:
                    token = self.runtime.to_native(np.zeros(1, np.uint8))
                    tokens.append(token)
                    if (peer > self.rank) == upward and self.rank % 2 == parity:
                        communicator.send(self.runtime.pointer(token), 1, UINT8, peer, stream.ptr)
                    if (self.rank > peer) == upward and peer % 2 == parity:
                        communicator.recv(self.runtime.pointer(token), 1, UINT8, peer, stream.ptr)
            finally:
                self._api.groupEnd()
        for _, stream in self._lanes.values():
            stream.synchronize()

    def communicators(self) -> list:
        return [communicator for communicator, _ in (self._main, *self._lanes.values()) if communicator is not None]

    def close(self) -> None:
        """Destroy this group's communicators (ncclCommDestroy: waits for their queued work); idempotent."""
        self._end_communicators("destroy")

    def abort(self) -> None:
        """Abort this group's communicators (ncclCommAbort: stops their kernels even if a peer never arrives), so a
        rank stuck in a hung collective can be ended; idempotent."""
        self._end_communicators("abort")

    def _end_communicators(self, how: str) -> None:
        communicators = self.communicators()
        self._main = (None, self._main[1])
        self._lanes = {key: (None, stream) for key, (_, stream) in self._lanes.items()}
        _LIVE_GROUPS.discard(self)
        for communicator in communicators:
            getattr(communicator, how)()

    def _communicator(self):
        """NCCL's unique id is made on group rank 0 and broadcast over MPI; every member then joins (blocking)."""
        uid = self._api.get_unique_id() if self.rank == 0 else None
        return self._api.NcclCommunicator(self.size, self.comm.bcast(uid, root=0), self.rank)

    # ---- the launch every operation shares -----------------------------------------------------------------------
    def _launch(self, name: str, nbytes: int, blocking: bool, sources, targets, issue, lane=None, peer=None):
        """Stage `sources` (read) and `targets` (written) to device memory, order the group's stream after the
        compute stream, run `issue(communicator, source_pointers, target_pointers, stream_pointer)` there, and
        wait (blocking) or return a Handle on the event recorded after it."""
        runtime, natives, copy_back = self.runtime, {}, []

        def native(array, written):
            if id(array) not in natives:
                natives[id(array)] = array if runtime.is_native(array) else runtime.to_native(array)
            if written and natives[id(array)] is not array:
                copy_back.append((array, natives[id(array)]))
            return natives[id(array)]

        source_arrays = [native(a, False) for a in sources]
        target_arrays = [native(a, True) for a in targets]
        communicator, stream = lane or self._main
        if communicator is None:
            raise RuntimeError(f"{self.name}.{name}: this group's NCCL communicators were closed or aborted")
        ready = runtime.event()
        ready.record(runtime.current_stream())
        stream.wait_event(ready)  # inputs (and staging copies) were queued on the compute stream
        issue(communicator, [runtime.pointer(a) for a in source_arrays], [runtime.pointer(a) for a in target_arrays],
              stream.ptr)
        done = runtime.event()
        done.record(stream)
        request = _EventRequest(runtime, done, copy_back)
        if peer is None:
            entered = self._enter(name, nbytes)
        else:
            entered = self._enter_p2p(name, nbytes, peer, sending=name.endswith("send"))
        keep = (*sources, *targets, *source_arrays, *target_arrays)  # alive until the stream is done with them
        if blocking:
            self._blocking(entered, request.Wait, lambda: request)
            return None
        return Handle(request, keep, entered, self.progress)

    # ---- collectives ---------------------------------------------------------------------------------------------
    def all_reduce(self, buf, op="sum"):
        self._all_reduce(buf, op, blocking=True)

    def iall_reduce(self, buf, op="sum"):
        return self._all_reduce(buf, op, blocking=False)

    def _all_reduce(self, buf, op, blocking):
        _check_buffer(buf, f"{self.name}.all_reduce buffer")
        code, _ = nccl_dtype(buf.dtype, reducing=True)
        nccl_op = NCCL_OPS[_check_op(op)]
        self._count("all_reduce", buf.nbytes)
        return self._launch(("" if blocking else "i") + "all_reduce", buf.nbytes, blocking, [buf], [buf],
                            lambda c, s, r, stream: c.allReduce(s[0], r[0], buf.size, code, nccl_op, stream))

    def reduce_scatter(self, send, recv, op="sum"):
        self._reduce_scatter(send, recv, op, blocking=True)

    def ireduce_scatter(self, send, recv, op="sum"):
        return self._reduce_scatter(send, recv, op, blocking=False)

    def _reduce_scatter(self, send, recv, op, blocking):
        what = f"{self.name}.reduce_scatter"
        _check_buffer(send, f"{what} send")
        _check_buffer(recv, f"{what} recv")
        check_blocks(send, recv, 1, self.size, what, self.size)
        code, _ = nccl_dtype(send.dtype, reducing=True)
        nccl_op = NCCL_OPS[_check_op(op)]
        self._count("reduce_scatter", send.nbytes)
        return self._launch(("" if blocking else "i") + "reduce_scatter", send.nbytes, blocking, [send], [recv],
                            lambda c, s, r, stream: c.reduceScatter(s[0], r[0], recv.size, code, nccl_op, stream))

    def all_gather(self, send, recv):
        self._all_gather(send, recv, blocking=True)

    def iall_gather(self, send, recv):
        return self._all_gather(send, recv, blocking=False)

    def _all_gather(self, send, recv, blocking):
        what = f"{self.name}.all_gather"
        _check_buffer(send, f"{what} send")
        _check_buffer(recv, f"{what} recv")
        check_blocks(send, recv, self.size, 1, what, self.size)
        code, per = nccl_dtype(send.dtype, reducing=False)
        self._count("all_gather", recv.nbytes)
        return self._launch(("" if blocking else "i") + "all_gather", recv.nbytes, blocking, [send], [recv],
                            lambda c, s, r, stream: c.allGather(s[0], r[0], send.size * per, code, stream))

    def broadcast(self, buf, root):
        self._broadcast(buf, root, blocking=True)

    def ibroadcast(self, buf, root):
        return self._broadcast(buf, root, blocking=False)

    def _broadcast(self, buf, root, blocking):
        _check_buffer(buf, f"{self.name}.broadcast buffer")
        if not 0 <= root < self.size:
            raise ValueError(f"{self.name}.broadcast: root {root} is not a rank of this group of {self.size}")
        code, per = nccl_dtype(buf.dtype, reducing=False)
        self._count("broadcast", buf.nbytes, is_root=self.rank == root)
        return self._launch(("" if blocking else "i") + "broadcast", buf.nbytes, blocking, [buf], [buf],
                            lambda c, s, r, stream: c.broadcast(s[0], r[0], buf.size * per, code, root, stream))

    def all_to_all(self, send, recv):
        _check_buffer(send, f"{self.name}.all_to_all send")
        if send.size % self.size:
            raise ValueError(f"{self.name}.all_to_all: {send.size} elements do not split into {self.size} blocks")
        block = send.size // self.size
        self._count("all_to_all", send.nbytes)
        self._exchange("all_to_all", send, [block] * self.size, recv, [block] * self.size, send.nbytes)

    def all_to_allv(self, send, send_counts, recv, recv_counts):
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if len(send_counts) != self.size or len(recv_counts) != self.size:
            raise ValueError(f"{self.name}.all_to_allv needs {self.size} send and recv counts")
        if sum(send_counts) > send.size or sum(recv_counts) > recv.size:
            raise ValueError(f"{self.name}.all_to_allv: counts exceed the buffers ({send.size} / {recv.size} elements)")
        to_others = (sum(send_counts) - send_counts[self.rank]) * send.itemsize
        self._sent["all_to_all"] += to_others  # exact, not a ring formula
        self._exchange("all_to_allv", send, send_counts, recv, recv_counts, to_others)

    def _exchange(self, name, send, send_counts, recv, recv_counts, nbytes):
        """NCCL has no all-to-all: one send and one receive per rank (itself included), inside one group call."""
        _check_buffer(send, f"{self.name}.{name} send")
        _check_buffer(recv, f"{self.name}.{name} recv")
        if send.dtype != recv.dtype:
            raise ValueError(f"{self.name}.{name}: send dtype {send.dtype} differs from recv dtype {recv.dtype}")
        code, per = nccl_dtype(send.dtype, reducing=False)

        def issue(c, s, r, stream):
            self._api.groupStart()
            try:
                for peer in range(self.size):
                    c.send(s[0] + _offset(send_counts, peer) * send.itemsize, send_counts[peer] * per, code, peer,
                           stream)
                    c.recv(r[0] + _offset(recv_counts, peer) * recv.itemsize, recv_counts[peer] * per, code, peer,
                           stream)
            finally:
                self._api.groupEnd()

        self._launch(name, nbytes, True, [send], [recv], issue)

    # ---- point to point: through a lane when the tag has one, else MPI -----------------------------------------
    def _lane(self, tag: int, sender: int, receiver: int):
        return self._lanes.get((tag, receiver > sender, sender % 2))

    def send(self, buf, dest, tag=0, kind="send"):
        self._p2p("send", buf, dest, tag, kind, blocking=True)

    def isend(self, buf, dest, tag=0, kind="send"):
        return self._p2p("isend", buf, dest, tag, kind, blocking=False)

    def recv(self, buf, source, tag=0):
        self._p2p("recv", buf, source, tag, None, blocking=True)

    def irecv(self, buf, source, tag=0):
        return self._p2p("irecv", buf, source, tag, None, blocking=False)

    def _p2p(self, name, buf, peer, tag, kind, blocking):
        sending = kind is not None
        lane = self._lane(tag, self.rank, peer) if sending else self._lane(tag, peer, self.rank)
        if lane is None:
            return self._p2p_over_mpi(name, buf, peer, tag, kind)
        _check_buffer(buf, f"{self.name}.{name} buffer")
        code, per = nccl_dtype(buf.dtype, reducing=False)
        if sending:
            self._count(kind, buf.nbytes)

        def issue(c, s, r, stream):
            self._api.groupStart()  # a lone send/recv inside a group call, as NCCL asks of point-to-point
            try:
                if sending:
                    c.send(s[0], buf.size * per, code, peer, stream)
                else:
                    c.recv(r[0], buf.size * per, code, peer, stream)
            finally:
                self._api.groupEnd()

        sources, targets = ([buf], []) if sending else ([], [buf])
        # A blocking send returns once queued (its buffer is staged, or later compute waits for the send on the GPU):
        # blocking the host until the peer receives would deadlock two ranks that each send before they receive.
        handle = self._launch(name, buf.nbytes, False, sources, targets, issue, lane=lane, peer=peer)
        if not blocking:
            return handle
        handle.wait()
        return None

    def _p2p_over_mpi(self, name, buf, peer, tag, kind):
        host = buf if isinstance(buf, np.ndarray) else self.runtime.to_host(buf)
        extra = {} if kind in (None, "send") else {"kind": kind}
        handle = getattr(Group, name)(self, host, peer, tag, **extra)
        if host is buf or name.endswith("send"):
            return handle
        if handle is None:  # blocking recv into a device buffer
            self.runtime.copy_into(buf, host)
            return None
        return copied_back(self.runtime, handle, [(buf, host)])


# ---- the end of a process: every live group's communicators destroyed (at exit) or aborted (by the watchdog) --------
# A registry, not a hidden input: nothing reads it to communicate; it only lets the exit hook and the watchdog find
# the communicators to end, which no caller holds at those moments.
_LIVE_GROUPS: weakref.WeakSet = weakref.WeakSet()
_EXIT_HOOK = []


def _register_exit_hook() -> None:
    # registered after mpi4py's own (MPI is imported before any group exists), so it runs before MPI_Finalize
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(atexit.register(destroy_all_communicators))


def destroy_all_communicators() -> int:
    """Destroy the communicators of every live NcclGroup (normal exit); the number of groups closed."""
    return _end_all("close")


def abort_all_communicators() -> int:
    """Abort the communicators of every live NcclGroup (the watchdog, before MPI Abort); never raises."""
    return _end_all("abort")


def _end_all(how: str) -> int:
    groups = list(_LIVE_GROUPS)
    for group in groups:
        try:
            getattr(group, how)()
        except Exception as exc:  # noqa: BLE001 -- ending one group must not keep the others alive
            sys.stderr.write(f"warning: NCCL group {group.name}: {how} failed: {type(exc).__name__}: {exc}\n")
    return len(groups)


def _offset(counts, peer) -> int:
    return sum(counts[:peer])


def _check_buffer(buf, role: str) -> None:
    if not hasattr(buf, "flags") or not buf.flags.c_contiguous:
        raise ValueError(f"{role} must be a C-contiguous array (numpy or cupy), got {type(buf).__name__} "
                         f"{getattr(buf, 'shape', '')}")
