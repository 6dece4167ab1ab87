"""Planted bugs, so that a test can show `mpitrain doctor parity` finding one where it is.

MPITRAIN_DOCTOR_PLANT, read here only and only by the doctor's capture run (never by `mpitrain train`):

    skip_tp_reduce:layer=L   block L's attention output projection (a row-parallel linear) keeps its partial sum:
                             the forward all-reduce over tp is skipped, as a forgotten reduction would be
    fp8_unscaled:layer=L     block L's MLP down projection rounds its output to float8 e4m3 and back with no scale,
                             as a recipe that dropped its scale would (`mpitrain doctor precision` finds it)

Each bug is made by wrapping one object of that block (the linear's tensor-parallel object, whose `exit` then does
nothing; the linear itself, whose output is then rounded); the rest of the model and every module stay as they are.
"""
from __future__ import annotations

import os

import numpy as np

from mpitrain.errors import ConfigError
from mpitrain.layers.fp8 import cast_saturating
from mpitrain.layers.mlp import MLP

PLANT_ENV = "MPITRAIN_DOCTOR_PLANT"
PLANTS = ("skip_tp_reduce", "fp8_unscaled")


class SkippedReduce:
    """A TensorParallel (layers/tensor_parallel.py) whose forward exit from the tp region returns the partial sum;
    everything else is the original's."""

    def __init__(self, tp):
        self._tp = tp

    def __getattr__(self, name):
        return getattr(self._tp, name)

    def exit(self, y):
        return y

    def exit_of(self, partial, seq_len: int):  # the row-parallel linears' forward exit (their matmul handed in)
        return partial(None)


class UnscaledFloat8:
    """A linear whose forward output is rounded to float8 e4m3 with no scale (small values fall into its subnormals
    or to zero); everything else is the original linear's."""

    def __init__(self, linear):
        self._linear = linear

    def __getattr__(self, name):
        return getattr(self._linear, name)

    def forward(self, params, x):
        y, saved = self._linear.forward(params, x)
        return cast_saturating(y.astype(np.float32), "e4m3").astype(y.dtype), saved


def parse_plant(text: str) -> tuple[str, int] | None:
    """'skip_tp_reduce:layer=1' -> ('skip_tp_reduce', 1); '' -> None; anything else is one clear line."""
    if not text:
        return None
    kind, _, rest = text.partition(":")
    key, _, value = rest.partition("=")
    if kind not in PLANTS or key != "layer" or not value.isdigit():
        raise ConfigError(f"{PLANT_ENV}={text!r}: expected one of {', '.join(PLANTS)} as KIND:layer=L "
                          "(e.g. skip_tp_reduce:layer=1)")
    return kind, int(value)


def plant_from_environment(model, sequence_parallel: bool) -> str | None:
    """Plant the bug MPITRAIN_DOCTOR_PLANT names into `model` (a GPT) where this rank holds that layer; returns
    what was planted, or None."""
    plant = parse_plant(os.environ.get(PLANT_ENV, ""))
    if plant is None:
        return None
    kind, layer = plant
    if sequence_parallel and kind == "skip_tp_reduce":
        raise ConfigError(f"{PLANT_ENV}: {kind} is for tensor parallelism without parallel.sequence_parallel")
    if not 0 <= layer < model.cfg.n_layer:
        raise ConfigError(f"{PLANT_ENV}: layer={layer} is not a block of this model (model.n_layer = "
                          f"{model.cfg.n_layer})")
    for unit in model.units:
        if unit.layout.name == f"blocks.{layer}":
            if kind == "skip_tp_reduce":
                unit.attention.out.tp = SkippedReduce(unit.attention.out.tp)
                return f"{kind} in blocks.{layer}"
            if not isinstance(unit.mlp, MLP):
                raise ConfigError(f"{PLANT_ENV}: {kind} needs a dense MLP in block {layer} (it is an MoE layer)")
            unit.mlp.down = UnscaledFloat8(unit.mlp.down)
            return f"{kind} in blocks.{layer}.mlp.down"
    return None
