"""Offloading the optimizer-side state (`memory.offload`): master weights and moments live off the device.

A `Placement` decides where the arrays the optimizer owns are allocated (the fp32 master weights, when the compute
dtype is lower, and the moments) and hands them to the optimizer in pieces it can update:

    OnDevice   the default: ordinary device arrays, each segment updated whole (`memory.offload = none`, and
               `host` on CPU, where host memory is the device memory)
    Offloaded  arrays from an off-device allocator, streamed through the device in chunks; the next chunk's read runs
               in a reader thread while the current chunk is updated (numpy releases the GIL while it copies).
               `disk`: memory-mapped .npy files, one set per rank, in `memory.offload_dir` (default RUN_DIR/offload).
               GPU `host`: page-locked (pinned) host arrays from CuPy, each chunk copied to the GPU, updated there
               and copied back (pinned memory makes both copies DMA transfers; not yet run on a GPU). The reader
               thread copies onto the rank's GPU, entered per copy (the current device is per host thread).

AdamW's and SGD's updates are elementwise, so a chunk's update is bitwise the whole segment's; 8-bit Adam reads and
writes its codes a chunk of blocks at a time and Adafactor its element-wise state a segment at a time (`fetch`,
`store`), their small per-block and per-row state staying on the device. Offloading changes where the bytes live,
never the numbers (tests/test_offload.py, tests/test_optim_layouts.py). Checkpoints read and write the state through
the same arrays (a memory-mapped file reads like an array), so saving and restoring need nothing from here.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mpitrain.errors import ConfigError
from mpitrain.state.params import intersect
from mpitrain.state.strategy import Segment

KINDS = ("none", "host", "disk")


class OnDevice:
    """Master weights and moments are ordinary device arrays; the optimizer updates each segment in one go."""

    kind = "none"

    def __init__(self, xp):
        self.xp = xp

    def zeros(self, name: str, size: int, dtype):
        return self.xp.zeros(size, dtype=dtype)

    def resident_nbytes(self, array) -> int:
        """Bytes of `array` in device memory (what memory reports and plans count); None: no array."""
        return 0 if array is None else int(array.nbytes)

    def stream(self, segments, bounds, moments):
        """(segment, its slice of each moment array) for every segment; updated in place."""
        for segment, (start, end) in zip(segments, bounds):
            yield (segment, *[m[start:end] for m in moments])

    def fetch(self, array, start: int, end: int):
        """array[start:end] where the update can use it (here: a view, written in place)."""
        return array[start:end]

    def store(self, array, start: int, end: int, values) -> None:
        """values (from fetch, updated, or new) into array[start:end]."""
        array[start:end] = values

    def describe(self) -> str:
        return "master weights and moments on the device"


class Offloaded(OnDevice):
    """Arrays from `allocate(name, size, dtype)` that live off the device (memory-mapped files on CPU), streamed
    through resident buffers of at most `chunk_elements` per array, two chunks at a time (one read ahead)."""

    def __init__(self, kind: str, allocate, where: str, chunk_elements: int, to_device=np.array,
                 off_device=None, write_back=None):
        self.kind, self.allocate, self.where = kind, allocate, where
        self.chunk_elements = max(1, int(chunk_elements))
        self.to_device = to_device  # copy of an off-device slice into compute memory (GPU: cupy.asarray)
        # which arrays live off the device (disk: the memory-mapped files; GPU host: every numpy array)
        self.off_device = off_device or (lambda array: isinstance(array, np.memmap))
        self.write_back = write_back or _assign  # chunk -> off-device target (GPU: chunk.get(out=target))
        self.moved_nbytes = 0  # bytes of the arrays allocated off the device

    def zeros(self, name: str, size: int, dtype):
        array = self.allocate(name, size, dtype)
        self.moved_nbytes += int(array.nbytes)
        return array

    def resident_nbytes(self, array) -> int:
        """Off-device arrays (memory-mapped files, GPU pinned host arrays) hold no device memory."""
        return 0 if array is None or self.off_device(array) else int(array.nbytes)

    def stream(self, segments, bounds, moments):
        """Chunks of every segment: (a Segment over resident copies, the moments' resident chunks); after the caller
        updated them, the copies of off-device arrays are written back. Device arrays (the parameters when they are
        their own master) are handed out as views and updated in place."""
        tasks = [(i, a, min(a + self.chunk_elements, end - start))
                 for i, (start, end) in enumerate(bounds) for a in range(0, end - start, self.chunk_elements)]

        def sources(task):
            i, a, b = task
            offset = bounds[i][0]
            return [segments[i].params[a:b]] + [m[offset + a:offset + b] for m in moments]

        def read(task):
            return [self.to_device(s) if self.off_device(s) else s for s in sources(task)]

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-reader") as reader:
            ahead = reader.submit(read, tasks[0]) if tasks else None
            for k, task in enumerate(tasks):
                chunks = ahead.result()
                if k + 1 < len(tasks):
                    ahead = reader.submit(read, tasks[k + 1])  # overlaps the update below
                i, a, b = task
                segment = segments[i]
                yield (Segment(chunks[0], segment.grads[a:b], intersect(segment.decay_ranges, a, b)), *chunks[1:])
                for target, chunk in zip(sources(task), chunks):
                    if self.off_device(target):  # device arrays were handed out as views
                        self.write_back(target, chunk)

    def fetch(self, array, start: int, end: int):
        """A device copy of an off-device array's slice (a view of a device array)."""
        piece = array[start:end]
        return self.to_device(piece) if self.off_device(array) else piece

    def store(self, array, start: int, end: int, values) -> None:
        if self.off_device(array):
            self.write_back(array[start:end], values)
        else:
            array[start:end] = values

    def describe(self) -> str:
        return f"master weights and moments ({self.moved_nbytes:,} bytes) in {self.where}"


def _assign(target, chunk) -> None:
    target[...] = chunk


def pinned_host_placement(xp, chunk_elements: int) -> Offloaded:
    """GPU `memory.offload = host`: the state in page-locked host arrays (numpy arrays over CuPy's pinned
    allocator), streamed through the GPU in chunks; the copy back lands in the pinned array itself."""

    def allocate(name: str, size: int, dtype):
        import cupyx
        return cupyx.zeros_pinned((size,), dtype=dtype)

    return Offloaded("host", allocate, "pinned host memory", chunk_elements, to_device=copier_to_this_device(xp),
                     off_device=lambda array: isinstance(array, np.ndarray),
                     write_back=lambda target, chunk: chunk.get(out=target))


def copier_to_this_device(xp):
    """array -> a copy on the GPU current where this is called (the rank's). CUDA's current device belongs to each
    host thread and a new thread starts on GPU 0, so the offload reader thread enters the rank's GPU for every copy;
    else with several GPUs per node every rank's chunks would land on GPU 0."""
    device_id = xp.cuda.Device().id

    def to_device(array):
        with xp.cuda.Device(device_id):
            return xp.asarray(array)
    return to_device


def memmap_allocator(directory: Path, rank: int):
    """allocate(name, size, dtype): a zero-filled .npy file `rank_NNNNN_<name>.npy`, memory-mapped read-write (a new
    run's or restart's files start from zeros: their contents come from initialisation or a checkpoint)."""
    directory.mkdir(parents=True, exist_ok=True)

    def allocate(name: str, size: int, dtype):
        path = directory / f"rank_{rank:05d}_{name}.npy"
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(size,))
    return allocate


def make_placement(memory_cfg, optimizer_name: str, backend, rank: int, run_dir: Path | None, say=None):
    """The placement `memory.offload` asks for, checked: one line naming the key on bad input."""
    kind = memory_cfg.offload
    if kind == "none" or (kind == "host" and backend.device == "cpu"):
        if kind == "host" and say is not None:
            say("memory.offload = host on CPU: host memory is the device memory, nothing moves (use disk)")
        return OnDevice(backend.xp)
    chunk = int(memory_cfg.offload_chunk_mb * 2**20) // np.dtype(backend.optimizer_dtype).itemsize
    if kind == "host":
        return pinned_host_placement(backend.xp, chunk)
    if backend.device != "cpu":
        raise ConfigError("memory.offload = disk is built for train.device = cpu only (on a GPU use host)")
    if memory_cfg.offload_dir:
        directory = Path(memory_cfg.offload_dir)
    elif run_dir is not None:
        directory = Path(run_dir) / "offload"
    else:
        raise ConfigError("memory.offload = disk needs memory.offload_dir (this run has no run directory)")
    try:
        allocate = memmap_allocator(directory, rank)
    except OSError as exc:
        raise ConfigError(f"memory.offload_dir = {directory}: cannot create it on rank {rank} ({exc})") from None
    return Offloaded("disk", allocate, str(directory), chunk)


def offloaded_bytes(memory_cfg, device: str, optimizer_bytes: float) -> tuple[float, str]:
    """For `mpitrain memory`: the bytes that leave the device (the optimizer row: master weights, when separate, and
    moments) and where they go; (0, "") when nothing moves."""
    kind = memory_cfg.offload
    if kind == "none" or (kind == "host" and device == "cpu"):
        return 0, ""
    where = ("disk (memory-mapped files in memory.offload_dir, streamed in chunks)" if kind == "disk" else
             "pinned host memory")
    return optimizer_bytes, f"optimizer state (master + moments) moved to {where}"
