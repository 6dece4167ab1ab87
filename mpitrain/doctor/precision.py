"""`mpitrain doctor precision CONFIG [--steps N]`: an error budget for low-precision training, layer by layer
(docs/doctor.md, `mpitrain doctor precision`).

One process trains the configured precision (bfloat16, float16, and the FP8 recipes of `precision.fp8` where that
key exists) for a few steps; before each step the doctor walks the model's sublayers on micro-batch 0 itself and
replays each one in float64 on the SAME inputs: the low-precision run's input of that layer, its master weights
(fp32, cast up) and, in backward, the low-precision run's output gradient of that layer. A layer's error is
therefore its own, never the sum of everything upstream, so a layer that exceeds its bound is the one to look at
(a shadow that trained on its own would drift away from the run step by step and blur that picture).

Rows: the embedding; per block its norms, the attention and MLP sublayers (input gradient and output) and their
linears (output and weight gradient); the head's norm, its projection, the head as a whole. Each error is
||low - exact|| / ||exact|| (the largest over the steps and, for weight gradients, over the layer's tensors),
beside the bound `ROUNDINGS[kind] * unit roundoff` of the recipe; a row over its bound is marked.

No layer is patched: the doctor calls the sublayers' own forward/backward (the objects of `model/units.py`) in the
order `Block.forward_all` and `Block.backward` do, on two models built from the same config, one of them float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from mpitrain.backend import array_module
from mpitrain.config import Config, PrecisionConfig, load_config
from mpitrain.config_moe import MoeSettings
from mpitrain.doctor.parity import REFERENCE
from mpitrain.doctor.plant import plant_from_environment
from mpitrain.errors import ConfigError
from mpitrain.layers.linear import ColumnParallelLinear
from mpitrain.layers.mlp import MLP
from mpitrain.model.units import Block, Embedding, Head
from mpitrain.train import Trainer

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # round to nearest: half an ulp at 1
FP8_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
# How far each FP8 recipe's rounding may sit from the format's own roundoff, in relative norm: one scale per tensor
# from this call's amax (tensor) or one per 1x128 tile (block) maps the amax to the format's max, so no value clips;
# a delayed scale from past steps' amax clips a new outlier (x2, a heuristic: an outlier far past the history is
# unbounded); mxfp8's power-of-two scale puts a block's amax in [256, 512) and clips what lies past 448 (up to 1/8).
RECIPE_FACTOR = {"tensor": 1.0, "delayed": 2.0, "block": 1.0, "mxfp8": 2.0}
# Roundings on each kind's path, (output, input gradient, weight gradient): each rounding of a tensor moves it by at
# most the unit roundoff u in relative norm, and to first order the errors add, so k roundings give k * u (derived
# for each kind in docs/doctor.md). Inputs come exact from the low-precision run, so they are not counted.
ROUNDINGS = {
    "embedding": (3, 0, 2),   # out: the table rows, the positions, their sum; dW: the scattered rows, their sum
    "norm": (4, 6, 4),        # out: weight, bias, normalised input, output; dx adds the residual sum and dy's path
    "attention": (8, 12, 0),  # qkv (2), rope, probabilities, core output, out linear (2), sum; backward mirrors it
    "mlp": (6, 8, 4),         # up (2), activation, down (2), sum; backward: down, activation, up, sum; b_fc: 4
    "moe": (8, 10, 10),       # the MLP's, plus the gate product and the combine sum
    "head": (4, 6, 4),        # the loss: norm, logits (probabilities in fp32); dx: probabilities, dlogits, norm
    # a linear's output: its weight, its output. Its weight gradient x^T dy is computed from the low run's input of
    # the SUBLAYER: the sublayer's roundings before x (forward) and before dy (backward) count, plus the product's
    "linear qkv": (2, 0, 8),   # dy: the out linear's dx, the core's backward (3), rope; plus the product
    "linear out": (2, 0, 7),   # x: the core's output (qkv 2, rope, probabilities, output); plus the product, bias
    "linear up": (2, 0, 5),    # dy: the down linear's dx, the activation's backward; plus the product, bias
    "linear down": (2, 0, 5),  # x: up (2), the activation; plus the product, bias
    "linear projection": (2, 0, 4),  # dy: the probabilities, dlogits; plus the product, the tied sum
}
QUANTITIES = ("output", "input gradient", "weight gradient")


@dataclass
class Row:
    """One layer's worst relative error per quantity, over the steps, and the bound of each."""
    layer: str
    kind: str
    bounds: tuple[float, float, float]
    errors: dict = field(default_factory=dict)  # quantity -> (error, what: the worst tensor for weight gradients)

    def add(self, quantity: str, error: float, what: str = "") -> None:
        if quantity not in self.errors or not error <= self.errors[quantity][0]:  # NaN stays
            self.errors[quantity] = (error, what)

    def over(self) -> list[str]:
        """The quantities over their bound (NaN and inf included)."""
        return [q for q, (error, _) in self.errors.items() if not error <= self.bounds[QUANTITIES.index(q)]]


def relative_error(low, exact) -> float:
    exact = np.asarray(exact, dtype=np.float64)
    difference = np.asarray(low, dtype=np.float64) - exact
    scale = float(np.linalg.norm(exact))
    return float(np.linalg.norm(difference)) / scale if scale else float(np.linalg.norm(difference))


def fp8_recipe(cfg: Config) -> str:
    """precision.fp8 where the key exists ("none" otherwise or when off)."""
    recipe = getattr(cfg.precision, "fp8", "none")
    return recipe if recipe in RECIPE_FACTOR else "none"


# Under an FP8 recipe, a linear's weight gradient also carries the fp8 roundings of the sublayer's other linear on
# its path: the one whose input gradient is its dy (qkv after out, up after down: e5m2 dy, e4m3 weight) or whose
# output is its x (out after qkv, down after up: e4m3 input and weight)
FP8_UPSTREAM = {"linear qkv": ("e4m3", "e5m2"), "linear up": ("e4m3", "e5m2"),
                "linear out": ("e4m3", "e4m3"), "linear down": ("e4m3", "e4m3")}


def bounds_for(kind: str, compute: str, recipe: str, in_block: bool,
               fp8_dispatch: bool = False) -> tuple[float, float, float]:
    """ROUNDINGS[kind] times the compute dtype's roundoff, plus the FP8 roundings of a block's linears under a
    recipe (times its factor): a linear's output its e4m3 input and weight, a sublayer's both linears', input
    gradients e5m2 dy and e4m3 weight per linear, weight gradients e4m3 x and e5m2 dy plus FP8_UPSTREAM's. An MoE
    layer whose dispatch sends e4m3 (model.moe.dispatch_dtype): its experts read rows rounded to e4m3, and a gated or
    GELU expert is about quadratic in them near zero, so twice e4m3's roundoff on each quantity."""
    u, e4m3, e5m2 = UNIT_ROUNDOFF[compute], FP8_ROUNDOFF["e4m3"], FP8_ROUNDOFF["e5m2"]
    bounds = [k * u for k in ROUNDINGS[kind]]
    if kind == "moe" and fp8_dispatch:
        bounds = [bound + 2 * e4m3 for bound in bounds]
    if recipe == "none" or not in_block or kind == "norm":
        return tuple(bounds)
    factor = RECIPE_FACTOR[recipe]
    if kind.startswith("linear"):
        upstream = sum(FP8_ROUNDOFF[fmt] for fmt in FP8_UPSTREAM.get(kind, ()))
        fp8 = (2 * e4m3, 0.0, e4m3 + e5m2 + upstream)
    else:  # attention, mlp, moe: two linears each
        fp8 = (4 * e4m3, 2 * (e4m3 + e5m2), 2 * (e4m3 + e5m2))
    return tuple(bound + factor * extra for bound, extra in zip(bounds, fp8))


class Budget:
    """The rows in forward order, made on first use."""

    def __init__(self, compute: str, recipe: str, fp8_dispatch: bool = False):
        self.compute, self.recipe, self.fp8_dispatch, self.rows = compute, recipe, fp8_dispatch, {}

    def row(self, layer: str, kind: str) -> Row:
        if layer not in self.rows:
            bounds = bounds_for(kind, self.compute, self.recipe, layer.startswith("blocks."), self.fp8_dispatch)
            self.rows[layer] = Row(layer, kind, bounds)
        return self.rows[layer]

    def compare(self, layer: str, kind: str, quantity: str, low, exact) -> None:
        self.row(layer, kind).add(quantity, relative_error(low, exact))

    def compare_grads(self, layer: str, kind: str, low: dict, exact: dict, names) -> None:
        for name in names:
            if name in low and np.size(low[name]):
                self.row(layer, kind).add("weight gradient", relative_error(low[name], exact[name]), name)


# ---- one micro-batch, layer by layer -----------------------------------------------------------------------------
def unit_params(model, unit: int, views_of) -> dict:
    """A unit's parameter (or gradient) views and the tensors it borrows (gpt2's head reads embed.wte)."""
    own = dict(views_of(unit))
    for local, (owner, tensor) in model.borrowed[unit].items():
        own[local] = views_of(owner)[tensor]
    return own


SIDES = ("low", "exact")


class Pair:
    """The low-precision model and its float64 shadow, side by side, for one micro-batch."""

    def __init__(self, low, exact, budget: Budget, tokens, targets):
        self.trainers, self.budget = {"low": low, "exact": exact}, budget
        self.units = low.model.units
        t = tokens.shape[1]
        self.ctx = {side: {**trainer.model.context(t), "targets": targets} for side, trainer in self.trainers.items()}
        self.params = {side: self._views(trainer) for side, trainer in self.trainers.items()}
        self.grads = {side: [{name: trainer.backend.xp.zeros_like(v) for name, v in p.items()} for p in views]
                      for (side, trainer), views in zip(self.trainers.items(), self.params.values())}

    @staticmethod
    def _views(trainer) -> list[dict]:
        model, state = trainer.model, trainer.state
        return [unit_params(model, i, lambda j: state.acquire(j, "forward")) for i in range(len(model.units))]

    def split(self, x) -> dict:
        """The low side's array for the low side, the same values in float64 for the shadow."""
        exact = self.trainers["exact"].backend
        return {"low": x, "exact": exact.xp.asarray(self.trainers["low"].backend.to_host(x), dtype=np.float64)}

    def both(self, i: int, run, **arguments) -> tuple:
        """run(unit, params, grads, ctx, **arguments) on both sides (each side's own model's unit i); an argument
        given as {"low": ., "exact": .} is the side's own."""
        results = []
        for side in SIDES:
            own = {key: value[side] if isinstance(value, dict) and set(value) == set(SIDES) else value
                   for key, value in arguments.items()}
            unit = self.trainers[side].model.units[i]
            results.append(run(unit, self.params[side][i], self.grads[side][i], self.ctx[side], **own))
        return tuple(results)

    def forward(self, tokens) -> list:
        """Every unit on the low side's input; per unit what both sides saved."""
        x, saved = tokens, []
        for i, unit in enumerate(self.units):
            if isinstance(unit, Embedding):
                (x, s_low), (y_exact, s_exact) = self.both(i, _unit_forward, x=tokens)
                self.budget.compare("embed", "embedding", "output", x, y_exact)
                saved.append({"low": s_low, "exact": s_exact})
            elif isinstance(unit, Block):
                x, block_saved = self.block_forward(i, x)
                saved.append(block_saved)
            elif isinstance(unit, Head):
                x, head_saved = self.head_forward(i, x)
                saved.append(head_saved)
        return saved

    def block_forward(self, i: int, x) -> tuple:
        """Block.forward_all's order: norm1, attention, the residual add, norm2, MLP, the residual add."""
        name, saved, residual = self.units[i].layout.name, {}, x
        for sub in ("norm1", "attention", "norm2", "mlp"):
            (y, s_low), (y_exact, s_exact) = self.both(i, _sublayer_forward, sub=sub, x=self.split(x))
            self.budget.compare(f"{name}.{sub}", sublayer_kind(self.units[i], sub), "output", y, y_exact)
            saved[sub] = {"low": s_low, "exact": s_exact}
            for label, _, linear_x in _linears(self.units[i], sub, s_low):
                (z, _), (z_exact, _) = self.both(i, _linear_forward, sub=sub, label=label, x=self.split(linear_x))
                self.budget.compare(f"{name}.{sub}.{label}", f"linear {label}", "output", z, z_exact)
            if sub.startswith("norm"):
                x = y
            else:
                residual = x = residual + y
        return residual, saved

    def head_forward(self, i: int, x) -> tuple:
        inputs = self.split(x)
        (loss, s_low), (loss_exact, s_exact) = self.both(i, _unit_forward, x=inputs)
        self.budget.compare("head", "head", "output", loss, loss_exact)
        (h, _), (h_exact, _) = self.both(i, _head_norm_forward, x=inputs)
        self.budget.compare("head.norm", "norm", "output", h, h_exact)
        (logits, _), (logits_exact, _) = self.both(i, _linear_forward, sub="head", label="projection",
                                                   x=self.split(s_low["h"]))
        self.budget.compare("head.projection", "linear projection", "output", logits, logits_exact)
        return loss, {"low": s_low, "exact": s_exact}

    def backward(self, saved: list, dloss: float) -> None:
        """Every unit's backward from the head down, each side from the low side's output gradient."""
        dy = dloss
        for i in reversed(range(len(self.units))):
            unit = self.units[i]
            if isinstance(unit, Head):
                dy = self.head_backward(i, saved[i], dy)
            elif isinstance(unit, Block):
                dy = self.block_backward(i, saved[i], dy)
            else:
                self.both(i, _unit_backward, saved=saved[i], dy=self.split(dy))
                self.budget.compare_grads("embed", "embedding", *self.grads_of(i), ("wte", "wpe"))

    def grads_of(self, i: int) -> tuple[dict, dict]:
        return self.grads["low"][i], self.grads["exact"][i]

    def head_backward(self, i: int, saved: dict, dloss):
        dx, dx_exact = self.both(i, _unit_backward, saved=saved, dy=dloss)
        self.budget.compare("head", "head", "input gradient", dx, dx_exact)
        low, exact = self.grads_of(i)
        self.budget.compare_grads("head.norm", "norm", low, exact, [s.name for s in self.units[i].head.norm.specs])
        self.budget.compare_grads("head.projection", "linear projection", low, exact, ("wte", "w_lm"))
        return dx

    def block_backward(self, i: int, saved: dict, dy):
        """Block.backward's order: mlp, norm2 (plus the block's dy, the residual), attention, norm1 (plus norm2's
        input gradient)."""
        name, unit, residual = self.units[i].layout.name, self.units[i], dy
        low, exact = self.grads_of(i)
        for sub in ("mlp", "norm2", "attention", "norm1"):
            kind = sublayer_kind(unit, sub)
            extra = self.split(residual) if sub.startswith("norm") else None
            dx, dx_exact = self.both(i, _sublayer_backward, sub=sub, saved=saved[sub], dy=self.split(dy),
                                     residual=extra)
            self.budget.compare(f"{name}.{sub}", kind, "input gradient", dx, dx_exact)
            in_linears = set()
            for label, linear, _ in _linears(unit, sub, saved[sub]["low"]):
                in_linears.update(_linear_tensors(linear))
                self.budget.compare_grads(f"{name}.{sub}.{label}", f"linear {label}", low, exact,
                                          _linear_tensors(linear))
            own = [s.name for s in getattr(unit, sub).specs if s.name not in in_linears]
            self.budget.compare_grads(f"{name}.{sub}", kind, low, exact, own)
            dy = dx
            if sub.startswith("norm"):
                residual = dx
        return dy


def sublayer_kind(unit, sub: str) -> str:
    if sub.startswith("norm"):
        return "norm"
    if sub == "mlp" and not isinstance(unit.mlp, MLP):
        return "moe"
    return sub


def _unit_forward(unit, params, grads, ctx, x):
    return unit.forward(params, x, ctx)


def _unit_backward(unit, params, grads, ctx, saved, dy):
    return unit.backward(params, grads, saved, dy)


def _head_norm_forward(unit, params, grads, ctx, x):
    return unit.head.norm.forward(params, x)


def _sublayer_forward(unit, params, grads, ctx, sub, x):
    layer = getattr(unit, sub)
    return layer.forward(params, x) if sub.startswith("norm") else layer.forward(params, x, ctx)


def _sublayer_backward(unit, params, grads, ctx, sub, saved, dy, residual):
    layer = getattr(unit, sub)
    if sub.startswith("norm"):
        return layer.backward(params, grads, saved, dy, residual=residual)
    return layer.backward(params, grads, saved, dy)


def _linears(unit, sub: str, saved) -> list:
    """(label, linear, its input in the sublayer's saved state) of the dense sublayers' linears."""
    layer = getattr(unit, sub)
    if sub == "attention":
        return [("qkv", layer.qkv, saved["qkv"]), ("out", layer.out, saved["out"])]
    if sub == "mlp" and isinstance(layer, MLP):
        return [("up", layer.up, saved["up"]), ("down", layer.down, saved["down"])]
    return []


def _linear_tensors(linear) -> list[str]:
    if isinstance(linear, ColumnParallelLinear):
        return [*linear.weights, *(b for b in linear.biases if b)]
    return [linear.weight, *([linear.bias] if linear.bias else [])]


def _linear_forward(unit, params, grads, ctx, sub: str, label: str, x):
    """(the linear's outputs joined along the last axis, saved) on this side's unit."""
    if sub == "head":
        outputs, saved = unit.head.projection.forward(unit.head.local(params), x)
    else:
        layer = getattr(unit, sub)
        views = layer.local(params) if hasattr(layer, "local") else params
        outputs, saved = getattr(layer, label).forward(views, x)
    if isinstance(outputs, list):
        xp = array_module(outputs[0])
        outputs = xp.concatenate([xp.asarray(o, dtype=np.float64) for o in outputs], axis=-1)
    return outputs, saved


# ---- the command ----------------------------------------------------------------------------------------------------
def shadow_config(cfg: Config) -> Config:
    """The same run in float64, FP8 off: precision.fp8's default (where the key exists), and an MoE dispatch in the
    compute dtype."""
    off = {f.name: f.default for f in fields(PrecisionConfig) if f.name == "fp8"}
    model = cfg.model
    if getattr(model, "moe", None):
        model = replace(model, moe={**model.moe, "dispatch_dtype": "same"})
    return replace(cfg, model=model, precision=replace(cfg.precision, compute="float64", **off))


def load_doctor_config(config: str, overrides: list[str]) -> Config:
    """The config as one process runs it (every parallel degree 1, no recomputation or offload, one replica)."""
    cfg = load_config(config, list(overrides) + REFERENCE + ["train.thread_replicas=1"])
    if cfg.precision.compute not in UNIT_ROUNDOFF:
        raise ConfigError(f"doctor precision: precision.compute = {cfg.precision.compute!r} has no low-precision "
                          f"error to budget; use one of {', '.join(UNIT_ROUNDOFF)}")
    return cfg


def copy_master_weights(low: Trainer, exact: Trainer) -> None:
    """The shadow's parameters := the low-precision run's master weights (fp32), cast up: the exact weights the run
    holds, so that rounding them to the compute dtype counts as one of its errors."""
    master = low.state.master
    for i in range(len(exact.model.units)):
        for name, view in exact.state.acquire(i, "forward").items():
            if name in master.views[i]:
                view[...] = exact.backend.xp.asarray(low.backend.to_host(master.views[i][name]), dtype=np.float64)


def measure(cfg: Config, world_comm, steps: int) -> tuple[Budget, str | None]:
    """`steps` training steps of cfg; before each, every layer of micro-batch 0 against its float64 replay."""
    low, exact = Trainer(cfg, world_comm), Trainer(shadow_config(cfg), world_comm)
    planted = plant_from_environment(low.model, False)  # the low side only: the shadow is the truth
    budget = Budget(cfg.precision.compute, fp8_recipe(cfg), MoeSettings.of(cfg.model).dispatch_dtype == "fp8")
    rows = range(cfg.train.micro_batch)
    for step in range(steps):
        copy_master_weights(low, exact)
        tokens, targets = low.train_data.global_batch_rows(step, rows)
        xp = low.backend.xp
        pair = Pair(low, exact, budget, xp.asarray(tokens), xp.asarray(targets))
        saved = pair.forward(xp.asarray(tokens))
        pair.backward(saved, low.loss_scale.scale / (cfg.train.global_batch * cfg.model.seq_len))
        low.train_step(step)
    return budget, planted


def report(budget: Budget, steps: int, planted: str | None) -> tuple[str, int]:
    """The table and the verdict; the number of layers over their bound."""
    recipe = budget.compute + ("" if budget.recipe == "none" else f" + fp8 {budget.recipe}")
    recipe += " + fp8 MoE dispatch" if budget.fp8_dispatch else ""
    lines = [(f"relative error against a float64 replay of each layer on the same inputs ({recipe}, worst of "
              f"{steps} step(s)); bound in brackets; ! marks an error over its bound")]
    if planted:
        lines.append(f"planted defect: {planted}")
    lines.append(f"{'layer':<28} {'output':>20} {'input gradient':>20} {'weight gradient':>30}")
    over = []
    for row in budget.rows.values():
        cells = []
        for quantity, width in zip(QUANTITIES, (20, 20, 30)):
            if quantity not in row.errors:
                cells.append(f"{'-':>{width}}")
                continue
            error, what = row.errors[quantity]
            mark = "!" if quantity in row.over() else " "
            text = f"{error:.1e} [{row.bounds[QUANTITIES.index(quantity)]:.0e}]{mark}"
            cells.append(f"{(what + ' ' if what else '') + text:>{width}}")
        lines.append(f"{row.layer:<28} " + " ".join(cells))
        if row.over():
            over.append(f"{row.layer} ({', '.join(row.over())})")
    lines.append(f"over the bound: {', '.join(over)}" if over else "every layer within its bound")
    return "\n".join(lines), len(over)


def run_precision(config: str, overrides: list[str], steps: int, world_comm, echo) -> int:
    """Measure, print; exit status 0 when every layer is within its bound, 1 otherwise."""
    if steps < 1:
        raise ConfigError(f"doctor precision: --steps must be >= 1, got {steps}")
    cfg = load_doctor_config(config, overrides)
    budget, planted = measure(cfg, world_comm, steps)
    text, over = report(budget, steps, planted)
    echo(text)
    return 1 if over else 0
