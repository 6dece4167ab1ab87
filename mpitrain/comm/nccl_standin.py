"""A host stand-in for `cupy.cuda.nccl`: the same calls, over MPI on numpy memory, so CI without a GPU runs the
NCCL group's own code (pointers, byte offsets, element counts, dtype codes, group calls) and a wrong count or
offset shows up as a wrong number in a parity test, or as an error naming the pointer.

What is the same as NCCL: `NcclCommunicator(ndev, commId, rank)` with allReduce / reduceScatter / allGather /
broadcast / bcast / send / recv taking raw pointers, counts in elements of an NCCL dtype code and a stream;
module-level `groupStart()` / `groupEnd()` (operations issued in between start together at groupEnd); results
appear when the stream's work is complete (an event recorded after the call has completed), not at the call.
Streams are modelled too: a `HostStream` runs its operations one after the other (the next one's MPI requests are
posted once the previous completed, whenever the host looks at an event or stream), and a send is MPI's synchronous
send, complete only once the peer's receive started, so it holds its stream as an NCCL send does: an order of sends
and receives that would deadlock on GPUs hangs here too (tests/test_nccl_standin.py checks both).
What differs: memory is numpy's; a pointer must lie inside an array handed out by `pointer()` (the registry), so an
offset or count past a buffer's end is an error instead of a stray write; the communicator bootstraps over a given
MPI communicator instead of NCCL's socket rendezvous (the unique id is still broadcast by the caller and checked
equal on all ranks); streams make progress only when the host polls them, not on their own.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
import weakref
from collections import OrderedDict, deque
from typing import ClassVar

import ml_dtypes
import numpy as np

from mpitrain.comm.operations import Handle

# NCCL's codes (nccl.h): reduction ops and data types.
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
NCCL_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
               6: np.float16, 7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16}
available = True

_REGISTRY: OrderedDict[int, np.ndarray] = OrderedDict()  # start address -> the array handed to pointer()
_REGISTRY_LIMIT = 4096

class _GroupCall:
    depth = 0  # groupStart() nesting
    launches: ClassVar[list] = []  # deferred until the outermost groupEnd()


def pointer(array: np.ndarray) -> int:
    """The address of a C-contiguous numpy array, remembered so that the stand-in can check what a call touches."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        raise TypeError("the NCCL stand-in takes C-contiguous numpy arrays")
    address = array.__array_interface__["data"][0]
    _REGISTRY.pop(address, None)
    _REGISTRY[address] = array
    while len(_REGISTRY) > _REGISTRY_LIMIT:
        _REGISTRY.popitem(last=False)
    return address


def _memory(address: int, count: int, dtype_code: int) -> np.ndarray:
    """`count` elements of NCCL dtype `dtype_code` at `address`, as a writable numpy view; they must lie inside one
    registered array (else a wrong offset or count would read or write another buffer's memory)."""
    if dtype_code not in NCCL_DTYPES:
        raise ValueError(f"NCCL stand-in: unknown dtype code {dtype_code}")
    dtype = np.dtype(NCCL_DTYPES[dtype_code])
    nbytes = count * dtype.itemsize
    for start, array in reversed(_REGISTRY.items()):
        if start <= address and address + nbytes <= start + array.nbytes:
            raw = (ctypes.c_char * nbytes).from_address(address) if nbytes else bytearray()
            return np.frombuffer(raw, dtype=dtype, count=count)
    raise ValueError(f"NCCL stand-in: {count} elements of {dtype.name} at {address:#x} ({nbytes} bytes) are not "
                     "inside any buffer passed to pointer(): wrong offset or count")


# ---- streams and events: FIFO queues of MPI operations ----------------------------------------------------------
class _PostedWhenTested:
    """The MPI requests of one stream entry, posted by `post()` the first time the entry is tested. Only the stream
    tests its head, so an entry starts once everything queued before it on the stream completed."""

    def __init__(self, post):
        self._post, self._requests = post, None

    def Test(self) -> bool:
        from mpi4py import MPI
        if self._requests is None:
            self._requests = list(self._post())
        return MPI.Request.Testall(self._requests)

    def Wait(self) -> None:
        while not self.Test():
            time.sleep(0)


def _stream_entry(operations: list[tuple]) -> Handle:
    """One entry of a stream: the (post, finish) operations of one call, or of one group call started together;
    each `finish` (or None) writes its result once every request completed."""
    entry = Handle(_PostedWhenTested(lambda: [request for post, _ in operations for request in post()]))
    for _, finish in operations:
        if finish is not None:
            entry.then(finish)
    return entry


class HostStream:
    """Operations run one after the other, as on a CUDA stream: a send whose receiver has not posted its receive
    (MPI's synchronous send) holds up everything behind it, as an NCCL send does."""

    _ids = itertools.count(1)

    def __init__(self, non_blocking: bool = True):
        self.ptr = next(self._ids)
        self.queue: deque[Handle] = deque()
        _streams[self.ptr] = self

    def launch(self, entry: Handle) -> None:
        self.queue.append(entry)
        self.advance()

    def advance(self) -> None:
        """Start the head (by testing it), drop it once complete, and go on (called whenever the host looks at any
        stream)."""
        while self.queue:
            if not self.queue[0].test():
                return
            self.queue.popleft()

    def synchronize(self) -> None:
        self.record().synchronize()

    def wait_event(self, event: HostEvent) -> None:
        event.synchronize()  # host work is synchronous: waiting on the event is the only way to order after it

    def record(self, event: HostEvent | None = None) -> HostEvent:
        event = event or HostEvent()
        event.record(self)
        return event


def _advance_all() -> None:
    for stream in list(_streams.values()):
        stream.advance()


class HostEvent:
    def __init__(self, disable_timing: bool = True):
        self._pending: list[Handle] = []

    def record(self, stream: HostStream | None = None) -> None:
        self._pending = list((stream or NULL_STREAM).queue)

    @property
    def done(self) -> bool:  # cupy.cuda.Event's name: advances every stream, True once the recorded work completed
        _advance_all()
        return all(p.done for p in self._pending)

    def synchronize(self) -> None:
        while not self.done:
            time.sleep(0)


_streams: weakref.WeakValueDictionary[int, HostStream] = weakref.WeakValueDictionary()  # pointer -> stream
NULL_STREAM = HostStream()


def stream_of(stream) -> HostStream:
    """Calls take a stream as NCCL does (an object with .ptr, or the pointer); 0 is the null stream."""
    return _streams.get(getattr(stream, "ptr", stream), NULL_STREAM)


# ---- group calls ----------------------------------------------------------------------------------------------
def groupStart() -> None:
    _GroupCall.depth += 1


def groupEnd() -> None:
    if _GroupCall.depth == 0:
        raise RuntimeError("NCCL stand-in: groupEnd() without groupStart()")
    _GroupCall.depth -= 1
    if _GroupCall.depth == 0:
        grouped, _GroupCall.launches = _GroupCall.launches, []
        streams = {}
        for stream, operation in grouped:
            streams.setdefault(stream.ptr, (stream, []))[1].append(operation)
        for stream, operations in streams.values():
            stream.launch(_stream_entry(operations))  # a group call's operations start together


def _launch(stream: HostStream, post, finish) -> None:
    if _GroupCall.depth:
        _GroupCall.launches.append((stream, (post, finish)))
    else:
        stream.launch(_stream_entry([(post, finish)]))


def get_unique_id() -> bytes:
    """128 bytes, the type CuPy 14's get_unique_id() returns (here random: only checked equal across ranks)."""
    return os.urandom(128)


def get_version() -> int:
    return 0


# ---- the communicator -------------------------------------------------------------------------------------------
def _reduce(blocks: np.ndarray, op: int) -> np.ndarray:
    """Reduce the rows of `blocks` (one per rank) in rank order, low precision summed in float32 like NCCL."""
    low = blocks.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    wide = np.float32 if low else blocks.dtype
    acc = blocks[0].astype(wide)
    combine = {SUM: np.add, AVG: np.add, PROD: np.multiply, MAX: np.maximum, MIN: np.minimum}.get(op)
    if combine is None:
        raise ValueError(f"NCCL stand-in: unknown reduction op code {op}")
    for block in blocks[1:]:
        acc = combine(acc, block.astype(wide))
    if op == AVG:
        acc = acc / len(blocks)
    return acc.astype(blocks.dtype)


class NcclCommunicator:
    """`cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)` over the MPI communicator `bootstrap` (a keyword the
    real one lacks; `HostNccl` binds it, so callers write the same call as for cupy)."""

    def __init__(self, ndev: int, commId, rank: int, *, bootstrap):
        if not isinstance(commId, bytes) or len(commId) != 128:  # CuPy 14 declares `bytes commId` of 128 bytes
            raise TypeError(f"NCCL stand-in: commId must be the 128 bytes of get_unique_id(), got {type(commId)}")
        if bootstrap.Get_size() != ndev or bootstrap.Get_rank() != rank:
            raise ValueError(f"NCCL stand-in: communicator of {ndev} ranks, rank {rank}, over an MPI communicator "
                             f"of {bootstrap.Get_size()} ranks where this is rank {bootstrap.Get_rank()}")
        self._comm = bootstrap.Dup()
        ids = self._comm.allgather(tuple(commId))
        if any(other != ids[0] for other in ids):
            raise ValueError("NCCL stand-in: the ranks passed different unique ids (broadcast it from one rank)")
        self._rank, self._size = rank, ndev
        self._stream = None  # the one stream this communicator's operations are queued on (see _start)
        self.issued: list[tuple] = []  # (op, peer, count, dtype code) of every send and recv, in issue order

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def device_id(self) -> int:
        return 0

    def destroy(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def abort(self) -> None:
        self.destroy()

    def check_async_error(self) -> None:
        return None

    # -- collectives: inputs are read at the call (host data is ready then), results written when complete
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        source = _memory(sendbuf, count, datatype).copy()
        target = _memory(recvbuf, count, datatype)
        gathered = np.empty((self._size, count), source.dtype)

        def finish():
            target[...] = _reduce(gathered, op)

        self._start(lambda: [self._comm.Iallgather(_bytes(source), _bytes(gathered))], finish, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        source = _memory(sendbuf, recvcount * self._size, datatype).copy()
        target = _memory(recvbuf, recvcount, datatype)
        blocks = np.empty((self._size, recvcount), source.dtype)  # block r of every rank, from rank r

        def finish():
            target[...] = _reduce(blocks, op)

        self._start(lambda: [self._comm.Ialltoall(_bytes(source), _bytes(blocks))], finish, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        source = _memory(sendbuf, count, datatype).copy()
        target = _memory(recvbuf, count * self._size, datatype)
        gathered = np.empty(count * self._size, source.dtype)

        def finish():
            target[...] = gathered

        self._start(lambda: [self._comm.Iallgather(_bytes(source), _bytes(gathered))], finish, stream)

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        source = _memory(sendbuf, count, datatype) if self._rank == root else None
        data = source.copy() if source is not None else np.empty(count, NCCL_DTYPES[datatype])
        target = _memory(recvbuf, count, datatype)

        def finish():
            target[...] = data

        self._start(lambda: [self._comm.Ibcast(_bytes(data), root=root)], finish, stream)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def send(self, sendbuf, count, datatype, peer, stream):
        data = _memory(sendbuf, count, datatype).copy()
        # synchronous: complete once the peer's receive started, as an NCCL send holds its stream until then
        self._start(lambda: [self._comm.Issend(_bytes(data), dest=peer, tag=0)], None, stream)
        self.issued.append(("send", peer, count, datatype))

    def recv(self, recvbuf, count, datatype, peer, stream):
        target = _memory(recvbuf, count, datatype)
        data = np.empty(count, target.dtype)

        def finish():
            target[...] = data

        self._start(lambda: [self._comm.Irecv(_bytes(data), source=peer, tag=0)], finish, stream)
        self.issued.append(("recv", peer, count, datatype))

    def _start(self, post, finish, stream) -> None:
        """Queue on `stream`, which must be the stream of every earlier call: a communicator's operations then run in
        the order they were issued, the same order on every rank (nccl.py's ordering rule)."""
        stream = stream_of(stream)
        if self._stream is None:
            self._stream = stream
        elif stream is not self._stream:
            raise ValueError(f"NCCL stand-in: a communicator used on stream {stream.ptr} after stream "
                             f"{self._stream.ptr}: its operations would no longer run in issue order")
        _launch(stream, post, finish)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


class HostNccl:
    """The stand-in as a module-like object bound to one MPI communicator (its bootstrap): `api.get_unique_id()`,
    `api.NcclCommunicator(n, uid, rank)`, `api.groupStart()`, ... exactly as `cupy.cuda.nccl` is called."""

    available = True
    get_unique_id = staticmethod(get_unique_id)
    groupStart = staticmethod(groupStart)
    groupEnd = staticmethod(groupEnd)

    def __init__(self, bootstrap):
        self._bootstrap = bootstrap

    def NcclCommunicator(self, ndev, commId, rank):
        return NcclCommunicator(ndev, commId, rank, bootstrap=self._bootstrap)
