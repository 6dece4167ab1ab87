"""The process mesh: which world ranks form the data-, tensor-, pipeline-, context- and expert-parallel groups.

World ranks are laid out pp-major, then dp, then cp, with tp innermost (fastest):

    world_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so a tensor-parallel group is a run of consecutive ranks (inside one node, where its frequent all-reduces are
cheap). That is the attention (dense) mesh, tp x cp x dp per pipeline stage. The experts of MoE layers sit on a
second mesh over the same ranks of a stage (Megatron's "parallel folding"), etp x ep x edp, etp fastest:

    stage_rank = world_rank mod (tp * cp * dp) = (edp_rank * ep + ep_rank) * etp + etp_rank

etp (`parallel.etp`, 0: tp) is 1 or tp: with etp = tp an expert is split like the dense MLP over the tp group; with
etp = 1 experts are whole and the tp ranks, which hold the same tokens, each route their own share of them. So the
ep ranks of one expert group are consecutive "token holders" (tp shares, then cp ranks, then dp ranks: ep is drawn
from tp/etp x cp x dp), and `expert_dp` (edp) joins the ranks that hold the same expert pieces. With cp = 1 and
etp = tp this is the earlier layout: ep consecutive dp ranks.

The layout is pure functions of (world_rank, degrees), testable without MPI; `Mesh` only turns them into groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mpitrain.comm.group import Group
from mpitrain.comm.nodes import NodeLayout, discover_nodes
from mpitrain.comm.nodes import split_by_node as split_members
from mpitrain.comm.operations import ProgressRecord
from mpitrain.config_rules import positive_degree
from mpitrain.errors import LayoutError

GROUP_KINDS = ("world", "dp", "tp", "pp", "cp", "ep", "expert_dp", "dp_cp")
EXPERT_KINDS = ("ep", "expert_dp")  # groups of the expert mesh


@dataclass(frozen=True)
class Degrees:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 0  # expert tensor parallelism; 0: tp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks of a pipeline stage holding the same expert pieces: tp * cp * dp / (etp * ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def __str__(self) -> str:
        etp = f" etp={self.etp}" if self.etp else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep}{etp}"

    def describe_meshes(self) -> str:
        """The two meshes of a pipeline stage, e.g. `attention tp2 x cp2 x dp1, experts etp1 x ep2 x edp2`."""
        return (f"attention tp{self.tp} x cp{self.cp} x dp{self.dp}, experts etp{self.expert_tp} x ep{self.ep} x "
                f"edp{self.expert_dp}")


class Coordinates(NamedTuple):
    pp: int
    dp: int
    cp: int
    tp: int


class ExpertCoordinates(NamedTuple):
    pp: int
    edp: int
    ep: int
    etp: int


def validate_degrees(world_size: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                     etp: int = 0) -> Degrees:
    """Check the degrees against the world size before any collective; raise LayoutError naming what to change."""
    for key, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        positive_degree(f"parallel.{key}", value, LayoutError)
    product = dp * tp * pp * cp
    if product != world_size:
        raise LayoutError(
            f"parallel degrees dp={dp} x tp={tp} x pp={pp} x cp={cp} = {product} do not match the {world_size} MPI "
            f"ranks (world size); change parallel.dp/tp/pp/cp or run with -n {product}"
        )
    if etp not in (0, 1, tp):
        raise LayoutError(f"parallel.etp={etp} must be 1 (whole experts) or parallel.tp={tp} (experts split like "
                          f"the dense MLP); 0 means parallel.tp")
    holders = tp // (etp or tp) * cp * dp  # the ranks of a stage holding distinct tokens for the experts
    if holders % ep:
        choices = ", ".join(str(d) for d in range(1, holders + 1) if holders % d == 0)
        raise LayoutError(
            f"parallel.ep={ep} does not divide parallel.dp={dp} x cp={cp} x tp/etp={tp // (etp or tp)} = {holders} "
            f"(expert parallelism is drawn from the ranks holding other tokens); choose parallel.ep among {choices}"
        )
    return Degrees(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


def mesh_coordinates(world_rank: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> Coordinates:
    """(pp, dp, cp, tp) coordinates of a world rank; tp varies fastest."""
    if not 0 <= world_rank < dp * tp * pp * cp:
        raise ValueError(f"world rank {world_rank} is outside a mesh of {dp * tp * pp * cp} ranks")
    rest, tp_rank = divmod(world_rank, tp)
    rest, cp_rank = divmod(rest, cp)
    pp_rank, dp_rank = divmod(rest, dp)
    return Coordinates(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)


def expert_coordinates(world_rank: int, degrees: Degrees) -> ExpertCoordinates:
    """(pp, edp, ep, etp) coordinates of a world rank on the expert mesh of its pipeline stage; etp varies fastest."""
    d = degrees
    pp_rank, stage_rank = divmod(world_rank, d.tp * d.cp * d.dp)
    rest, etp_rank = divmod(stage_rank, d.expert_tp)
    edp_rank, ep_rank = divmod(rest, d.ep)
    return ExpertCoordinates(pp=pp_rank, edp=edp_rank, ep=ep_rank, etp=etp_rank)


def group_members(kind: str, world_rank: int, degrees: Degrees | Mapping[str, int]) -> list[int]:
    """World ranks of `world_rank`'s group of `kind`, in group-rank order (which is ascending world rank)."""
    d = degrees if isinstance(degrees, Degrees) else Degrees(**degrees)
    mine = _group_key(kind, world_rank, d)
    return [rank for rank in range(d.world_size) if _group_key(kind, rank, d) == mine]


def pipeline_neighbours(world_rank: int, degrees: Degrees | Mapping[str, int]) -> tuple[int | None, int | None]:
    """World ranks of the previous and next pipeline stage (None at the ends)."""
    stages = group_members("pp", world_rank, degrees)
    here = stages.index(world_rank)
    previous = stages[here - 1] if here > 0 else None
    following = stages[here + 1] if here + 1 < len(stages) else None
    return previous, following


def _group_key(kind: str, world_rank: int, d: Degrees) -> tuple:
    """What the members of one group of `kind` share: every axis of its mesh but the group's own."""
    if kind in EXPERT_KINDS:
        e = expert_coordinates(world_rank, d)
        return (e.pp, e.edp, e.etp) if kind == "ep" else (e.pp, e.ep, e.etp)
    c = mesh_coordinates(world_rank, d.dp, d.tp, d.pp, d.cp)
    if kind == "world":
        return ()
    if kind == "dp_cp":
        return (c.pp, c.tp)
    if kind in ("dp", "tp", "pp", "cp"):
        return tuple(getattr(c, axis) for axis in Coordinates._fields if axis != kind)
    raise ValueError(f"unknown group kind {kind!r}; expected one of {', '.join(GROUP_KINDS)}")


def all_groups_of(kind: str, degrees: Degrees) -> list[list[int]]:
    """Every group of `kind` as its world ranks (ascending), in O(world size)."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(degrees.world_size):
        groups.setdefault(_group_key(kind, rank, degrees), []).append(rank)
    return list(groups.values())


def split_by_node_members(kind: str, world_rank: int, degrees: Degrees,
                           nodes: NodeLayout) -> tuple[list[int], list[int]]:
    """The world ranks of `kind`'s group of world_rank on its node, and across nodes (comm/nodes.py split_by_node)."""
    return split_members(group_members(kind, world_rank, degrees), nodes, world_rank)


def check_node_splits(kinds: Sequence[str], degrees: Degrees, nodes: NodeLayout) -> None:
    """Every group of each kind split by node, checked on every rank before the first Split: a group whose nodes
    hold different numbers of its ranks is refused by all ranks alike, not only by its own members (which would
    leave the others waiting in the next Split)."""
    for kind in kinds:
        for members in all_groups_of(kind, degrees):
            try:
                split_by_node_members(kind, members[0], degrees, nodes)
            except LayoutError as exc:  # name the group kind: the user knows dp or cp, not world ranks
                raise LayoutError(f"the {kind} group's two levels (inside a node, across nodes): {exc}") from None


def groups_crossing_nodes(degrees: Degrees, nodes: NodeLayout) -> list[str]:
    """The group kinds with at least one group (of two or more ranks) spanning several nodes."""
    return [kind for kind in GROUP_KINDS
            if any(len(group) > 1 and nodes.crosses_nodes(group) for group in all_groups_of(kind, degrees))]


def check_fast_groups_in_node(degrees: Degrees, nodes: NodeLayout, allow_cross_node_tp: bool = False) -> None:
    """Refuse a tensor- or expert-parallel group that spans nodes: both exchange activations inside every layer (tp
    all-reduces each block's output, ep all-to-alls every token), which only the links inside a node make cheap."""
    if allow_cross_node_tp:
        return
    for kind, degree in (("tp", degrees.tp), ("ep", degrees.ep)):
        for members in all_groups_of(kind, degrees):
            if len(members) > 1 and nodes.crosses_nodes(members):
                names = ", ".join(nodes.names[n] for n in nodes.nodes_of(members))
                raise LayoutError(
                    f"parallel.{kind} = {degree} puts {kind} group {members} on several nodes ({names}): {kind} "
                    f"exchanges activations inside every layer and needs the fast links inside a node; use a "
                    f"parallel.{kind} that divides the ranks per node, or set parallel.allow_cross_node_tp = true")


class Mesh:
    """All process groups of one run, built with the same sequence of comm.Split calls on every rank.

    Groups: world, dp, tp, pp, cp, ep, expert_dp, dp_cp (dp and cp together: what gradients are reduced over when
    cp > 1); ep and expert_dp are the expert mesh's (module docstring), its etp group is tp's or one rank.
    Degrees are in `mesh.degrees`; `mesh.dp.size == mesh.degrees.dp`. `pp_prev`/`pp_next` are world ranks.
    All groups enter their operations in one progress record (`mesh.progress`, the watchdog's view of this rank).
    `mesh.nodes` is the node layout (learnt with a shared-memory split unless given); a tp or ep group that spans
    nodes is refused unless `allow_cross_node_tp`.
    `split_by_node` names the kinds that also get their two levels (`mesh.inside_node[kind]`: the group's ranks on
    this node; `mesh.across_nodes[kind]`: one rank per node, at this rank's position): hierarchical collectives.
    """

    def __init__(self, world_comm, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 progress: ProgressRecord | None = None, nodes: NodeLayout | None = None,
                 allow_cross_node_tp: bool = False, group_factory=None, listener=None, etp: int = 0,
                 split_by_node: Sequence[str] = ()):
        self.group_factory = group_factory or Group  # (comm, kind, progress) -> a Group; nccl.make_group_factory
        self.degrees = validate_degrees(world_comm.Get_size(), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        self.nodes = nodes if nodes is not None else discover_nodes(world_comm)
        check_fast_groups_in_node(self.degrees, self.nodes, allow_cross_node_tp)
        self.rank = world_comm.Get_rank()
        self.progress = progress if progress is not None else ProgressRecord(self.rank)
        if listener is not None:  # profile/breakdown.py's Breakdown: charges each wait to its kind of operation
            self.progress.listener = listener
        coords = mesh_coordinates(self.rank, dp, tp, pp, cp)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = coords
        experts = expert_coordinates(self.rank, self.degrees)
        self.ep_rank, self.etp_rank, self.edp_rank = experts.ep, experts.etp, experts.edp
        self.pp_prev, self.pp_next = pipeline_neighbours(self.rank, self.degrees)

        # Split is collective: every rank builds the groups in this same order.
        self.world = self._split(world_comm, "world")
        self.dp = self._split(world_comm, "dp")
        self.tp = self._split(world_comm, "tp")
        self.pp = self._split(world_comm, "pp")
        self.cp = self._split(world_comm, "cp")
        self.ep = self._split(world_comm, "ep")
        self.expert_dp = self._split(world_comm, "expert_dp")
        self.dp_cp = self._split(world_comm, "dp_cp")
        self.inside_node: dict[str, Group] = {}
        self.across_nodes: dict[str, Group] = {}
        check_node_splits(split_by_node, self.degrees, self.nodes)
        for kind in split_by_node:  # in the given order, the same on every rank
            inside, across = split_by_node_members(kind, self.rank, self.degrees, self.nodes)
            self.inside_node[kind] = self._split_members(world_comm, f"{kind}_inside", inside)
            self.across_nodes[kind] = self._split_members(world_comm, f"{kind}_across", across)

    def _split(self, world_comm, kind: str) -> Group:
        return self._split_members(world_comm, kind, group_members(kind, self.rank, self.degrees))

    def _split_members(self, world_comm, kind: str, members: list[int]) -> Group:
        # Colour each group by its first member (groups of one kind partition the world), order by position.
        comm = world_comm.Split(color=members[0], key=members.index(self.rank))
        assert comm.Get_size() == len(members) and comm.Get_rank() == members.index(self.rank), kind
        return self.group_factory(comm, kind, self.progress)

    def all_groups(self) -> list[Group]:
        return [getattr(self, kind) for kind in GROUP_KINDS] + [*self.inside_node.values(),
                                                                 *self.across_nodes.values()]

    def describe(self) -> str:
        d = self.degrees
        experts = f"; experts: ep {self.ep_rank}, etp {self.etp_rank}, edp {self.edp_rank}" \
            if d.ep > 1 or d.expert_tp != d.tp else f", ep {self.ep_rank}"
        return (f"mesh {d} on {d.world_size} ranks; rank {self.rank}: pp {self.pp_rank}, dp {self.dp_rank}, "
                f"cp {self.cp_rank}, tp {self.tp_rank}{experts}")

    def describe_layout(self) -> str:
        """The degrees and the nodes, e.g. `dp=1 tp=2 pp=1 cp=1 ep=1 on 1 node: node1 ranks 0-1`."""
        return f"{self.degrees} on {self.nodes.describe()}"

    def describe_placement(self) -> str:
        """One line: the nodes and their ranks, and which groups cross nodes (their traffic leaves the node)."""
        d = self.degrees
        experts = d.ep > 1 or d.expert_tp != d.tp  # the expert mesh differs from the attention mesh
        shown = [kind for kind, degree in (("dp", d.dp), ("tp", d.tp), ("pp", d.pp), ("cp", d.cp), ("ep", d.ep),
                                           ("expert_dp", d.expert_dp if experts else 1),
                                           ("dp_cp", d.dp * d.cp if d.cp > 1 else 1)) if degree > 1]
        crossing = [kind for kind in groups_crossing_nodes(d, self.nodes) if kind in shown]
        inside = [kind for kind in shown if kind not in crossing]
        meshes = f"; meshes per stage: {d.describe_meshes()}" if experts else ""
        return (f"placement: {self.nodes.describe()}; groups crossing nodes: {', '.join(crossing) or 'none'}; "
                f"inside one node: {', '.join(inside) or 'none'}{meshes}")
