"""Thread replicas: data parallelism inside one process, for a rank that owns several CPU cores.

A rank with N cores can spend them two ways on one micro-batch: every op split N ways (multithreaded BLAS, elementwise
tiles over a pool), or the micro-batch's rows split N ways, each part running the whole forward and backward on one
core in a thread of its own (numpy releases the GIL inside its ufuncs and BLAS calls). At the sizes a CPU trains, the
second wins: an op split two ways pays a thread wake-up and a wait on the slower half every time (~35 times a
step), and products of a few hundred columns scale poorly over threads, while each replica streams through its
layers unhindered (the measurements: benchmarks/README.md, "Measurements behind the pipeline and the replicas").

The parameters are shared (read only during forward and backward). Replica 0 runs in the calling thread and adds
into the state's gradients; each other replica adds into a gradient buffer of its own, which replica 0 adds to the
state's unit by unit as both have finished that unit, before the state hears `unit_done`, so a data-parallel
all-reduce still starts as soon as a unit's gradients are whole. Every communication stays on the calling thread.

The sums are the same as one pass over all rows, added in another order: in float32 results differ from a run with
`train.thread_replicas = 1` by rounding (as another micro_batch would), in float64 by ~1e-16 relative.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from mpitrain import tiles
from mpitrain.layout_checks import thread_replica_blockers
from mpitrain.state.frozen import split_frozen
from mpitrain.state.params import FlatBuffer


def replica_count(cfg, threads: int) -> int:
    """train.thread_replicas, or with 0 (auto) the rank's threads where the layout allows replicas (else 1); never
    more than the micro-batch's rows."""
    asked = cfg.train.thread_replicas
    if asked == 0:
        asked = 1 if thread_replica_blockers(cfg) else threads
    return max(1, min(asked, cfg.train.micro_batch))


def replica_rows(n_rows: int, replicas: int) -> list[slice]:
    """The rows of each replica: contiguous, sizes differing by at most one, none empty."""
    replicas = min(replicas, n_rows)
    bounds = [n_rows * k // replicas for k in range(replicas + 1)]
    return [slice(bounds[k], bounds[k + 1]) for k in range(replicas)]


class ThreadReplicas:
    """The model as the pipeline executor sees it (forward/backward of one micro-batch), its rows split over
    `replicas` threads. Only for one pipeline stage without tensor, context or expert parallelism and with parameters
    that need no gathering (config.thread_replicas decides): those layers communicate inside forward/backward."""

    def __init__(self, model, replicas: int):
        self.model, self.replicas = model, replicas
        xp, dtype = model.backend.xp, model.backend.dtype
        trainable, _ = split_frozen(model.layouts)  # frozen tensors (LoRA's base) get no gradient, as in the state
        self.grads = [FlatBuffer.allocate(trainable, xp, dtype) for _ in range(replicas - 1)]
        self.pool = ThreadPoolExecutor(replicas - 1, thread_name_prefix="mpitrain-replica")

    def __getattr__(self, name):  # everything else (flops, context, saved_bytes, ...) is the model's
        return getattr(self.model, name)

    def forward(self, state, x, targets=None, chunk: int = 0, loss_scale=None, documents=None):
        """The model's forward, each replica on its rows. Returns (loss sum, saved state per replica)."""
        parts = replica_rows(x.shape[0], self.replicas)

        def run(k):
            rows = parts[k]
            return self.model.forward(state, x[rows], None if targets is None else targets[rows], chunk, loss_scale,
                                      documents=None if documents is None else documents.rows(rows))

        results = self._on_every_replica(run, len(parts))
        return sum(float(loss) for loss, _ in results), [saved for _, saved in results]

    def backward(self, state, saved, dy, chunk: int = 0, deferred=None):
        """The model's backward of each replica's saved state; the others' gradients are added to the state's
        gradients (replica 0's) unit by unit. Returns None: a replicated model is the whole pipeline."""
        assert deferred is None, "thread replicas run without a pipeline (no zb1p W pass)"
        workers = [_WorkerGrads(state, grads) for grads in self.grads[:len(saved) - 1]]
        leader = _Leader(state, workers)

        def run(k):
            view = leader if k == 0 else workers[k - 1]
            try:
                self.model.backward(view, saved[k], dy, chunk)
            except BaseException:
                if k > 0:
                    workers[k - 1].failed()  # replica 0 must not wait for units this replica never finishes
                raise

        self._on_every_replica(run, len(saved))
        saved.clear()

    def _on_every_replica(self, work, count: int) -> list:
        """work(k) for k < count: replica 0 here, the others on the pool; BLAS and the tiles on one core each."""
        def on_own_core(k):
            with tiles.inline():
                return work(k)

        with tiles.one_blas_thread():
            futures = [self.pool.submit(on_own_core, k) for k in range(1, count)]
            try:
                first = on_own_core(0)
            finally:
                results = [future.result() for future in futures]  # a worker's exception is raised here
        return [first] + results


class _WorkerGrads:
    """What a replica other than 0 gives the model as its state: the shared parameters through the real state
    (acquire), its own gradient buffer, and a signal per unit whose gradients are complete."""

    def __init__(self, state, grads: FlatBuffer):
        self.state, self.grads, self.error = state, grads, False
        self.done: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, unit: int) -> threading.Event:
        """Set when this replica's gradients of `unit` are complete, or when it has failed (it never will be)."""
        with self._lock:
            event = self.done.setdefault(unit, threading.Event())
            if self.error:
                event.set()
            return event

    def acquire(self, unit: int, phase: str) -> dict:
        return self.state.acquire(unit, phase)

    def release(self, unit: int, phase: str) -> None:
        pass  # replica 0 releases: parameters that need no gathering have nothing to free

    def grad_views(self, unit: int) -> dict:
        return self.grads.views[unit]

    def unit_done(self, unit: int) -> None:
        self.event(unit).set()

    def failed(self) -> None:
        with self._lock:
            self.error = True
            for event in self.done.values():
                event.set()


class _Leader:
    """Replica 0's state: the real one, except that a unit is done only when every replica has finished it, its
    gradients then added into the state's."""

    def __init__(self, state, workers: list[_WorkerGrads]):
        self.state, self.workers = state, workers

    def __getattr__(self, name):  # acquire, release, grad_views, ...: the state's own
        return getattr(self.state, name)

    def unit_done(self, unit: int) -> None:
        views = self.state.grad_views(unit)
        for worker in self.workers:
            worker.event(unit).wait()
            if worker.error:
                raise RuntimeError("a thread replica failed (its error is raised after this one)")
            for name, grad in worker.grads.views[unit].items():
                views[name] += grad
                grad.fill(0)  # ready for the next micro-batch
        self.state.unit_done(unit)
