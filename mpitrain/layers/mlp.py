"""The dense MLP as a sublayer: up (and gate) column-parallel, the activation, down row-parallel.

  gpt2   w_fc (+ b_fc), GELU (tanh), w_proj (+ b_proj)
  llama  w_gate and w_up sharing their input, SwiGLU, w_down (no biases)
"""
from __future__ import annotations

import math

from mpitrain.config import ModelConfig
from mpitrain.layers import ops
from mpitrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec
from mpitrain.state.params import ParamSpec


class MLP:
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        c, f = cfg.d_model, cfg.ff_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.gated, self.local_width = cfg.arch == "llama", f // tp.size
        ups = ["w_gate", "w_up"] if self.gated else ["w_fc"]
        down = "w_down" if self.gated else "w_proj"
        self.specs = [split_spec(name, (c, f), 1, tp, "normal", std) for name in ups]
        self.specs.append(split_spec(down, (f, c), 0, tp, "normal", out_std))
        if not self.gated:
            self.specs += [split_spec("b_fc", (f,), 0, tp, "zeros"), ParamSpec("b_proj", (c,), "zeros")]
        self.up = ColumnParallelLinear(tp, c, ups)  # gpt2's b_fc joins GELU (ops.gelu_forward)
        self.down = RowParallelLinear(tp, self.local_width, down, None if self.gated else "b_proj")
        self.partial_grads: list[str] = []

    def forward(self, params, x, ctx=None):
        ups, h = self.up.forward(params, x)
        act, act_saved = ops.swiglu_forward(*ups) if self.gated else ops.gelu_forward(ups[0], params["b_fc"])
        y, act = self.down.forward(params, act)
        return y, {"up": h, "activation": act_saved, "down": act}

    def backward(self, params, grads, saved, dy, deferred=None):
        d_act = self.down.backward(params, grads, saved["down"], dy, deferred)
        if self.gated:
            d_ups = list(ops.swiglu_backward(saved["activation"], d_act))
        else:  # the down projection keeps GELU's output: backward takes its sigmoid from it, no exp
            db = grads["b_fc"] if self.up.trainable else None
            d_ups = [ops.gelu_backward_from_output(saved["activation"], saved["down"], d_act, db)]
        return self.up.backward(params, grads, saved["up"], d_ups, deferred)

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """The entered input, the activation's input(s) and its output."""
        hidden = ((batch, seq_len, self.local_width), dtype)
        return self.up.saved_arrays(batch, seq_len, dtype) + [hidden] * (2 if self.gated else 1) + [hidden]
