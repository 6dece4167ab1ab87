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
`adapters` (weight name -> mpitrain/layers/lora.py Adapter, set by apply_lora) add their low-rank terms; under FP8
they multiply the unquantized input in the compute dtype (only the base GEMM runs in fp8).

FP8 (`fp8`: a mpitrain/layers/fp8.py Fp8Gemms, set by apply_fp8): the matmuls multiply the recipe's fp8 values of
their operands (inputs and weights e4m3, output gradients e5m2), outputs stored in the compute dtype. An input or
output gradient that is gathered along the sequence is quantized before the gather (its amax over the tp group), as
an FP8 all-gather would move it; bias gradients take the unquantized output gradient.
"""
from __future__ import annotations

from mpitrain.layers import fp8_lt, ops
from mpitrain.layers.tensor_parallel import TensorParallel


def run_weight_grads(work, grads) -> None:
    """dW += x^T dy for each (weight name, x, dy) work item; grads[name] is the gradient view (the W pass). A tuple
    of names: weights sharing x whose output gradients lie side by side in one buffer, one product for all."""
    for name, x, dy, *fp8_route in work:  # an FP8 linear's item ends with (its Fp8Gemms, (x key, dy key))
        if isinstance(name, tuple):
            ops.add_weight_grads([grads[n] for n in name], x, dy)
        elif fp8_route:
            fp8_lt.add_weight_grad(*fp8_route, grads[name], x, dy)
        else:
            ops.add_weight_grad(grads[name], x, dy)


def weight_grads(work, grads, deferred, tp) -> None:
    """Run the work items now, or append them to `deferred` (the W pass runs them later)."""
    if deferred is None:
        with tp.phase("backward_weight"):  # the step breakdown keeps weight gradients apart from input gradients
            run_weight_grads(work, grads)
    else:
        deferred.extend(work)


def _at(arrays, positions) -> list:
    """The arrays over a slice of their sequence axis (1); all of them for None."""
    return list(arrays) if positions is None else [array[:, positions] for array in arrays]


class ColumnParallelLinear:
    def __init__(self, tp: TensorParallel, in_features: int, weights: list[str],
                 biases: list[str | None] | None = None, trainable: bool = True):
        self.tp, self.in_features, self.weights, self.trainable = tp, in_features, list(weights), trainable
        self.biases = list(biases) if biases else [None] * len(self.weights)
        self.adapters: dict = {}
        self.fp8 = None

    def forward(self, params, x):
        """(outputs, saved): one output per weight, over the whole sequence; saved is the entered input."""
        weights, dtype = self._weights(params), x.dtype

        def project(rows):  # FP8 on a GPU: cuBLASLt (mpitrain/layers/fp8_lt.py)
            keys = [(self.weights[0] + ".x", name) for name in self.weights]
            return [fp8_lt.linear_forward(self.fp8, key, rows, w, params[b] if b else None)[0].astype(dtype, copy=False)
                    for w, key, b in zip(weights, keys, self.biases)]

        gemm_input = x if self.fp8 is None else self.fp8.inputs([self.weights[0] + ".x"], [x])[0]
        h, outputs = self.tp.enter_and_apply(gemm_input, project)  # parallel.tp_overlap: chunk by chunk
        if self.adapters and self.fp8 is not None:  # adapters read the unquantized input (under SP: a second gather)
            h = self.tp.enter(x)
        for w, y in zip(self.weights, outputs):
            if w in self.adapters:
                self.adapters[w].add_forward(params, h, y)
        return outputs, h

    def backward(self, params, grads, h, output_grads, deferred=None):
        """Input gradient (this rank's sequence chunk under SP), reduced over tp; adds the parameter gradients."""
        extra = [self.adapters[w].backward(params, grads, h, dy, deferred)
                 for w, dy in zip(self.weights, output_grads) if w in self.adapters]
        weights, gemm_grads = self._weights(params), output_grads
        if self.fp8 is not None:
            gemm_grads = self.fp8.output_grads([w + ".dy" for w in self.weights], output_grads)

        def input_grad(positions):  # unreduced, over a slice of the sequence (None: all of it)
            dh = fp8_lt.linear_input_grad(self.fp8, self.weights, weights, [w + ".dy" for w in self.weights],
                                          _at(gemm_grads, positions)).astype(output_grads[0].dtype, copy=False)
            for adapter_dh in _at(extra, positions):
                dh += adapter_dh
            return dh

        pending = self.tp.start_enter_backward_of(input_grad, h.shape[1])  # parallel.tp_overlap: a ring, chunk by chunk
        if self.trainable:
            for bias, dy in zip(self.biases, output_grads):
                if bias:
                    ops.add_bias_grad(grads[bias], dy)
            gemm_input = h  # the saved input: quantized, or (adapters under fp8) quantized again, to the same codes
            if self.adapters and self.fp8 is not None:
                gemm_input = self.fp8.inputs([self.weights[0] + ".x"], [h])[0]
            # Q/K/V's gradients from the attention core share one buffer: one work item, one product in the W pass
            one_product = ops.share_one_buffer(gemm_grads) and fp8_lt.runner(self.fp8, h) is None  # not cuBLASLt's
            work = ([(tuple(self.weights), gemm_input, list(gemm_grads))] if one_product
                    else [(w, gemm_input, dy, *self._fp8_route(w)) for w, dy in zip(self.weights, gemm_grads)])
            weight_grads(work, grads, deferred, self.tp)
        return pending.wait()

    def kept_scale(self):
        """What `enter_again` needs to quantize the input as the latest forward did (Fp8Gemms.keep_input); None
        without FP8 or where adapters make forward save the unquantized input."""
        return None if self.fp8 is None or self.adapters else self.fp8.keep_input(self.weights[0] + ".x")

    def enter_again(self, x, kept_scale=None):
        """Forward's saved input of x, without running the linear (selective recomputation): entered (gathered under
        SP) as forward entered it, quantized first to the same fp8 values, by `kept_scale` (kept_scale's value at
        that forward) under the per-tensor recipes: no amax all-reduce, the same codes."""
        if self.fp8 is not None and not self.adapters:
            x = self.fp8.inputs([self.weights[0] + ".x"], [x], amaxes=None if kept_scale is None else [kept_scale])[0]
        return self.tp.enter(x)

    def _fp8_route(self, weight: str) -> tuple:
        """The end of an FP8 linear's weight-gradient work item (run_weight_grads), () otherwise."""
        return () if self.fp8 is None else (self.fp8, (self.weights[0] + ".x", weight + ".dy"))

    def _weights(self, params) -> list:
        """The weights the matmuls multiply: as they are, or their fp8 values (split by output columns)."""
        weights = [params[w] for w in self.weights]
        return weights if self.fp8 is None else self.fp8.weights(self.weights, weights, -1)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """(shape, dtype) of what forward saves: the entered input, (batch, seq_len, in_features)."""
        return [((batch, seq_len, self.in_features), dtype)]


class RowParallelLinear:
    def __init__(self, tp: TensorParallel, in_features: int, weight: str, bias: str | None = None,
                 trainable: bool = True):
        """in_features: this rank's input columns (the split dimension's share)."""
        self.tp, self.in_features, self.weight, self.bias, self.trainable = tp, in_features, weight, bias, trainable
        self.adapters: dict = {}
        self.fp8 = None

    def _operands(self, params, x):
        """The matmul's input and weight: as they are, or their fp8 values (the weight split by input rows)."""
        if self.fp8 is None:
            return x, params[self.weight]
        return (self.fp8.inputs([self.weight + ".x"], [x])[0],
                self.fp8.weights([self.weight], [params[self.weight]], -2)[0])

    def forward(self, params, x):
        """(y, saved): x holds this rank's input columns; y is summed over tp (this rank's chunk under SP)."""
        gemm_input, weight = self._operands(params, x)

        def partial(positions):  # over a slice of the sequence (None: all of it)
            rows = gemm_input if positions is None else gemm_input[:, positions]
            summand = fp8_lt.linear_forward(self.fp8, (self.weight + ".x", self.weight), rows, weight)[0].astype(
                x.dtype, copy=False)
            if self.weight in self.adapters:  # a partial sum too: reduced with the linear's own (lora.py)
                self.adapters[self.weight].add_forward(params, _at([x], positions)[0], summand)  # unquantized
            return summand

        y = self.tp.exit_of(partial, x.shape[1])  # parallel.tp_overlap: a ring, chunk by chunk
        if self.bias:
            y += params[self.bias]
        return y, x

    def backward(self, params, grads, x, dy, deferred=None):
        """dy arrives replicated (or as this rank's chunk under SP, then all-gathered): the bias gradient is taken
        from the full dy, so it is complete and identical on every rank."""
        gemm_input, weight = self._operands(params, x)
        gemm_grad = dy if self.fp8 is None else self.fp8.output_grads([self.weight + ".dy"], [dy])[0]
        gemm_grad, (dx,) = self.tp.exit_backward_and_apply(  # parallel.tp_overlap: chunk by chunk, under the gather
            gemm_grad, lambda rows: [fp8_lt.linear_input_grad(self.fp8, [self.weight], [weight], [self.weight + ".dy"],
                                                              [rows]).astype(x.dtype, copy=False)])
        # the unquantized full dy where a bias or an adapter needs it (fp8 under SP: a second gather)
        dy = self.tp.exit_backward(dy) if self.fp8 is not None and (self.bias or self.adapters) else gemm_grad
        if self.trainable:
            if self.bias:
                ops.add_bias_grad(grads[self.bias], dy)
            route = () if self.fp8 is None else (self.fp8, (self.weight + ".x", self.weight + ".dy"))
            weight_grads([(self.weight, gemm_input, gemm_grad, *route)], grads, deferred, self.tp)
        if self.weight in self.adapters:
            dx += self.adapters[self.weight].backward(params, grads, x, dy, deferred)
        return dx

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """(shape, dtype) of what forward saves: the input, (batch, seq_len, this rank's in_features)."""
        return [((batch, seq_len, self.in_features), dtype)]
