"""Which node each rank runs on, learnt from MPI's shared-memory split (COMM_TYPE_SHARED), not from host names:
on a test cluster several SLURM nodes share one host name, and a real cluster can reuse names across domains.

A node's index is the order of its lowest world rank, so node 0 holds rank 0. MPITRAIN_FAKE_NODES=K (tests, demos)
splits one machine's ranks into K nodes of consecutive ranks, so that node-aware code (hierarchical data
parallelism, hybrid context parallelism) runs and is checked on one machine. `node_local_rank` (the rank among
the ranks of one node) is what picks a rank's GPU. The layout itself is a pure value (`NodeLayout`), testable without
MPI; `discover_nodes` is the only function that talks to MPI.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from mpitrain.errors import LayoutError

FAKE_NODES_ENV = "MPITRAIN_FAKE_NODES"


@dataclass(frozen=True)
class NodeLayout:
    """Node of every world rank (`node_of_rank[r]`), the node names (one per node) and this rank's position."""

    rank: int
    node_of_rank: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def from_leaders(cls, rank: int, leader_of_rank: Sequence[int], name_of_rank: Sequence[str]) -> NodeLayout:
        """Build from each rank's node leader (the lowest world rank sharing its memory) and each rank's name."""
        leaders = sorted(set(leader_of_rank))
        index = {leader: i for i, leader in enumerate(leaders)}
        return cls(rank=rank, node_of_rank=tuple(index[leader] for leader in leader_of_rank),
                   names=tuple(name_of_rank[leader] for leader in leaders))

    @classmethod
    def single(cls, world_size: int = 1, rank: int = 0, name: str = "localhost") -> NodeLayout:
        return cls(rank=rank, node_of_rank=(0,) * world_size, names=(name,))

    @classmethod
    def blocks(cls, world_size: int, rank: int, n_nodes: int) -> NodeLayout:
        """n_nodes nodes of consecutive ranks (world_size must divide evenly), named fakenode0, fakenode1, ..."""
        per_node = world_size // n_nodes
        leaders = [r // per_node * per_node for r in range(world_size)]
        return cls.from_leaders(rank, leaders, [f"fakenode{r // per_node}" for r in range(world_size)])

    @property
    def n_nodes(self) -> int:
        return len(self.names)

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    @property
    def node_name(self) -> str:
        return self.names[self.node]

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @property
    def node_local_rank(self) -> int:
        return self.ranks_on(self.node).index(self.rank)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on this rank's node (nodes may differ when the world does not divide evenly)."""
        return len(self.ranks_on(self.node))

    def nodes_of(self, members: Sequence[int]) -> list[int]:
        """Distinct nodes the given world ranks run on, in order of first appearance."""
        return list(dict.fromkeys(self.node_of_rank[r] for r in members))

    def crosses_nodes(self, members: Sequence[int]) -> bool:
        return len(self.nodes_of(members)) > 1

    def describe(self) -> str:
        """One line: each node's name and its world ranks, e.g. `2 nodes: node0 ranks 0-1, node1 ranks 2-3`."""
        parts = [f"{name} ranks {_ranges(self.ranks_on(i))}" for i, name in enumerate(self.names)]
        return f"{self.n_nodes} node{'s' if self.n_nodes != 1 else ''}: " + ", ".join(parts)


def split_by_node(members: Sequence[int], layout: NodeLayout, rank: int) -> tuple[list[int], list[int]]:
    """A group's two levels as seen from `rank`: `inside` are the members on rank's node, `across` the members at the
    same position among their node's members on every node (one per node). A hierarchical collective runs over
    `inside` then `across`; both partition the group, so every member is in exactly one of each kind.

    Every node must hold the same number of the group's members, else the two levels do not tile the group."""
    by_node: dict[int, list[int]] = {}
    for member in members:
        by_node.setdefault(layout.node_of_rank[member], []).append(member)
    counts = {node: len(ranks) for node, ranks in by_node.items()}
    if len(set(counts.values())) > 1:
        spread = ", ".join(f"{layout.names[node]}: {count}" for node, count in counts.items())
        raise LayoutError(f"group {list(members)} has a different number of ranks on each node ({spread}): a "
                          f"two-level (inside a node, then across nodes) collective needs the same number on each")
    inside = by_node[layout.node_of_rank[rank]]
    position = inside.index(rank)
    return inside, [ranks[position] for ranks in by_node.values()]


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def this_node_name() -> str:
    """SLURM's node name where srun set one (two slurmds on one host differ only there), else the host name."""
    slurm_name = os.environ.get("SLURMD_NODENAME")
    if slurm_name:
        return slurm_name
    from mpi4py import MPI
    return MPI.Get_processor_name()


def fake_node_count(world_size: int, env=os.environ) -> int:
    """MPITRAIN_FAKE_NODES as a node count (0: unset or 1, use the real layout); it must divide the world."""
    raw = env.get(FAKE_NODES_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) < 1 or world_size % int(raw):
        raise LayoutError(f"{FAKE_NODES_ENV}={raw!r} must be a node count that divides the {world_size} ranks")
    return int(raw) if int(raw) > 1 else 0


def discover_nodes(comm) -> NodeLayout:
    """Collective over `comm`: every rank learns the whole node layout (two small allgathers)."""
    from mpi4py import MPI
    rank = comm.Get_rank()
    fake = fake_node_count(comm.Get_size())
    if fake:
        return NodeLayout.blocks(comm.Get_size(), rank, fake)
    if comm.Get_size() == 1:
        return NodeLayout.single(1, 0, this_node_name())
    local = comm.Split_type(split_type=MPI.COMM_TYPE_SHARED, key=rank)
    try:
        leader = local.allreduce(rank, op=MPI.MIN)
    finally:
        local.Free()
    leaders = comm.allgather(leader)
    names = comm.allgather(this_node_name())
    return NodeLayout.from_leaders(rank, leaders, names)


def node_local_rank(comm) -> int:
    """This rank's position among the ranks of its node (what picks its GPU). Collective over `comm`."""
    return discover_nodes(comm).node_local_rank
