"""Linears split over the tensor-parallel group, owning their collectives (Megatron's f and g, see
mpitrain/layers/tensor_parallel.py), their deferred weight gradients and a frozen mode.

    ColumnParallelLinear   y_i = enter(x) @ w_i (+ b_i): each rank holds some output columns of every w_i. Several
                           weights may share the input (Q/K/V, gate/up): the input is entered (gathered under
                           sequence parallelism) and saved once.
    RowParallelLinear      y = exit(x @ w) (+ b): each rank holds some input rows; the outputs are summed (or
                           reduce-scattered along the sequence), and the replicated bias is added once after that.

Parameters are looked up by name in the dict of views the caller hands in, so the same linear serves a flat
buffer, a ZeRO-3 gather, a column slice of a replicated K/V weight or a tied (transposed) embedding.

Weight gradients, one code path: backward makes each dW += x^T dy a work item (name, x, dy). Without a `deferred`
list it runs them at once (for a column-parallel linear between starting and waiting for the input-gradient
reduction, so that the communication overlaps the matmuls); with one (zero-bubble schedules, B) it appends them for
`run_weight_grads` (W), which looks the gradient views up again then (under ZeRO-2/3 a unit's full gradient is a
fresh buffer after each reduce-scatter). Bias gradients are cheap and always taken at once.

Frozen (`trainable=False`, LoRA's base weights): no weight or bias gradient at all, the input gradient as usual.
`adapters` (weight name -> mpitrain/layers/lora.py Adapter, set by apply_lora) add their low-rank terms.
"""
from __future__ import annotations

from mpitrain.layers import ops
from mpitrain.layers.tensor_parallel import TensorParallel


def run_weight_grads(work, grads) -> None:
    """dW += x^T dy for each (weight name, x, dy) work item; grads[name] is the gradient view (the W pass). A tuple
    of names: weights sharing x whose output gradients lie side by side in one buffer, one product for all."""
    for name, x, dy in work:
        if isinstance(name, tuple):
            ops.add_weight_grads([grads[n] for n in name], x, dy)
        else:
            ops.add_weight_grad(grads[name], x, dy)


def weight_grads(work, grads, deferred, tp) -> None:
    """Run the work items now, or append them to `deferred` (the W pass runs them later)."""
    if deferred is None:
        with tp.phase("backward_weight"):  # the step breakdown keeps weight gradients apart from input gradients
            run_weight_grads(work, grads)
    else:
        deferred.extend(work)


class ColumnParallelLinear:
    def __init__(self, tp: TensorParallel, in_features: int, weights: list[str],
                 biases: list[str | None] | None = None, trainable: bool = True):
        self.tp, self.in_features, self.weights, self.trainable = tp, in_features, list(weights), trainable
        self.biases = list(biases) if biases else [None] * len(self.weights)
        self.adapters: dict = {}

    def forward(self, params, x):
        """(outputs, saved): one output per weight, over the whole sequence; saved is the entered input."""
        h = self.tp.enter(x)
        outputs = [ops.linear_forward(h, params[w], params[b] if b else None)[0]
                   for w, b in zip(self.weights, self.biases)]
        for w, y in zip(self.weights, outputs):
            if w in self.adapters:
                self.adapters[w].add_forward(params, h, y)
        return outputs, h

    def backward(self, params, grads, h, output_grads, deferred=None):
        """Input gradient (this rank's sequence chunk under SP), reduced over tp; adds the parameter gradients."""
        dh = ops.linear_input_grad([params[w] for w in self.weights], output_grads)
        for w, dy in zip(self.weights, output_grads):
            if w in self.adapters:
                dh += self.adapters[w].backward(params, grads, h, dy, deferred)
        pending = self.tp.start_enter_backward(dh)
        if self.trainable:
            for bias, dy in zip(self.biases, output_grads):
                if bias:
                    ops.add_bias_grad(grads[bias], dy)
            # Q/K/V's gradients from the attention core share one buffer: one work item, one product in the W pass
            work = ([(tuple(self.weights), h, list(output_grads))] if ops.share_one_buffer(output_grads)
                    else [(w, h, dy) for w, dy in zip(self.weights, output_grads)])
            weight_grads(work, grads, deferred, self.tp)
        return pending.wait()

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """(shape, dtype) of what forward saves: the entered input, (batch, seq_len, in_features)."""
        return [((batch, seq_len, self.in_features), dtype)]


class RowParallelLinear:
    def __init__(self, tp: TensorParallel, in_features: int, weight: str, bias: str | None = None,
                 trainable: bool = True):
        """in_features: this rank's input columns (the split dimension's share)."""
        self.tp, self.in_features, self.weight, self.bias, self.trainable = tp, in_features, weight, bias, trainable
        self.adapters: dict = {}

    def forward(self, params, x):
        """(y, saved): x holds this rank's input columns; y is summed over tp (this rank's chunk under SP)."""
        partial = ops.linear_forward(x, params[self.weight])[0]
        if self.weight in self.adapters:  # a partial sum too: reduced with the linear's own (lora.py)
            self.adapters[self.weight].add_forward(params, x, partial)
        y = self.tp.exit(partial)
        if self.bias:
            y += params[self.bias]
        return y, x

    def backward(self, params, grads, x, dy, deferred=None):
        """dy arrives replicated (or as this rank's chunk under SP, then all-gathered): the bias gradient is taken
        from the full dy, so it is complete and identical on every rank."""
        dy = self.tp.exit_backward(dy)
        if self.trainable:
            if self.bias:
                ops.add_bias_grad(grads[self.bias], dy)
            weight_grads([(self.weight, x, dy)], grads, deferred, self.tp)
        dx = ops.linear_input_grad([params[self.weight]], [dy])
        if self.weight in self.adapters:
            dx += self.adapters[self.weight].backward(params, grads, x, dy, deferred)
        return dx

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """(shape, dtype) of what forward saves: the input, (batch, seq_len, this rank's in_features)."""
        return [((batch, seq_len, self.in_features), dtype)]
