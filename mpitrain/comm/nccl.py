"""GPU process groups: `NcclGroup` (NCCL collectives on device memory) and `HostStagedGroup` (device buffers copied
through host memory to MPI, for ranks that share one GPU, which NCCL refuses), with the MPI group's interface and
byte counters (group.py). MPI keeps the control plane: scalars, Python objects, barriers, the NCCL unique ids.

An NcclGroup holds one NCCL communicator for its collectives, on its own stream, and for point-to-point "lanes":
a communicator + stream per (tag, direction, parity of the sender's rank). NCCL has no tags and a send occupies its
stream until the peer posts the receive, so a pipeline's sends and receives, its forward and backward traffic, must
never queue behind each other on one stream: per lane a rank only sends or only receives from neighbours in one
direction, as MPI's per-tag FIFO channels behave. Tags without a lane go through MPI, staged through host memory.

Ordering. NCCL asks that operations on different communicators be issued in the same order on every rank, or
serialised. The lanes keep a weaker rule, and this is the rule: (1) each communicator is driven by ONE stream on
every rank (the stand-in refuses a second), so its operations run in issue order; (2) on a lane each rank only sends
or only receives, to or from one neighbour per direction, so the k-th send of a lane meets the k-th receive of the
peer on that lane, the same order on both sides (the schedule's FIFO order per channel; tests/test_pipeline.py reads
it off the stand-in); (3) every lane connects its neighbours at creation, lane by lane in the same order on every
rank (NCCL otherwise connects two ranks at their first exchange, inside the host call, with both hosts taking
part). Across lanes the ranks' orders differ: a receive is posted ahead of the matching send. Why not one
communicator on one stream with each send paired with the next receive in a group call (NCCL's own pattern): a
simulation of that (tests/test_pipeline.py: every schedule kind, p 2 to 8, m up to 16) completes gpipe, 1f1b and
zb1p but deadlocks every interleaved program of more than one round (m >= 2p), which needs a send to finish while
its receiver's single stream still waits on an earlier message. What the rule leaves to the GPU: the lanes'
kernels running side by side, which CUDA does not promise (a hardware queue shared by two streams,
CUDA_DEVICE_MAX_CONNECTIONS=1, or a device-wide synchronization while a receive is posted can serialise them).
mpitrain's own synchronizations wait on the compute stream only (Backend.synchronize: the legacy null stream, which
the non-blocking lane streams do not join).

Ordering with streams: before a launch the group's stream waits on an event recorded on the compute stream (inputs
are ready); after it an event is recorded on the group's stream, and the Handle waits on that event: on the GPU
(the compute stream waits, the host does not block) unless a host buffer must be copied back.

`runtime` hides what differs between CUDA and the host stand-in (nccl_standin.py): the nccl module, streams and
events, pointers and staging. `MPITRAIN_NCCL_STANDIN=1` (tests only) runs these groups on numpy arrays through the
stand-in; `=shared-gpu` pretends all ranks share one GPU, so every group is host-staged.
"""

from __future__ import annotations

import os

import numpy as np

from mpitrain.comm.group import Group
from mpitrain.comm.nccl_group import NcclGroup, copied_back
from mpitrain.comm.operations import Handle
from mpitrain.errors import ConfigError

STANDIN_ENV = "MPITRAIN_NCCL_STANDIN"
# Tags that get NCCL point-to-point lanes, per group kind: the pipeline's (parallel/pipeline.py TAGS: forward,
# backward, tied), the context-parallel ring's (parallel/context.py KV_TAG, GRAD_TAG) and the tp ring of
# parallel.tp_overlap (layers/tp_overlap.py RING_TAG: one tag, its two directions on separate lanes).
P2P_TAGS = {"pp": (0, 1, 2), "cp": (71, 72), "tp": (61,)}
ACROSS_NODES = "_across"  # comm/mesh.py names a node-split group's levels f"{kind}_inside" / f"{kind}_across"


def p2p_tags(kind: str) -> tuple[int, ...]:
    """The tags with NCCL lanes on a group of `kind`. A group's level across nodes carries its kind's ring (hybrid
    cp runs the cp ring on "cp_across"); the level inside a node only all-to-alls, so it gets none (lanes are
    communicators, made collectively at start-up)."""
    return P2P_TAGS.get(kind.removesuffix(ACROSS_NODES), ())


# ---- runtimes ----------------------------------------------------------------------------------------------------
class CudaRuntime:
    """CuPy: device arrays are native; numpy arrays are staged through a device copy."""

    description = "nccl"

    def __init__(self, need_nccl: bool = True):
        import cupy
        from cupy.cuda import nccl
        if need_nccl and not nccl.available:
            raise ConfigError("train.collectives = 'nccl': CuPy found no NCCL library (pip install nvidia-nccl-cu12 "
                              "or -cu13, matching the CuPy wheel)")
        self.cupy, self.nccl = cupy, nccl

    def api(self, bootstrap):
        return self.nccl

    def stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def event(self):
        return self.cupy.cuda.Event(disable_timing=True)

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def is_native(self, array) -> bool:
        return isinstance(array, self.cupy.ndarray)

    def pointer(self, array) -> int:
        return array.data.ptr

    def to_native(self, array):
        return self.cupy.ascontiguousarray(self.cupy.asarray(array))  # a host array: copied to the device

    def to_host(self, array) -> np.ndarray:
        return self.cupy.asnumpy(array)

    def copy_into(self, target, source) -> None:
        """target[...] = source across memories (either may be host or device)."""
        if isinstance(target, np.ndarray):
            np.copyto(target, self.cupy.asnumpy(source))
        else:
            target.set(source) if isinstance(source, np.ndarray) else self.cupy.copyto(target, source)

    def device_identity(self, world_rank: int) -> tuple:
        from mpitrain.comm.nodes import this_node_name
        return this_node_name(), self.cupy.cuda.Device().pci_bus_id


class HostRuntime:
    """The stand-in on numpy arrays (tests): arrays are native; staging (shared-gpu mode) copies host to host."""

    def __init__(self, shared_gpu: bool = False):
        from mpitrain.comm import nccl_standin
        self.standin, self.shared_gpu = nccl_standin, shared_gpu
        self.description = "nccl host stand-in" + (", all ranks sharing one GPU" if shared_gpu else "")

    def api(self, bootstrap):
        return self.standin.HostNccl(bootstrap)

    def stream(self):
        return self.standin.HostStream()

    def event(self):
        return self.standin.HostEvent()

    def current_stream(self):
        return self.standin.NULL_STREAM

    def is_native(self, array) -> bool:
        return isinstance(array, np.ndarray) and array.flags.c_contiguous

    def pointer(self, array) -> int:
        return self.standin.pointer(array)

    def to_native(self, array):
        return np.ascontiguousarray(array)

    def to_host(self, array) -> np.ndarray:
        return np.array(array, copy=True)  # a real copy, so the staged path's copy-back is exercised

    def copy_into(self, target, source) -> None:
        np.copyto(target, source)

    def device_identity(self, world_rank: int) -> tuple:
        return ("host", 0 if self.shared_gpu else world_rank)


def make_runtime(device: str, need_nccl: bool = True):
    standin = os.environ.get(STANDIN_ENV, "")
    if standin and need_nccl:
        return HostRuntime(shared_gpu=standin == "shared-gpu")
    if device != "cuda":
        raise ConfigError("train.collectives = 'nccl' needs train.device = 'cuda' (NCCL moves GPU memory); "
                          "use train.collectives = 'mpi' on CPUs")
    try:
        return CudaRuntime(need_nccl)
    except ImportError as exc:
        raise ConfigError("train.collectives = 'nccl' needs CuPy with NCCL: pip install 'mpitrain[cuda12]' "
                          "(or cuda13)") from exc


def make_group_factory(collectives: str, device: str, say=None):
    """What Mesh builds its groups with: Group (MPI), or per group NcclGroup / HostStagedGroup (the ranks of each
    group compare their GPUs: a collective over the group). say: where to print which collectives run."""
    if collectives == "mpi" and device != "cuda":
        return Group
    if collectives == "mpi":  # GPU arrays through MPI: every group host-staged (MPI never sees device memory)
        runtime = make_runtime(device, need_nccl=False)
        return lambda comm, kind, progress: HostStagedGroup(comm, kind, progress, runtime)
    if collectives != "nccl":
        raise ConfigError(f"train.collectives = {collectives!r} is not allowed; allowed: 'mpi', 'nccl'")
    runtime = make_runtime(device)
    if say is not None:
        say(f"collectives: {runtime.description}")

    def make_group(comm, kind, progress):
        from mpi4py import MPI
        identities = comm.allgather(runtime.device_identity(MPI.COMM_WORLD.Get_rank()))
        if comm.Get_size() == 1:
            return HostStagedGroup(comm, kind, progress, runtime)
        if len(set(identities)) < len(identities):  # NCCL refuses two ranks on one GPU
            if say is not None:
                say(f"collectives: ranks of group {kind} share a GPU; that group is host-staged through MPI")
            return HostStagedGroup(comm, kind, progress, runtime)
        return NcclGroup(comm, kind, progress, runtime, p2p_tags=p2p_tags(kind))
    return make_group


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


# ---- ranks sharing one GPU: MPI on host copies ------------------------------------------------------------------
class HostStagedGroup(Group):
    """The MPI group with device buffers copied to host before and back after (MPI never sees device memory).
    Also every group of size 1 under 'nccl' (its collectives are local copies or nothing)."""

    def __init__(self, comm, name, progress=None, runtime=None):
        super().__init__(comm, name, progress)
        self.runtime = runtime

    def _stage(self, method: str, received: tuple[int, ...], args, kwargs):
        if self.size == 1 and method in ("all_reduce", "iall_reduce", "broadcast", "ibroadcast"):
            return None if method[0] != "i" else Handle()  # nothing moves; counters stay 0 on a group of one
        args, copy_back = list(args), []
        for i, value in enumerate(args):
            if _is_array(value) and not isinstance(value, np.ndarray):
                args[i] = self.runtime.to_host(value)
                if i in received:
                    copy_back.append((value, args[i]))
            elif _is_array(value) and isinstance(self.runtime, HostRuntime) and i in received:
                args[i] = self.runtime.to_host(value)
                copy_back.append((value, args[i]))
        result = getattr(Group, method)(self, *args, **kwargs)
        if isinstance(result, Handle):
            return copied_back(self.runtime, result, copy_back)
        for target, source in copy_back:
            self.runtime.copy_into(target, source)
        return result


def _staged(method: str, received: tuple[int, ...]):
    def call(self, *args, **kwargs):
        return self._stage(method, received, args, kwargs)
    call.__name__ = method
    return call


# (method, positions of the buffers it writes): one staged wrapper each
for _method, _received in (("all_reduce", (0,)), ("iall_reduce", (0,)), ("reduce_scatter", (1,)),
                           ("ireduce_scatter", (1,)), ("all_gather", (1,)), ("iall_gather", (1,)),
                           ("broadcast", (0,)), ("ibroadcast", (0,)), ("all_to_all", (1,)), ("all_to_allv", (2,)),
                           ("send", ()), ("isend", ()), ("recv", (0,)), ("irecv", (0,))):
    setattr(HostStagedGroup, _method, _staged(_method, _received))
