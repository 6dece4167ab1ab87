"""Elementwise work in cache-sized tiles, spread over a small thread pool.

numpy makes one full-size temporary per operation and streams it through memory; an op such as GELU then runs at
memory speed, on one core. Cut into tiles of ~512 KB the same chain of ufuncs stays in the cache, and since numpy
releases the GIL inside ufuncs, reductions and BLAS calls, a few Python threads keep all of a rank's cores busy.

Results do not depend on the number of threads: tile boundaries follow only from the array shapes, each tile writes
its own rows, and per-tile partial sums (weight gradients of the norms) are added in tile order.

The thread count is MPITRAIN_THREADS, else as many as BLAS was given (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS, the
cores the rank owns), so one rank per core runs no pool and one rank with N cores spreads its tiles over N threads.
The pool pays only because mpitrain/__init__.py shortens OpenBLAS's spin-wait (OPENBLAS_THREAD_TIMEOUT): after each
product OpenBLAS's idle threads otherwise spin for ~0.1 s on the very cores the tile threads need, and the pool then
loses more than it gains (the measurements are in benchmarks/README.md, "Measurements behind the CPU kernels").
OpenBLAS reads the variable when numpy loads it: in a program that imported numpy first, mpitrain has OpenBLAS
re-read it and restart its threads (restart_openblas_threads); where that is not possible the pool stays off by
default.
CuPy arrays are never tiled: the callers hand them to one call. A rank that runs thread replicas
(mpitrain/parallel/replicas.py) has each replica thread run its own tiles (`inline`): each owns a core already.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy  # noqa: F401  (loaded before threadpoolctl's controller looks for the BLAS libraries)
from threadpoolctl import ThreadpoolController

import mpitrain  # its OPENBLAS_THREAD_TIMEOUT_AT_LOAD is read at call time: mpitrain/__init__.py may import this first

TILE_BYTES = 512 * 1024  # measured: smaller tiles gain nothing more here and pay more Python overhead per tile


def _threads_from(name: str) -> int | None:
    """The positive whole number in environment variable `name`, else None."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


SHORT_SPIN_MAX = 16  # OPENBLAS_THREAD_TIMEOUT values (log2 of cycles, ~30 us at 16) short enough for the pool


def thread_count() -> int:
    """MPITRAIN_THREADS, else BLAS's thread count where OpenBLAS's idle threads spin briefly, else 1 (no pool)."""
    return _threads_from("MPITRAIN_THREADS") or (_blas_threads() if blas_spin_is_short() else 1)


_this_thread = threading.local()  # .inline: this thread's tiles run in it (a thread replica owns one core)


@contextlib.contextmanager
def inline():
    """Inside, the calling thread runs its tiles itself, without the pool (mpitrain/parallel/replicas.py: each
    replica thread has a core of its own already)."""
    before = getattr(_this_thread, "inline", False)
    _this_thread.inline = True
    try:
        yield
    finally:
        _this_thread.inline = before


def blas_spin_is_short() -> bool:
    """Whether OpenBLAS runs with a short idle spin (mpitrain/__init__.py records the value in force)."""
    value = (mpitrain.OPENBLAS_THREAD_TIMEOUT_AT_LOAD or "").strip()
    return value.isdigit() and int(value) <= SHORT_SPIN_MAX


@functools.lru_cache(maxsize=1)
def _blas_threads() -> int:
    """The threads BLAS runs with in this process (read once, before any tile has lowered it to one): from the
    variables OpenBLAS reads, in its order, else asked of the loaded libraries (~20 ms, so only when unset)."""
    return (_threads_from("OPENBLAS_NUM_THREADS") or _threads_from("OMP_NUM_THREADS")
            or max([lib.num_threads for lib in _blas_libraries()], default=1))


@functools.lru_cache(maxsize=1)
def _executor(threads: int) -> ThreadPoolExecutor:
    """One pool per process, created on first use (its threads sleep, not spin, between ops)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="mpitrain-tiles")


def tile_rows(row_bytes: int) -> int:
    """Rows per tile for rows of `row_bytes` bytes."""
    return max(1, TILE_BYTES // max(1, row_bytes))


def parallel_for(n_items: int, work, threads: int | None = None) -> None:
    """work(start, stop) over [0, n_items) cut into one contiguous range per thread (work tiles its range itself).

    While the threads run, BLAS runs one thread per call: OpenBLAS serialises multithreaded calls made from several
    threads at once (and its idle threads spin), so each thread's small products are best left on its own core.
    Exceptions in a worker are raised here."""
    threads = min(thread_count() if threads is None else threads, n_items)
    if threads <= 1 or getattr(_this_thread, "inline", False):
        if n_items:
            work(0, n_items)
        return
    bounds = [n_items * i // threads for i in range(threads + 1)]
    pool = _executor(threads)
    with one_blas_thread():
        futures = [pool.submit(work, bounds[i], bounds[i + 1]) for i in range(1, threads)]
        work(bounds[0], bounds[1])  # the calling thread takes the first range
        for future in futures:
            future.result()


def restart_openblas_threads() -> bool:
    """Have each loaded OpenBLAS re-read its environment variables and stop its threads; the next multithreaded
    call starts them again, with the spin-wait now in OPENBLAS_THREAD_TIMEOUT (read only when they start). Called
    once, at mpitrain's import, before any BLAS call of mpitrain's. False where no OpenBLAS has these entry points,
    and where other Python threads run (one of them could be inside a BLAS call, which stopping the threads would
    break)."""
    if threading.active_count() > 1:
        return False
    restarted = False
    for lib in _blas_libraries():
        if lib.internal_api != "openblas":
            continue
        try:
            handle = ctypes.CDLL(lib.filepath)
            read_environment, stop_threads = handle.openblas_read_env, handle.blas_thread_shutdown_
        except (OSError, AttributeError):
            continue
        read_environment()
        stop_threads()
        restarted = True
    return restarted


@functools.lru_cache(maxsize=1)
def _blas_libraries() -> list:
    return [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]


# users inside, and the threads BLAS had before the first of them entered
_blas_lowered = {"users": 0, "threads": [], "lock": threading.Lock()}


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: it makes its own pool, and a BLAS section another parent
    thread was inside (its lock possibly held) is not the child's."""
    _executor.cache_clear()
    _blas_lowered.update(users=0, lock=threading.Lock())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def one_blas_thread():
    """BLAS at one thread inside, restored when the last of any overlapping users leaves (the setting is the
    process's, so two threads entering at once must not restore each other's 1). The libraries' own setters (~1 us),
    not threadpoolctl.limit (~20 us, it re-reads every library's state): a step enters this a few hundred times."""
    libraries = _blas_libraries()
    with _blas_lowered["lock"]:
        if _blas_lowered["users"] == 0:
            _blas_lowered["threads"] = [lib.num_threads for lib in libraries]
            for lib in libraries:
                lib.set_num_threads(1)
        _blas_lowered["users"] += 1
    try:
        yield
    finally:
        with _blas_lowered["lock"]:
            _blas_lowered["users"] -= 1
            if _blas_lowered["users"] == 0:
                for lib, threads in zip(libraries, _blas_lowered["threads"]):
                    lib.set_num_threads(threads)


def for_each_tile(n_rows: int, rows_per_tile: int, work) -> None:
    """work(tile_index, start, stop) for every tile of `rows_per_tile` rows of [0, n_rows), tiles spread over the
    threads. Tile boundaries depend on the sizes only, never on the thread count."""
    n_tiles = -(-n_rows // rows_per_tile)

    def run(first, last):
        for tile in range(first, last):
            start = tile * rows_per_tile
            work(tile, start, min(start + rows_per_tile, n_rows))

    parallel_for(n_tiles, run)
