"""Pipeline parallelism: which layers each pipeline rank holds, and the executor that runs its instruction list.

When each rank forwards or backwards which micro-batch is decided by a pure function (mpitrain/parallel/schedule.py,
printable and tested without MPI). This module turns one rank's instruction list into work, over the pp group:

    recv_forward / recv_backward   wait for the activation / gradient a neighbouring stage sent. Receives are posted
                                   early (Irecv, one ahead per (peer, direction)), in the order the schedule's
                                   messages are proven to arrive (FIFO per channel, one MPI tag per direction)
    forward                        GPT.forward of one chunk. Stage 0 embeds the micro-batch's tokens; the last stage
                                   returns the loss sum and keeps the loss scale as its backward's dy
    send_forward / send_backward   Isend. The executor drops the array at once: the request holds it until it is
                                   delivered, and finished requests are tested away after every instruction, so a
                                   stage's output lives only until it is sent
    backward                       GPT.backward of one chunk
    backward_input                 a split backward's B (zb1p, zbv, dualpipev): the weight-gradient matmuls deferred...
    backward_weight                ... which its W runs (GPT.backward_weight)
    reduce_grads                   wait for the sends; the state's finish() (DP all-reduce or ZeRO reduce-scatter over
                                   this stage's dp group, started by the state's hooks during the last backwards);
                                   then, for gpt2's tied embedding, the gradient sum between the first and last stage
    optimizer_step                 back to the trainer: clipping needs the global norm over every stage (train.py)

Messages live where the pp group moves them (`moves_device_memory`): NCCL takes device buffers as they are, so a
message costs no host copy; MPI gets host buffers, the model's arrays copied out and back (MPI never sees device
memory: docs/architecture.md, Backends).

Every instruction is recorded into a Timeline (compute, or waiting on a peer), so the bubble is measured from what
each rank did rather than assumed; `activation_peak_bytes` is the most saved state (and deferred W work) held at once.
With pp = 1 the 1f1b schedule is the plain accumulation loop (F0 B0 F1 B1 ...) and nothing is sent: the trainer runs
every degree through this executor.

Which layers: virtual stage s (chunk c of rank r is s = c*pp + r; the V of zbv and dualpipev: r and 2pp-1-r) holds
parallel.stage_layers[s] blocks (default: an even split, the remainder on the first stages, since the last also holds
the head); stage 0 also holds the embedding and the last stage the final norm, head and loss.

DualPipeV's overlapped pairs need nothing of their own here: their instructions put both halves' receives (posted
early, as every receive) before the forward and the forward's Isend before the backward, so one half's messages
move while the other computes.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque

import numpy as np

from mpitrain.backend import nbytes_of, wire_view
from mpitrain.parallel.schedule import Instruction, forward_only_program, message_peer, rank_and_chunk, stage_of
from mpitrain.parallel.timeline import Timeline
from mpitrain.state.reduce import add_into

TAGS = {"forward": 0, "backward": 1, "tied": 2}  # one MPI tag per direction: each channel stays FIFO


# ------------------------------------------------------------------------------------------------ the layer split

def stage_layer_counts(n_layer: int, stages: int, override=()) -> list[int]:
    """Blocks per virtual stage: `override` (parallel.stage_layers, checked by the config) or an even split, the
    remainder going to the first stages (the last one also runs the head, often the costliest unit)."""
    if override:
        return list(override)
    base, extra = divmod(n_layer, stages)
    return [base + (s < extra) for s in range(stages)]


def rank_stages(n_layer: int, pp: int, virtual_stages: int, pp_rank: int, override=(),
                placement: str = "loop") -> list[tuple[int, int]]:
    """[first, end) global unit ranges of the chunks of pipeline rank `pp_rank`, chunk c being virtual stage
    c*pp + pp_rank (placement "v", zbv's and dualpipev's: pp_rank and 2pp-1-pp_rank). Global units: 0 the
    embedding, 1..n_layer the blocks, n_layer + 1 the head."""
    stages = pp * virtual_stages
    bounds = np.cumsum([0] + stage_layer_counts(n_layer, stages, override)).tolist()
    chunks = []
    for chunk in range(virtual_stages):
        stage = stage_of(pp_rank, chunk, pp, placement)
        first = 0 if stage == 0 else 1 + bounds[stage]
        end = n_layer + 2 if stage == stages - 1 else 1 + bounds[stage + 1]
        chunks.append((first, end))
    return chunks


# ------------------------------------------------------------------------------------------------ gradients

class StepGradients:
    """The state as the model sees it during a pipelined step.

    Data parallelism and ZeRO-1 reduce a unit's gradient once per step, after its last backward. With micro-batches
    of several chunks interleaved, "the last micro-batch" differs from unit to unit, so the state is told once, at the
    start of the step, that it is in its last micro-batch, and `unit_done` reaches it only at a unit's m-th backward.
    A state that `reduces_every_micro_batch` (ZeRO-2/3: each micro-batch's gradient is reduce-scattered and freed)
    hears every `unit_done`. It is also where the executor drives its transfers: `progress` runs at every unit."""

    def __init__(self, state, micro_batches: int, progress=None):
        self.state, self.micro_batches = state, micro_batches
        self.every_micro_batch = state.reduces_every_micro_batch
        self.backwards: Counter = Counter()
        self.progress = progress  # called at every unit: drives MPI progress of the pipeline's transfers

    def begin_step(self) -> None:
        self.backwards.clear()
        self.state.begin_micro_batch(last=True)

    def acquire(self, unit: int, phase: str) -> dict:
        if self.progress is not None:
            self.progress()
        return self.state.acquire(unit, phase)

    def release(self, unit: int, phase: str) -> None:
        self.state.release(unit, phase)

    def grad_views(self, unit: int) -> dict:
        return self.state.grad_views(unit)

    def unit_done(self, unit: int) -> None:
        self.backwards[unit] += 1
        if self.every_micro_batch or self.backwards[unit] == self.micro_batches:
            self.state.unit_done(unit)


def tie_peer(model, group) -> int | None:
    """The pp rank holding the other side of this rank's tied unit, found from the tensors' `tied_to` (a copy names
    its original), not assumed: gpt2's embedding on the first stage and its copy beside the head on the last are one
    case. Collective over the pp group (once, at start-up)."""
    if group.size == 1:
        return None
    specs = [(f"{layout.name}.{spec.name}", spec.tied_to) for layout in model.layouts for spec in layout.specs]
    copies, owned = {tied for _, tied in specs if tied}, {name for name, tied in specs if not tied}
    everyone = group.broadcast_object(group.gather_object((copies, owned)))
    peers = [rank for rank, (their_copies, their_owned) in enumerate(everyone)
             if rank != group.rank and (copies & their_owned or their_copies & owned)]
    if len(peers) > 1:
        raise NotImplementedError(f"pp rank {group.rank} shares tied tensors with ranks {peers}; one peer is supported")
    return peers[0] if peers and model.tied_unit is not None else None


# ------------------------------------------------------------------------------------------------ the executor

class PipelineExecutor:
    """Runs this rank's instruction list for one step (`run_step`) or a forward-only pass (`forward_only`).

    model: the rank's GPT (its chunks); state: its parameter/gradient state; group: the pp group; program: this
    rank's instructions (schedule.make_schedule(...)[rank]); activation_shape: (micro_batch, T, d_model) of what
    stages send each other (T / tp under sequence parallelism); placement: schedule.placement_of(kind), which of
    this rank's chunks holds which stage (zbv's V hands the activation from chunk 0 to chunk 1 in memory)."""

    def __init__(self, model, state, group, program: list[Instruction], micro_batches: int, activation_shape,
                 backend, breakdown=None, placement: str = "loop"):
        self.model, self.state, self.group, self.program = model, state, group, program
        self.rank, self.p, self.v = group.rank, group.size, len(model.chunks)
        self.placement = placement
        self.last_stage = self.p * self.v - 1
        self.shape, self.backend = tuple(activation_shape), backend
        # where messages live: device buffers for a group that moves device memory (NCCL), host buffers for MPI
        self.device_messages = group.moves_device_memory
        self.gradients = StepGradients(state, micro_batches, progress=self._progress)
        self.timeline = Timeline(rank=self.rank, breakdown=breakdown)  # breakdown: profile/breakdown.py's
        self.activation_peak_bytes = 0  # saved state + deferred W work held at once, in the last step
        self.saved_bytes_per_micro_batch = [0] * self.v  # per chunk, one forward's saved state
        self.tied_peer = tie_peer(model, group)
        self._posted: dict = {}  # (op, peer) -> the receive posted on that channel (instruction, buffer, handle)
        self._sends: list = []  # sends still in flight
        self._operations = {  # instruction kind -> what runs it (optimizer_step ends the program: the trainer's)
            "recv_forward": self._recv_forward, "recv_backward": self._recv_backward,
            "send_forward": self._send_forward, "send_backward": self._send_backward,
            "forward": self._forward, "backward": self._backward, "backward_input": self._backward_input,
            "backward_weight": self._backward_weight, "reduce_grads": self._reduce_grads,
        }

    # -- entry points
    def use_program(self, program: list[Instruction], micro_batches: int) -> None:
        """Run the steps from now on with another program of the same schedule, over `micro_batches` micro-batches
        (train.batch_rampup: the micro-batch count grows with the global batch)."""
        self.program = program
        self.gradients.micro_batches = micro_batches

    def run_step(self, batch, loss_scale: float) -> float:
        """Forward and backward every micro-batch through this rank's chunks, then reduce the gradients.
        batch(micro) -> (input ids, targets) as host arrays, and their packed documents third with
        data.document_mask (model.document_mask); loss_scale: d(loss)/d(loss sum), 1 / tokens of the
        global batch. Returns this rank's sum of token losses (0 unless it holds the last stage)."""
        self.gradients.begin_step()
        self.activation_peak_bytes = 0
        if self.p > 1:
            self.group.barrier()  # a common time origin for the pp ranks' timelines
        self.timeline.reset()
        return self._run(self.program, batch, loss_scale, self.timeline)

    def forward_only(self, batch, micro_batches: int) -> float:
        """Validation: forward every micro-batch, keep nothing for backward; returns the loss sum (last stage).
        Its timeline is thrown away: `timeline` keeps the last training step's."""
        program = forward_only_program(self.rank, self.p, self.v, micro_batches, self.placement)
        return self._run(program, batch, None, Timeline(rank=self.rank))

    # -- the loop
    def _run(self, program, batch, loss_scale, timeline) -> float:
        self.batch, self.loss_scale, self.training = batch, loss_scale, loss_scale is not None
        self._timeline = timeline
        self.loss_sum = 0.0
        self._inputs, self._outputs, self._saved, self._output_grads, self._input_grads = {}, {}, {}, {}, {}
        self._deferred: dict = {}
        self._held_bytes: dict = {}
        self._sends = []
        self._receives: dict = defaultdict(deque)
        for ins in program:
            if ins.op.startswith("recv"):
                self._receives[ins.op, ins.peer].append(ins)
        self._posted = {}
        for channel in self._receives:
            self._post_receive(channel)
        for ins in program:
            if ins.op == "optimizer_step":
                break
            self._operations[ins.op](ins)
            if self._sends:
                self._sends = [handle for handle in self._sends if not handle.test()]
        for handle in self._sends:  # forward-only runs have no reduce_grads
            handle.wait()
        assert not (self._saved or self._deferred or self._posted), "the program left work undone"
        return self.loss_sum

    def _stage(self, ins: Instruction) -> int:
        return stage_of(self.rank, ins.chunk, self.p, self.placement)

    def _local_chunk(self, stage: int) -> int | None:
        """This rank's chunk holding `stage` when a neighbour's data passes to it in memory (V's turn), else None."""
        if not 0 <= stage <= self.last_stage or message_peer(self.rank, stage, self.p, self.v, self.placement) \
                is not None:
            return None
        return rank_and_chunk(stage, self.p, self.placement)[1]

    def _hold(self, key, tree) -> int:
        """Account the activations (micro, chunk) now holds: its saved state, then its deferred W work; None when
        they are gone. Counted per (micro, chunk), so the running total costs nothing however many are in flight."""
        if tree is None:
            self._held_bytes.pop(key, None)
            return 0
        nbytes = self._held_bytes[key] = nbytes_of(tree)
        self.activation_peak_bytes = max(self.activation_peak_bytes, sum(self._held_bytes.values()))
        return nbytes

    # -- point to point
    def _progress(self) -> None:
        """Test the transfers in flight. Large messages move in pieces that need both sides inside MPI; without
        this, a transfer waits until the peer finishes its whole forward or backward, and the bubble grows."""
        for _, _, handle in self._posted.values():
            handle.test()
        for handle in self._sends:
            handle.test()

    def _post_receive(self, channel) -> None:
        queue = self._receives[channel]
        if queue:
            ins = queue.popleft()
            buffer = self.backend.empty(self.shape, host=not self.device_messages)
            direction = "forward" if ins.op == "recv_forward" else "backward"
            self._posted[channel] = (ins, buffer, self.group.irecv(wire_view(buffer), source=ins.peer,
                                                               tag=TAGS[direction]))

    def _receive(self, ins: Instruction):
        channel = (ins.op, ins.peer)
        posted, buffer, handle = self._posted.pop(channel)
        assert (posted.micro, posted.chunk) == (ins.micro, ins.chunk), (posted, ins)
        with self._timeline.record(ins.op, ins.micro, ins.chunk):  # waiting on a peer
            handle.wait()
        self._post_receive(channel)
        return self._arrived(buffer)

    def _message(self, array):
        """What the group sends: the array itself on the device (NCCL), else a host copy (MPI)."""
        if self.device_messages:
            return self.backend.xp.ascontiguousarray(array)
        return np.ascontiguousarray(self.backend.to_host(array))

    def _arrived(self, buffer):
        """A received buffer as the model takes it: already on the device, or copied there from the host."""
        return buffer if self.device_messages else self.backend.from_host(buffer)

    def _send(self, ins: Instruction, array, direction: str) -> None:
        with self._timeline.record(ins.op, ins.micro, ins.chunk):
            self._sends.append(self.group.isend(wire_view(self._message(array)), dest=ins.peer, tag=TAGS[direction]))

    def _recv_forward(self, ins):
        self._inputs[ins.micro, ins.chunk] = self._receive(ins)

    def _recv_backward(self, ins):
        self._output_grads[ins.micro, ins.chunk] = self._receive(ins)

    def _send_forward(self, ins):
        self._send(ins, self._outputs.pop((ins.micro, ins.chunk)), "forward")  # ours is dropped here

    def _send_backward(self, ins):
        self._send(ins, self._input_grads.pop((ins.micro, ins.chunk)), "backward")

    # -- compute
    def _forward(self, ins):
        key, stage = (ins.micro, ins.chunk), self._stage(ins)
        inputs = targets = None
        documents = []
        every_stage = getattr(self.model, "document_mask", False)  # packed documents: every stage's attention
        if stage == 0 or stage == self.last_stage or every_stage:
            inputs, targets, *documents = self.batch(ins.micro)  # documents: with data.document_mask
        with self._timeline.record("forward", *key):
            x = self.backend.from_host(inputs) if stage == 0 else self._inputs.pop(key)
            targets = self.backend.from_host(targets) if stage == self.last_stage else None
            extra = {"documents": documents[0]} if documents else {}
            output, saved = self.model.forward(self.gradients, x, targets, ins.chunk, loss_scale=self.loss_scale,
                                               **extra)
        turn = self._local_chunk(stage + 1)
        if turn is not None:
            self._inputs[ins.micro, turn] = output
        elif stage < self.last_stage:
            self._outputs[key] = output
        else:
            self.loss_sum += float(output)
        if self.training:
            if stage == self.last_stage:
                self._output_grads[key] = self.loss_scale  # the last stage's backward starts from the loss scale
            self._saved[key] = saved
            self.saved_bytes_per_micro_batch[ins.chunk] = self._hold(key, saved)

    def _backward(self, ins, split: bool = False):
        key = (ins.micro, ins.chunk)
        deferred = {} if split else None
        with self._timeline.record(ins.op, *key):
            input_grad = self.model.backward(self.gradients, self._saved.pop(key), self._output_grads.pop(key),
                                             ins.chunk, deferred)
        turn = self._local_chunk(self._stage(ins) - 1)
        if turn is not None:
            self._output_grads[ins.micro, turn] = input_grad
        elif self._stage(ins) > 0:
            self._input_grads[key] = input_grad
        self._hold(key, deferred)  # None after a full backward: nothing left
        if split:
            self._deferred[key] = deferred

    def _backward_input(self, ins):
        self._backward(ins, split=True)

    def _backward_weight(self, ins):
        with self._timeline.record("backward_weight", ins.micro, ins.chunk):
            self.model.backward_weight(self.gradients, self._deferred.pop((ins.micro, ins.chunk)), ins.chunk)
        self._hold((ins.micro, ins.chunk), None)

    # -- gradients
    def _reduce_grads(self, ins):
        with self._timeline.record("reduce_grads"):
            for handle in self._sends:
                handle.wait()
            self._sends = []
            self.state.finish()
            self._sum_tied_grads()

    def _sum_tied_grads(self) -> None:
        """gpt2's head (last stage) reads the embedding (first stage): each holds a copy and a part of its gradient.
        Both ranks swap their part and add: a + b == b + a exactly, so the copies get the same gradient, and the
        same update. Bytes: the embedding unit's gradient (this rank's ZeRO shard of it), each way."""
        if self.tied_peer is None:
            return
        _, _, mine = self.state.reduced_grad_window(self.model.tied_unit)
        theirs = self.backend.empty(mine.shape, mine.dtype, host=not self.device_messages)
        receive = self.group.irecv(wire_view(theirs), source=self.tied_peer, tag=TAGS["tied"])
        self.group.send(wire_view(self._message(mine)), dest=self.tied_peer, tag=TAGS["tied"])
        receive.wait()
        add_into(mine, self._arrived(theirs))
