"""Memory at scale without the hardware: one rank's parameters, gradients, master weights and optimizer state built
through the code that training uses (state/factory.py's make_state, optim/factory.py's make_optimizer), on arrays
that have a shape and a dtype but hold no memory, and their bytes set against `mpitrain memory`'s rows.

The planner's rows come from formulas (plan/memory.py: e*Psi, o*Psi/N, ...); the arrays come from the state
classes' own allocation (ZeRO's parts, shards and padding, fp32 masters, frozen LoRA bases, expert groups, the
lean optimizers' rows). A 405B layout on 1,024 GPUs is checked on a laptop: every array is a zero-stride view of
one element (`nbytes` is still its full size), and the state is built with no initial values (`seed=None`).

The two agree up to the padding the state adds so that every ZeRO part splits evenly over its group (at most
group size - 1 elements per part): `padding` reports it, and `unpadded` the rows to compare.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from mpitrain.backend import COMPUTE_DTYPES, MASTER_DTYPES, Backend
from mpitrain.comm.mesh import group_members
from mpitrain.comm.nodes import NodeLayout, fake_node_count, split_by_node
from mpitrain.config import Config
from mpitrain.layout_checks import dp_split_kind, hierarchical_dp
from mpitrain.optim.factory import make_optimizer
from mpitrain.plan.memory import SHARDED, expert_degrees, memory_report, rank_model, rank_param_count
from mpitrain.state.factory import make_state
from mpitrain.state.offload import OnDevice


class ShapeOnlyArrays:
    """The numpy module, except that zeros/empty give arrays whose elements all share one memory cell (stride 0):
    shape, dtype, nbytes, slices and reshapes behave as numpy's, and nothing is allocated. Writes land in that one
    cell; nothing here reads values."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def zeros(shape, dtype=np.float64, **_):
        shape = (shape,) if np.ndim(shape) == 0 else tuple(shape)
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=dtype), shape=shape, strides=(0,) * len(shape),
                                               writeable=True)

    empty = zeros

    @staticmethod
    def asarray(array, dtype=None):
        return np.asarray(array, dtype=dtype)


@dataclass(frozen=True)
class ShapeGroup:
    """A process group by its size and this rank's place only: what the state classes read while they allocate
    (world_ranks: its members, where hierarchical data parallelism splits it by node)."""
    name: str
    size: int
    rank: int = 0
    world_ranks: list = field(default_factory=list)


@dataclass
class DryRun:
    rows: dict  # params, grads, optimizer: bytes of the arrays the state and optimizer allocated
    padding: dict  # of those, the bytes that only pad ZeRO parts to a multiple of their group (as Psi/N)
    planned: dict  # plan/memory.py's rows for the same rank

    @property
    def unpadded(self) -> dict:
        """The rows without padding: what the planner's formulas count."""
        return {kind: self.rows[kind] - self.padding.get(kind, 0) for kind in self.rows}


def shape_mesh(cfg: Config, gpus_per_node: int = 0):
    """Rank 0's groups of cfg's layout (resolved), as sizes: dp, dp_cp (what gradients are reduced over when cp > 1),
    tp, ep, expert_dp; under parallel.dp_reduce = two_level or zero_shard = node also the gradient group's members
    and its two levels on nodes of gpus_per_node consecutive ranks (0: one node), as comm.Mesh splits them."""
    p, degrees = cfg.parallel, expert_degrees(cfg)
    mesh = SimpleNamespace(dp=ShapeGroup("dp", p.dp), dp_cp=ShapeGroup("dp_cp", p.dp * p.cp),
                           tp=ShapeGroup("tp", p.tp), ep=ShapeGroup("ep", p.ep),
                           expert_dp=ShapeGroup("expert_dp", degrees.expert_dp), cp=ShapeGroup("cp", p.cp))
    if hierarchical_dp(p):
        world = degrees.world_size
        mesh.rank, mesh.nodes = 0, NodeLayout.blocks(world, 0, world // (gpus_per_node or world))
        kind = dp_split_kind(p)
        members = group_members(kind, 0, degrees)
        inside, across = split_by_node(members, mesh.nodes, 0)
        setattr(mesh, kind, ShapeGroup(kind, len(members), 0, members))
        mesh.inside_node = {kind: ShapeGroup(f"{kind}_inside", len(inside), 0, inside)}
        mesh.across_nodes = {kind: ShapeGroup(f"{kind}_across", len(across), 0, across)}
    return mesh


def dry_run(cfg: Config, pp_rank: int = 0, gpus_per_node: int | None = None) -> DryRun:
    """Pipeline rank pp_rank's (tp, dp rank 0) state and optimizer, built with shapes only; cfg's layout resolved.
    gpus_per_node: the nodes' size where the layout splits its gradient group by node (None: as MPITRAIN_FAKE_NODES
    splits the world, as the training code does on one machine, else one node)."""
    if gpus_per_node is None:
        world = expert_degrees(cfg).world_size
        gpus_per_node = world // (fake_node_count(world) or 1)
    compute = np.dtype(COMPUTE_DTYPES[cfg.precision.compute])
    master = np.dtype(MASTER_DTYPES.get(cfg.precision.master, np.float32)) if compute.itemsize < 4 else None
    backend = Backend("cpu", ShapeOnlyArrays(), compute, master)
    model, mesh = rank_model(cfg, pp_rank), shape_mesh(cfg, gpus_per_node)
    placement = OnDevice(backend.xp)  # memory.offload moves the optimizer row off the device, the same bytes
    state = make_state(cfg, model, backend, mesh, placement, initialise=False)
    optimizer = make_optimizer(cfg.optim, state, placement, mesh.tp, mesh.ep)
    held = state.memory()
    rows = {"params": held["params"], "grads": held["grads"], "optimizer": held["master"] + optimizer.state_nbytes()}
    planned = memory_report(cfg, rank_param_count(cfg, pp_rank), pp_rank, gpus_per_node=gpus_per_node)["bytes"]
    return DryRun(rows, _padding(state, rows, cfg.parallel.zero), {kind: planned[kind] for kind in rows})


def _padding(state, rows: dict, zero: int) -> dict:
    """Of each row, the bytes that pad ZeRO's parts to a multiple of their group: a part of s elements padded to s'
    adds s' - s elements where the row holds it whole, (s' - s) / group size where it is sharded."""
    if zero == 0:  # plain data parallelism: one flat buffer, no padding
        return {}
    pads = [(state.geometry.unit_range(p)[1] - state.geometry.unit_range(p)[0] - part.size, state.group_of(p).size)
            for p, part in enumerate(state.parts)]
    whole, sharded = state.geometry.size, state.shard_offsets[-1]  # elements held by a whole row, a sharded one
    padding = {}
    for kind, nbytes in rows.items():
        is_sharded = zero in SHARDED[kind]
        per_element = nbytes / (sharded if is_sharded else whole) if nbytes else 0.0
        padding[kind] = per_element * sum(pad / size if is_sharded else pad for pad, size in pads)
    return padding


def format_dry_run(run: DryRun) -> str:
    """The dry run's rows beside the formulas', one line each, and whether they agree (padding aside)."""
    lines = ["dry run (state/ and optim/ built with shapes only, first pipeline stage, tp and dp rank 0):"]
    for kind, nbytes in run.rows.items():
        agree = abs(run.unpadded[kind] - run.planned[kind]) <= 1e-9 * max(1.0, run.planned[kind])
        pad = f" ({run.padding[kind]:,.0f} of it padding)" if run.padding.get(kind) else ""
        lines.append(f"  {kind:<12} {nbytes:>16,} bytes{pad}   formula {run.planned[kind]:>18,.0f}   "
                     f"{'equal' if agree else 'DIFFERENT'}")
    return "\n".join(lines)
