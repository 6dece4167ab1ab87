"""Two-level collectives over a group split by node (comm/nodes.py `split_by_node`, comm/mesh.py `inside_node` /
`across_nodes`): the collective runs inside each node first, over the fast links, and only 1/k of the bytes (k = the
group's ranks per node) cross the slow links between nodes.

    TwoLevelGroup   the whole group, same ranks and shards as the flat one (parallel.dp_reduce = "two_level"):
                    all_reduce      = reduce-scatter inside, all-reduce across on the 1/k piece, all-gather inside
                    reduce_scatter  = reduce-scatter inside, reduce-scatter across (blocks reordered so that rank r
                                      still receives block r)
                    all_gather      = all-gather across, all-gather inside (reordered back)
    NodeShardGroup  the node's ranks only (parallel.zero_shard = "node", hybrid sharding): ZeRO shards over them and
                    keeps one copy per node; its reduce-scatter also sums the shard across nodes (all-reduce over
                    the ranks holding the same shard), its all-gather stays inside the node.

Each stage is a non-blocking operation of the inside or across group, which count their own bytes (the across
group's counters are the bytes that cross nodes). MPI wants the collectives of a communicator issued in the same
order on every rank, while the next stage of an operation can only start once the previous one has landed: a
`Sequencer` per two-level group runs the operations strictly one after the other, stage by stage, in the order they
were started, driven by test() and wait(). Any other method (scalars, blocking collectives) first finishes what is
queued, then runs on the flat group (TwoLevelGroup) or the node's group (NodeShardGroup).
"""
from __future__ import annotations

from collections import deque

from mpitrain.backend import array_module
from mpitrain.comm.nodes import NodeLayout, split_by_node
from mpitrain.comm.operations import Handle


class _Chain:
    """One two-level operation: stages (callables that start an operation and return its handle, or None when
    nothing travels) run one after the other."""

    def __init__(self, stages):
        self.stages = deque(stages)
        self.current = None  # the handle of the stage in flight
        self.finished = False


class Sequencer:
    """Runs chains strictly in the order they were submitted, each stage started once the one before has landed."""

    def __init__(self):
        self.queue: deque[_Chain] = deque()

    def submit(self, stages) -> ChainHandle:
        chain = _Chain(stages)
        self.queue.append(chain)
        self.advance()
        return ChainHandle(self, chain)

    def advance(self, until: _Chain | None = None) -> None:
        """Start and complete stages as far as they have landed; with `until`, block until that chain is done."""
        while self.queue and not (until is not None and until.finished):
            chain = self.queue[0]
            if chain.current is None:
                chain.current = chain.stages.popleft()() or Handle.completed()
            if until is not None:
                chain.current.wait()
            elif not chain.current.test():
                return
            chain.current = None
            if not chain.stages:
                chain.finished = True
                self.queue.popleft()

    def drain(self) -> None:
        if self.queue:
            self.advance(until=self.queue[-1])


class ChainHandle:
    """A two-level operation in flight, as a request for `Handle.after` (test / wait / done)."""

    def __init__(self, sequencer: Sequencer, chain: _Chain):
        self._sequencer, self._chain = sequencer, chain

    @property
    def done(self) -> bool:
        return self._chain.finished

    def test(self) -> bool:
        self._sequencer.advance()
        return self._chain.finished

    def wait(self) -> None:
        self._sequencer.advance(until=self._chain)


def node_major_order(members: list[int], nodes: NodeLayout) -> list[int]:
    """Group ranks (positions in `members`) in the order a reduce-scatter inside the node, then across nodes, hands
    out blocks: position p = l * n + j is the member at place l on its node of the j-th node."""
    where = {}
    for index, member in enumerate(members):
        inside, across = split_by_node(members, nodes, member)
        where[(inside.index(member), across.index(member))] = index
    per_node, n_nodes = len(split_by_node(members, nodes, members[0])[0]), len(nodes.nodes_of(members))
    return [where[(place, node)] for place in range(per_node) for node in range(n_nodes)]


class _Delegating:
    """Methods not written here finish the queued two-level operations, then run on `self.base`."""

    base: object
    sequencer: Sequencer

    def __getattr__(self, name):
        attribute = getattr(self.base, name)
        if not callable(attribute):
            return attribute

        def after_queue(*args, **kwargs):
            self.sequencer.drain()
            return attribute(*args, **kwargs)
        return after_queue


class TwoLevelGroup(_Delegating):
    """The flat group `flat` (same rank, size and shards) whose buffer collectives run inside the node, then across
    nodes. `order`: node_major_order of the flat group's members."""

    def __init__(self, flat, inside, across, order: list[int]):
        self.base, self.inside, self.across, self.order = flat, inside, across, order
        self.name, self.rank, self.size, self.world_ranks = flat.name, flat.rank, flat.size, flat.world_ranks
        self.sequencer = Sequencer()

    def iall_reduce(self, buf, op: str = "sum") -> ChainHandle:
        flat, k = buf.reshape(-1), self.inside.size
        xp = array_module(buf)
        padded = flat if flat.size % k == 0 else xp.concatenate([flat, xp.zeros(-flat.size % k, flat.dtype)])
        piece = xp.empty(padded.size // k, flat.dtype)
        stages = [lambda: self.inside.ireduce_scatter(padded, piece, op), lambda: self.across.iall_reduce(piece, op),
                  lambda: self.inside.iall_gather(piece, padded)]
        if padded is not flat:
            stages.append(lambda: flat.__setitem__(slice(None), padded[:flat.size]))
        return self.sequencer.submit(stages)

    def ireduce_scatter(self, send, recv, op: str = "sum") -> ChainHandle:
        xp = array_module(send)
        reordered = send.reshape(self.size, -1)[self.order].reshape(-1)  # a copy: node-major block order
        piece = xp.empty(recv.size * self.across.size, send.dtype)
        return self.sequencer.submit([lambda: self.inside.ireduce_scatter(reordered, piece, op),
                                      lambda: self.across.ireduce_scatter(piece, recv, op)])

    def iall_gather(self, send, recv) -> ChainHandle:
        xp = array_module(send)
        piece = xp.empty(send.size * self.across.size, send.dtype)
        reordered = xp.empty(recv.size, recv.dtype)
        blocks = recv.reshape(self.size, -1)
        return self.sequencer.submit([lambda: self.across.iall_gather(send, piece),
                                      lambda: self.inside.iall_gather(piece, reordered),
                                      lambda: blocks.__setitem__(self.order, reordered.reshape(self.size, -1))])


class NodeShardGroup(_Delegating):
    """The node's ranks of a group (`inside`), over which ZeRO shards, with one copy of each shard per node: the
    ranks at the same place on every node (`across`). `copies`: (how many, which one is this rank), so that a
    checkpoint writes each shard once."""

    def __init__(self, inside, across):
        self.base, self.inside, self.across = inside, inside, across
        self.name, self.rank, self.size, self.world_ranks = inside.name, inside.rank, inside.size, inside.world_ranks
        self.copies = (across.size, across.rank)
        self.sequencer = Sequencer()

    def ireduce_scatter(self, send, recv, op: str = "sum") -> ChainHandle:
        return self.sequencer.submit([lambda: self.inside.ireduce_scatter(send, recv, op),
                                      lambda: self.across.iall_reduce(recv, op)])

    def iall_gather(self, send, recv) -> ChainHandle:
        return self.sequencer.submit([lambda: self.inside.iall_gather(send, recv)])

    def iall_reduce(self, buf, op: str = "sum") -> ChainHandle:
        return self.sequencer.submit([lambda: self.inside.iall_reduce(buf, op),
                                      lambda: self.across.iall_reduce(buf, op)])
