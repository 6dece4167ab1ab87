"""LoRA (Hu et al., 2021): low-rank adapters on named linears, every base tensor frozen.

Mixture of experts (model.moe): the experts' weights (expert_w_fc / expert_w_proj, or expert_w_gate / expert_w_up /
expert_w_down) take one adapter per expert (ExpertAdapter, split over ep and tp like the experts); the router stays
frozen unless lora.targets names "router", then it trains whole (its routing bias, model.moe.balance = "bias", is never
a parameter and keeps moving).

A weight W (in, out) of a linear gets a: (in, r), random (seeded like every tensor, so every layout starts alike),
and b: (r, out), zero, and the linear computes x W + (alpha / r) (x a) b. Only a and b train. In the paper's
notation (W0 x + B A x, A: r x in, B: out x r) our a is A^T and b is B^T; the merged weight is W + (alpha / r) a b.

Tensor parallelism, derived from where the weight is split:
  column-parallel W (split by output columns; x replicated, or gathered under SP): b is split like W (its columns
      give this rank's outputs), a is whole. x a is then the same on every rank, and a's gradient
      x^T (dy_local b_local^T) is a PARTIAL sum over the tp ranks (each sees its own output columns): all-reduced
      with the unit's other partial gradients. The input gradient's extra term is partial too and rides on the
      linear's own input-gradient reduction.
  row-parallel W (split by input rows; x holds this rank's input columns): a is split like W (by its rows), b is
      whole. x_local a_local is a partial sum of x a; since (x a) b is linear in it, the term is added to the
      linear's partial output BEFORE the linear's own reduction: no extra collective in forward. b's gradient
      (x_local a_local)^T dy is a partial sum over tp: all-reduced; a's gradient and the input gradient are local.

The adapters' weight gradients follow their linear's: taken at once, or (zero-bubble schedules) handed to the W pass
as work items like any trainable weight's (the frozen base has none); x a is recomputed in backward rather than
saved, so activation memory is the base model's.
"""
from __future__ import annotations

import math
from dataclasses import replace

from mpitrain.errors import ConfigError
from mpitrain.layers import ops
from mpitrain.layers.linear import weight_grads
from mpitrain.layers.tensor_parallel import TensorParallel, split_spec
from mpitrain.state.params import ParamSpec, UnitLayout

SUFFIXES = ("_lora_a", "_lora_b")


class Adapter:
    """The adapter of one weight: `kind` "column" or "row" (the linear's split); global shape (in, out)."""

    def __init__(self, weight: str, kind: str, shape: tuple[int, int], rank: int, alpha: float, tp: TensorParallel):
        self.a, self.b = weight + SUFFIXES[0], weight + SUFFIXES[1]
        self.scale, self.tp = alpha / rank, tp
        n_in, n_out = shape
        std = 1.0 / math.sqrt(n_in)  # x a keeps x's scale
        if kind == "column":
            self.specs = [ParamSpec(self.a, (n_in, rank), "normal", std),
                          split_spec(self.b, (rank, n_out), 1, tp, "zeros")]
            self.partial_grads = [self.a]
        else:
            self.specs = [split_spec(self.a, (n_in, rank), 0, tp, "normal", std),
                          ParamSpec(self.b, (rank, n_out), "zeros")]
            self.partial_grads = [self.b]

    def add_forward(self, params, x, y) -> None:
        """y += scale (x a) b, in place (y: the linear's output, or its partial sum before the tp reduction)."""
        y += self.scale * ops.linear_forward(ops.linear_forward(x, params[self.a])[0], params[self.b])[0]

    def backward(self, params, grads, x, dy, deferred=None):
        """Adds the gradients of a and b (or appends them to `deferred`, as the linear does); returns this adapter's
        share of the input gradient."""
        u = ops.linear_forward(x, params[self.a])[0]  # recomputed, not saved
        du = self.scale * ops.linear_input_grad([params[self.b]], [dy])
        weight_grads([(self.b, self.scale * u, dy), (self.a, x, du)], grads, deferred, self.tp)
        return ops.linear_input_grad([params[self.a]], [du])


class ExpertAdapter:
    """The adapters of a batch of expert weights (E, in, out) of an MoE layer (mpitrain/layers/moe.py): a (E, in, r),
    b (E, r, out), expert e computing x W[e] + scale (x a[e]) b[e]. Split over the experts (axis 0) like the weight,
    so an expert-parallel rank holds its experts' adapters, reduced over the weight's group (expert_dp under ep).
    Experts split over tp (etp = tp) split their adapters as the dense ones above: an up weight (column-parallel)
    splits b by its columns, a whole with a tp-partial gradient; the down weight (row-parallel) splits a by its rows,
    b whole with a tp-partial gradient. Whole experts (etp = 1) keep whole adapters."""

    def __init__(self, weight, rank: int, alpha: float):
        self.a, self.b = weight.name + SUFFIXES[0], weight.name + SUFFIXES[1]
        self.scale = alpha / rank
        (experts, n_in, n_out), axis = weight.full_shape, weight.tp_axis

        def piece(name, inner, split, init, std=0.0):
            shape, offset = [weight.shape[0], *inner], [weight.start[0], 0, 0]
            if split is not None:  # this tp rank's slice, where the weight's own is
                shape[split], offset[split] = weight.shape[split], weight.start[split]
            return ParamSpec(name, tuple(shape), init, std, (experts, *inner), tuple(offset),
                             tp_replicated=split is None, tp_axis=split, reduce_over=weight.reduce_over)
        self.specs = [piece(self.a, (n_in, rank), 1 if axis == 1 else None, "normal", 1.0 / math.sqrt(n_in)),
                      piece(self.b, (rank, n_out), 2 if axis == 2 else None, "zeros")]
        self.partial_grads = {1: [self.b], 2: [self.a]}.get(axis, [])

    def add_forward(self, params, e: int, x, y) -> None:
        """y += scale (x a[e]) b[e], in place: expert e's output on its rows x."""
        y += self.scale * ops.linear_forward(ops.linear_forward(x, params[self.a][e])[0], params[self.b][e])[0]

    def backward(self, params, grads, e: int, x, dy):
        """Adds expert e's adapter gradients; returns their share of the input gradient."""
        u = ops.linear_forward(x, params[self.a][e])[0]  # recomputed, not saved
        du = self.scale * ops.linear_input_grad([params[self.b][e]], [dy])
        ops.add_weight_grad(grads[self.b][e], self.scale * u, dy)
        ops.add_weight_grad(grads[self.a][e], x, du)
        return ops.linear_input_grad([params[self.a][e]], [du])


def _experts(unit):
    """The block's MoE layer (its experts and router), or None."""
    return next((layer for layer in unit.sublayers if hasattr(layer, "expert_weights")), None)


def _linears(unit) -> list:
    """(linear, kind, {weight name: global (in, out)}) of a block's attention and MLP, and of the head."""
    found = []
    for layer in unit.sublayers:
        specs = {s.name: s.full_shape for s in layer.specs}
        for attribute in ("qkv", "out", "up", "down", "projection"):
            linear = getattr(layer, attribute, None)
            if not hasattr(linear, "adapters"):  # none, or an MoE layer's weight name
                continue
            kind = "row" if hasattr(linear, "weight") else "column"
            names = [linear.weight] if kind == "row" else linear.weights
            found.append((layer, linear, kind, {n: specs.get(n) for n in names}))
    return found


def target_names(units) -> set[str]:
    """The weight names LoRA can target in this model (the blocks' linears)."""
    names = set()
    for unit in units:
        if unit.layout.name.startswith("blocks."):
            names.update(name for _, _, _, shapes in _linears(unit) for name in shapes)
            experts = _experts(unit)
            names.update([*experts.expert_weights, "router"] if experts else [])
    return names


def apply_lora(units, rank: int, alpha: float, targets, tp: TensorParallel) -> None:
    """Freeze every tensor of `units` and put adapters on the blocks' linears named in `targets`, in place."""
    allowed = target_names(units)
    unknown = sorted(set(targets) - allowed)
    if unknown or not targets:
        raise ConfigError(f"lora.targets {list(targets)}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                          f"this model's linears are {', '.join(sorted(allowed))}")
    for unit in units:
        adapters = []
        for layer, linear, kind, shapes in _linears(unit):
            linear.trainable = False
            if not unit.layout.name.startswith("blocks."):
                continue
            for name in [n for n in shapes if n in targets]:  # the linear's order: the same layout on every rank
                if getattr(layer, "kv_columns", None) is not None and name in ("wk", "wv"):
                    raise ConfigError(f"lora.targets: {name} is replicated over tp (n_kv_head is not a multiple "
                                      f"of parallel.tp); target wq/wo or use a tp that divides n_kv_head")
                adapter = Adapter(name, kind, shapes[name], rank, alpha, tp)
                linear.adapters[name] = adapter
                adapters.append(adapter)
        experts, trained = _experts(unit), set()
        if experts is not None and unit.layout.name.startswith("blocks."):
            adapters += _adapt_experts(experts, rank, alpha, targets)
            trained = {"router"} & set(targets)  # the router trains only when named
        specs = [replace(s, trainable=s.name in trained) for s in unit.layout.specs]
        unit.layout = UnitLayout(unit.layout.name, specs + [s for a in adapters for s in a.specs])
        unit.partial_grads = [n for a in adapters for n in a.partial_grads]
        unit.frozen = True


def _adapt_experts(layer, rank: int, alpha: float, targets) -> list:
    """Freezes an MoE layer (its router too unless `targets` names it) and adapts its named expert weights."""
    specs = {spec.name: spec for spec in layer.specs}
    layer.frozen_experts, layer.router_trainable = True, "router" in targets
    for name in [n for n in layer.expert_weights if n in targets]:
        layer.adapters[name] = ExpertAdapter(specs[name], rank, alpha)
    return list(layer.adapters.values())


def with_frozen_sinks(views: dict, layout: UnitLayout, xp, dtype) -> dict:
    """Gradient views plus stand-ins for the frozen tensors, whose sublayers still write gradients: a scratch array
    for vectors (norm gains, a few hundred numbers) and a read-only zero view for matrices (frozen linears never
    touch theirs; the head only takes its transpose). Both are thrown away."""
    frozen = [s for s in layout.specs if not s.trainable]
    if not frozen:
        return views
    out = dict(views)
    for spec in frozen:
        if len(spec.shape) >= 2:
            out[spec.name] = xp.broadcast_to(xp.zeros((), dtype=dtype), spec.shape)
        else:
            out[spec.name] = xp.zeros(spec.shape, dtype=dtype)
    return out


def merge(tensors: dict, rank: int, alpha: float) -> dict:
    """Full (global) tensors of a checkpoint by name -> the same with every adapter merged into its base weight
    (W + (alpha / r) a b) and the adapters dropped."""
    merged = {name: t for name, t in tensors.items() if not name.endswith(SUFFIXES)}
    for name, a in tensors.items():
        if name.endswith(SUFFIXES[0]):
            base = name[: -len(SUFFIXES[0])]
            merged[base] = tensors[base] + (alpha / rank) * (a @ tensors[base + SUFFIXES[1]])
    return merged
