"""In-memory peer checkpoints, the fast tier beside the files (as Orbax's and Megatron's local checkpoints): every
`checkpoint.peer_every` steps each rank keeps a copy of its state in its node's memory and sends one to a partner rank
on the next node; after a node is lost, `--resume auto` restores from those copies when they are whole and newer
than (or as new as) the newest file checkpoint, else from the files.

Memory that outlives a job on a node is node-local tmpfs (/dev/shm, memory-backed; MPITRAIN_PEER_DIR moves it):

    ROOT/mpitrain-<run id>/<node>/own/rank_00003.step_00000012.bin    this rank's copy, on its own node
    ROOT/mpitrain-<run id>/<node>/peer/rank_00001.step_00000012.bin   a copy of rank 1, sent by it over MPI

The run id is a hash of the checkpoint directory (so a restart finds it); <node> the node's name. A copy holds every
piece the rank holds (`CheckpointManager.held()`, replicated ones too, in held() order) with the training state a
file checkpoint's index records, a CRC-32 of the values, and the layout: restoring needs no resharding, the values
go back where they were, so the continued run is bitwise the uninterrupted one. Files are written as `.partial` and
renamed; the previous step's copies are deleted once every rank has its new ones (an all-reduce of success). A copy
that fails (tmpfs full) is reported in one line and training goes on: the files stay the safe tier.

MPITRAIN_PEER_FAKE_NODES=K (tests, demos): split one machine's ranks into K nodes of consecutive ranks, each with its
own directory, so that deleting one of them is the loss of a node.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from mpitrain.backend import array_module, to_host
from mpitrain.checkpoint.pieces import HeldPiece
from mpitrain.checkpoint.resume import model_mismatch, review_changes
from mpitrain.checkpoint.store import Checkpoint, CheckpointError, step_dir_name
from mpitrain.comm.nodes import NodeLayout
from mpitrain.config import to_toml
from mpitrain.resilience.restart import PEER_RECORD, peer_copy_point

PEER_DIR_ENV = "MPITRAIN_PEER_DIR"
FAKE_NODES_ENV = "MPITRAIN_PEER_FAKE_NODES"
MAGIC = b"MPTPEER1"
COPY_NAME = "rank_{rank:05d}.step_{step:08d}.bin"
TAG_LENGTH, TAG_BYTES = 7101, 7102  # point-to-point tags of the copies (apart from the pipeline's)


def peer_root(checkpoint_dir: Path, env=os.environ) -> Path:
    """This run's folder in node memory: the same for every attempt of the run (keyed by its checkpoint directory)."""
    run_id = hashlib.sha1(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:12]
    return Path(env.get(PEER_DIR_ENV) or "/dev/shm") / f"mpitrain-{run_id}"


def peer_nodes(nodes: NodeLayout, env=os.environ) -> NodeLayout:
    """The node layout the copies are placed by: the real one, or MPITRAIN_PEER_FAKE_NODES blocks of ranks."""
    fake = int(env.get(FAKE_NODES_ENV) or 0)
    world = len(nodes.node_of_rank)
    if fake <= 1 or world % fake:
        return nodes
    return NodeLayout.blocks(world, nodes.rank, fake)


def partner_of(rank: int, nodes: NodeLayout) -> int | None:
    """The rank on the next node at the same place among its node's ranks (wrapping round); None on one node."""
    if nodes.n_nodes < 2:
        return None
    node = nodes.node_of_rank[rank]
    local = nodes.ranks_on(node).index(rank)
    following = nodes.ranks_on((node + 1) % nodes.n_nodes)
    return following[local % len(following)]


# ----------------------------------------------------------------------------- the bytes of one copy
def encode(pieces: list[tuple[dict, np.ndarray]], meta: dict) -> bytes:
    """MAGIC, the header's length (8 bytes), the header (JSON: meta, pieces with dtype, CRC-32), the raw values."""
    arrays = [np.ascontiguousarray(values) for _, values in pieces]
    crc = 0
    for values in arrays:
        crc = zlib.crc32(values.view(np.uint8).reshape(-1), crc)
    header = {"meta": meta, "crc32": crc,
              "pieces": [{**piece, "dtype": str(values.dtype), "nbytes": values.nbytes}
                         for (piece, _), values in zip(pieces, arrays)]}
    head = json.dumps(header).encode()
    return b"".join([MAGIC, len(head).to_bytes(8, "little"), head, *(values.data for values in arrays)])


def read_header(path: Path) -> dict | None:
    """A copy's header (meta and pieces), read without its values; None when the file is not a whole copy."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            return json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return None


def decode(blob) -> tuple[dict, list[tuple[dict, memoryview]]]:
    """(header, [(piece record, its raw bytes)]); raises ValueError when the bytes are not a whole copy."""
    view = memoryview(blob)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a peer copy")
    length = int.from_bytes(view[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8 + length
    header = json.loads(bytes(view[len(MAGIC) + 8:start]))
    pieces, crc = [], 0
    for record in header["pieces"]:
        raw = view[start:start + record["nbytes"]]
        if len(raw) != record["nbytes"]:
            raise ValueError("truncated")
        crc = zlib.crc32(raw, crc)
        pieces.append((record, raw))
        start += record["nbytes"]
    if crc != header["crc32"] or start != len(view):
        raise ValueError("its values do not match their CRC-32")
    return header, pieces


def write_atomically(path: Path, blob) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(blob)
    os.replace(partial, path)


def copies_in(folder: Path) -> list[tuple[int, int, Path]]:
    """(rank, step, path) of the whole copies in own/ or peer/ of a node's folder."""
    found = []
    for path in folder.glob("rank_*.step_*.bin") if folder.is_dir() else ():
        rank, step = path.stem.split(".")
        found.append((int(rank[len("rank_"):]), int(step[len("step_"):]), path))
    return found


def layout_of(cfg, world_size: int) -> dict:
    """What must not change for a copy to be restored as it is (a file checkpoint's index records the same)."""
    p = cfg.parallel
    return {"world_size": world_size, "dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "zero": p.zero}


class PeerCheckpoints:
    """The memory tier of one rank (collective methods, called by every rank in the same order)."""

    def __init__(self, manager, every: int, echo):
        self.manager, self.every, self.echo = manager, every, echo
        self.world = manager.world
        self.nodes = peer_nodes(manager.mesh.nodes)
        self.rank = self.world.rank
        self.partner = partner_of(self.rank, self.nodes)
        self.senders = [r for r in range(self.world.size) if partner_of(r, self.nodes) == self.rank]
        self.root = peer_root(manager.directory)
        self.node_dir = self.root / self.nodes.node_name
        self.record = manager.directory / PEER_RECORD
        self.reported = False

    @property
    def node_leader(self) -> bool:
        return self.nodes.node_local_rank == 0

    def _own(self, rank: int, step: int) -> Path:
        return self.node_dir / "own" / COPY_NAME.format(rank=rank, step=step)

    def _peer(self, rank: int, step: int) -> Path:
        return self.node_dir / "peer" / COPY_NAME.format(rank=rank, step=step)

    # -- copying
    def _blob(self, step: int) -> bytes:
        m = self.manager
        meta = {"step": step, "rank": self.rank, "layout": layout_of(m.cfg, self.world.size),
                "train_state": {"next_step": step, "optimizer_steps": m.optimizer.steps_taken},
                "extra_state": m.save_extra(), "config": to_toml(m.cfg), "created": time.time()}
        pieces = [(item.piece.to_dict(), np.asarray(to_host(item.view()))) for item in m.held()]
        return encode(pieces, meta)

    def _exchange(self, blob: bytes) -> dict[int, np.ndarray]:
        """Send this rank's copy to its partner; receive the copies of the ranks whose partner this rank is."""
        lengths = {sender: np.zeros(1, dtype=np.int64) for sender in self.senders}
        handles = [self.world.irecv(buf, sender, TAG_LENGTH) for sender, buf in lengths.items()]
        if self.partner is not None:
            handles.append(self.world.isend(np.array([len(blob)], dtype=np.int64), self.partner, TAG_LENGTH,
                                            kind="control"))
        for handle in handles:
            handle.wait()
        received = {sender: np.empty(int(buf[0]), dtype=np.uint8) for sender, buf in lengths.items()}
        handles = [self.world.irecv(buf, sender, TAG_BYTES) for sender, buf in received.items()]
        if self.partner is not None:
            handles.append(self.world.isend(np.frombuffer(blob, dtype=np.uint8), self.partner, TAG_BYTES))
        for handle in handles:
            handle.wait()
        return received

    def copy(self, step: int) -> None:
        """Collective: this rank's state after `step` into its node's memory and its partner's. Never raises for a
        copy that could not be written: it says so and the run goes on (the file checkpoints are the safe tier)."""
        started = time.perf_counter()
        blob = self._blob(step)
        problem = None
        try:
            write_atomically(self._own(self.rank, step), blob)
        except OSError as exc:
            problem = f"rank {self.rank}: {exc}"
        for sender, values in self._exchange(blob).items():
            try:
                write_atomically(self._peer(sender, step), values)
            except OSError as exc:
                problem = problem or f"rank {self.rank} (copy of rank {sender}): {exc}"
        seconds = time.perf_counter() - started
        failed = self.world.all_reduce_scalar(float(problem is not None), op="max")
        self._forget(keep=None if failed else step, drop=step if failed else None)
        if failed:
            problems = self.world.gather_object(problem)  # the reasons travel only when there are some
            if self.rank == 0:
                self.echo(f"peer copy of step {step} failed ({'; '.join(p for p in problems if p)}); kept the "
                          f"previous copies; training goes on")
            return
        slowest = self.world.all_reduce_scalar(seconds, op="max")
        if self.rank == 0:  # for `mpitrain launch`'s time lost (resilience/restart.py); small, on shared storage
            with contextlib.suppress(OSError):
                write_atomically(self.record, json.dumps({"step": step, "created": time.time()}).encode())
        if not self.reported:
            self.reported = True
            where = (f"partner rank {self.partner} on {self.nodes.names[self.nodes.node_of_rank[self.partner]]}"
                     if self.partner is not None else "no partner: one node, own copies only")
            self.echo(f"peer copy: {len(blob) / 1e6:.3g} MB per rank in {slowest * 1e3:.0f} ms (step {step}; "
                      f"{self.node_dir.parent}; rank 0's {where})")

    def _forget(self, keep: int | None, drop: int | None) -> None:
        """Delete this rank's own copies and those it holds for its senders: of every step but `keep`, or of `drop`
        (a copy that failed somewhere)."""
        mine = [(rank, step, path) for rank, step, path in copies_in(self.node_dir / "own") if rank == self.rank]
        held = [(rank, step, path) for rank, step, path in copies_in(self.node_dir / "peer") if rank in self.senders]
        for _, step, path in mine + held:
            if (keep is not None and step != keep) or step == drop:
                path.unlink(missing_ok=True)

    # -- restoring
    def _holdings(self) -> list[tuple]:
        """(rank, step, layout, path, reporter) of every whole copy in this node's memory; each node's first rank
        reports for its node."""
        if not self.node_leader:
            return []
        found = []
        for folder in ("own", "peer"):
            for rank, step, path in copies_in(self.node_dir / folder):
                header = read_header(path)
                if header is not None:
                    found.append((rank, step, header["meta"]["layout"], str(path), self.rank))
        return found

    def restore(self, file_path: Path | None, allowed_changes=()) -> tuple[int, float] | None:
        """Collective, for `--resume auto`: restore from the copies in the nodes' memory when, for the newest step
        that has one of every rank, this layout is the saved one and no file checkpoint is newer (`file_path`: the
        one the files would resume from). Returns (step, seconds taken), or None after one line saying why not."""
        started = time.perf_counter()
        file_step = Checkpoint.open(file_path).step if file_path else None
        gathered = self.world.gather_object(self._holdings())
        verdict = None
        if self.rank == 0:
            holdings = [copy for part in gathered for copy in part]
            verdict = plan_restore(holdings, layout_of(self.manager.cfg, self.world.size),
                                   self.nodes.node_of_rank, file_step)
        step, plan = self.world.broadcast_object(verdict)
        fallback = "the file checkpoint " + file_path.name if file_path else "a fresh start (no file checkpoint)"
        if step is None:
            self.echo(f"checkpoint: not restoring from peer memory: {plan}; using {fallback}")
            return None
        held = self.manager.held()
        problem, header, pieces = check_copy(self._fetch(plan), held, step)
        problems = self.world.gather_object(problem and f"rank {self.rank}: {problem}")
        if self.world.all_reduce_scalar(float(problem is not None), op="max"):
            if self.rank == 0:
                self.echo(f"checkpoint: not restoring from peer memory: {'; '.join(p for p in problems if p)}; "
                          f"using {fallback}")
            return None
        saved = Checkpoint(Path(f"peer-memory-{step_dir_name(step)}"), header["meta"])  # its config, as an index's
        mismatch = model_mismatch(saved, self.manager.cfg.model)  # the file restore's checks, the same everywhere
        if mismatch:
            raise CheckpointError(mismatch)
        review_changes(saved, self.manager.cfg, list(allowed_changes), self.echo)
        for item, (_, raw) in zip(held, pieces):
            load_piece(item, raw)
        kept = self.manager.directory / step_dir_name(step)
        self.manager.after_load(saved.index, kept if (kept / "COMMITTED").is_file() else None)
        return step, self.world.all_reduce_scalar(time.perf_counter() - started, op="max")

    def _read(self, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError:
            return b""  # the receiver finds it is not a copy and says so

    def _fetch(self, plan: dict) -> bytes:
        """Collective: this rank's copy, read from its node's memory or sent by the rank whose node holds it."""
        sends = []
        for rank, (holder, path) in sorted(plan.items()):
            if holder == self.rank and rank != self.rank:
                blob = np.frombuffer(self._read(path), dtype=np.uint8)
                sends.append(self.world.isend(np.array([blob.size], dtype=np.int64), rank, TAG_LENGTH, kind="control"))
                sends.append(self.world.isend(blob, rank, TAG_BYTES))
        holder, path = plan[self.rank]
        if holder == self.rank:
            mine = self._read(path)
        else:
            length = np.zeros(1, dtype=np.int64)
            self.world.irecv(length, holder, TAG_LENGTH).wait()
            buffer = np.empty(int(length[0]), dtype=np.uint8)
            self.world.irecv(buffer, holder, TAG_BYTES).wait()
            mine = buffer.tobytes()
        for handle in sends:
            handle.wait()
        return mine

    def time_file_load(self, path: Path) -> float:
        """Collective: seconds (the slowest rank's) to load the file checkpoint `path` into scratch buffers shaped as
        this rank's pieces, for the comparison with the memory tier."""
        started = time.perf_counter()
        scratch = [HeldPiece(item.piece, np.empty(item.piece.size, dtype=item.view().dtype), 0, False)
                   for item in self.manager.held()]
        Checkpoint.open(path).load_into(scratch)
        return self.world.all_reduce_scalar(time.perf_counter() - started, op="max")

    def settle(self, start: int) -> None:
        """Once the run continues from `start`: the copies of later steps are an abandoned future; the node's first
        rank deletes them (a fresh start: all)."""
        recorded = peer_copy_point(self.manager.directory) if self.rank == 0 else None
        if recorded is not None and recorded.step > start:
            self.record.unlink(missing_ok=True)
        if not self.node_leader:
            return
        for folder in ("own", "peer"):
            for _, step, path in copies_in(self.node_dir / folder):
                if step > start:
                    path.unlink(missing_ok=True)
            for torn in (self.node_dir / folder).glob("*.partial"):  # a copy cut short by the failure
                torn.unlink(missing_ok=True)

    def discard(self) -> None:
        """Collective, at the end of a finished run: free the nodes' memory of its copies."""
        if self.node_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)
        if self.rank == 0:
            self.record.unlink(missing_ok=True)
        self.world.barrier()
        if self.node_leader:
            with contextlib.suppress(OSError):  # another node's folder is still there (fake nodes), or it is gone
                self.root.rmdir()


def plan_restore(holdings: list[tuple], layout: dict, node_of_rank, file_step: int | None) -> tuple:
    """(step, {rank: (holder rank, path)}) for the newest step with a copy of every rank under `layout`, or
    (None, why not). A rank whose node holds its copy reads it itself; else the reporting rank sends it."""
    world = layout["world_size"]
    if not holdings:
        return None, "no copies in node memory"
    by_step: dict = {}
    other_layout: dict = {}
    for rank, step, saved_layout, path, reporter in holdings:
        if saved_layout != layout:
            other_layout[step] = saved_layout
            continue
        holder = rank if rank < world and node_of_rank[rank] == node_of_rank[reporter] else reporter
        by_step.setdefault(step, {}).setdefault(rank, []).append((holder, path))
    whole = [step for step, copies in by_step.items() if set(range(world)) <= copies.keys()]
    if not whole:
        newest = max(step for _, step, *_ in holdings)
        if newest in other_layout:
            return None, (f"the copies of step {newest} were saved under {_words(other_layout[newest])}, now "
                          f"{_words(layout)}")
        missing = sorted(set(range(world)) - by_step.get(newest, {}).keys())
        return None, f"no copy of rank(s) {', '.join(map(str, missing))} of step {newest} survives (own or partner)"
    step = max(whole)
    if file_step is not None and file_step > step:
        return None, f"its newest whole step, {step}, is older than the file checkpoint's, {file_step}"
    plan = {rank: min(copies, key=lambda copy, rank=rank: copy[0] != rank) for rank, copies in by_step[step].items()
            if rank < world}
    return step, plan


def _words(layout: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in layout.items())


def check_copy(blob: bytes, held: list[HeldPiece], step: int) -> tuple[str | None, dict | None, list]:
    """(None, header, pieces) when `blob` is a whole copy of step `step` holding exactly this rank's pieces, in
    order and dtype; else (why not, None, [])."""
    try:
        header, pieces = decode(blob)
    except (ValueError, KeyError) as exc:
        return f"its copy is unreadable ({exc})", None, []
    if header["meta"]["step"] != step:
        return f"its copy is of step {header['meta']['step']}, not {step}", None, []
    saved = [({k: v for k, v in record.items() if k not in ("dtype", "nbytes")}, record["dtype"])
             for record, _ in pieces]
    wanted = [(item.piece.to_dict(), str(item.view().dtype)) for item in held]
    if saved != wanted:
        return "its copy holds other pieces than this rank holds now", None, []
    return None, header, pieces


def load_piece(item: HeldPiece, raw) -> None:
    view = item.view()
    values = np.frombuffer(raw, dtype=view.dtype)
    if isinstance(view, np.ndarray):
        view[...] = values
    else:
        view[...] = array_module(view).asarray(values)
