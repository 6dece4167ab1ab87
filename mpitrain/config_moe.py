"""`model.moe` and `parallel.ep`: the settings of mixture-of-experts layers and their checks (no MPI, no arrays:
config.py imports this; the layer is mpitrain/layers/moe.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpitrain.config_rules import did_you_mean
from mpitrain.errors import ConfigError


@dataclass(frozen=True)
class MoeSettings:
    experts: int = 0  # 0: no mixture of experts
    top_k: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss: float = 0.01
    z_loss: float = 0.001
    every: int = 1  # blocks every-1, 2*every-1, ... are MoE layers

    @classmethod
    def of(cls, model_cfg) -> MoeSettings:
        """`model.moe = {experts = E, top_k = k, ...}` checked key by key (ConfigError naming the key)."""
        raw = getattr(model_cfg, "moe", None) or {}
        defaults = cls()
        values = {}
        for key, value in raw.items():
            if key not in cls.__dataclass_fields__:
                raise ConfigError(f"unknown config key model.moe.{key}; "
                                  f"{did_you_mean(key, cls.__dataclass_fields__, 'model.moe.{}')}"
                                  f"allowed: {', '.join(cls.__dataclass_fields__)}")
            kind = type(getattr(defaults, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and
                                                                                  not isinstance(value, int)):
                raise ConfigError(f"config key model.moe.{key} must be {kind.__name__}, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"config key model.moe.{key} must be a finite number >= 0, got {value}")
            values[key] = kind(value)
        settings = cls(**values)
        if settings.experts:
            if not 1 <= settings.top_k <= settings.experts:
                raise ConfigError(f"config key model.moe.top_k = {settings.top_k} must be in 1..model.moe.experts "
                                  f"= {settings.experts}")
            if settings.every < 1:
                raise ConfigError("config key model.moe.every must be >= 1 (every n-th block is an MoE layer)")
        return settings

    def is_moe_block(self, index: int) -> bool:
        return self.experts > 0 and (index + 1) % self.every == 0


def validate_moe(cfg) -> None:
    """Config checks that need no MPI (called from config.validate)."""
    moe, p = MoeSettings.of(cfg.model), cfg.parallel
    if not moe.experts:
        if p.ep != 1:
            raise ConfigError(f"parallel.ep = {p.ep} needs experts: set model.moe = {{experts = E, ...}}")
        return
    if moe.experts % p.ep:
        raise ConfigError(f"model.moe.experts = {moe.experts} is not divisible by parallel.ep = {p.ep} (each "
                          f"expert-parallel rank holds experts / ep of them)")
    if p.cp > 1:
        raise ConfigError("model.moe with parallel.cp > 1 is not supported yet; use parallel.cp = 1")
    if cfg.lora.rank:
        raise ConfigError("model.moe with lora.rank > 0 is not supported yet")
