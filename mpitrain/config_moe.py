"""`model.moe` and `parallel.ep`: the settings of mixture-of-experts layers and their checks (no MPI, no arrays:
config.py imports this; the layer is mpitrain/layers/moe.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpitrain.config_rules import did_you_mean
from mpitrain.errors import ConfigError

BALANCE_MODES = ("aux_loss", "bias")
DISPATCH_DTYPES = ("same", "fp8")  # model.moe.dispatch_dtype (layers/expert_parallel.py)
CHOICES = {"balance": BALANCE_MODES, "dispatch_dtype": DISPATCH_DTYPES}  # the allowed values of the str keys


@dataclass(frozen=True)
class MoeSettings:
    experts: int = 0  # 0: no mixture of experts
    top_k: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss: float = 0.01
    z_loss: float = 0.001
    every: int = 1  # blocks every-1, 2*every-1, ... are MoE layers
    balance: str = "aux_loss"  # aux_loss: the batch-level balance loss (aux_loss); bias: DeepSeek-V3's routing bias
    bias_rate: float = 0.001  # balance = "bias": how far each step moves an expert's routing bias
    seq_aux_loss: float = 0.0  # DeepSeek-V3's sequence-level balance loss coefficient (either balance)
    # the combine stays in the compute dtype; fp8 halves bf16's dispatch bytes, plus the scales (expert_parallel.py)
    dispatch_dtype: str = "same"  # the forward dispatch on the wire: same | fp8 (e4m3, an fp32 scale per 1x128 tile)

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
            if kind is str:
                if value not in CHOICES[key]:
                    raise ConfigError(f"config key model.moe.{key} must be one of {', '.join(CHOICES[key])}, got "
                                      f"{value!r}")
                values[key] = value
                continue
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
            if settings.balance == "bias" and raw.get("aux_loss", 0):
                raise ConfigError("config key model.moe.aux_loss weighs the batch-level balance loss of balance = "
                                  "'aux_loss'; with model.moe.balance = 'bias' leave it out (seq_aux_loss is the "
                                  "loss that goes with the bias)")
        return settings

    @property
    def batch_aux_loss(self) -> float:
        """The batch-level balance loss's coefficient: none under bias balancing."""
        return self.aux_loss if self.balance == "aux_loss" else 0.0

    def is_moe_block(self, index: int) -> bool:
        return self.experts > 0 and (index + 1) % self.every == 0


def validate_moe(cfg) -> None:
    """Config checks that need no MPI (called from config_checks.validate)."""
    moe, p = MoeSettings.of(cfg.model), cfg.parallel
    if not moe.experts:
        if p.ep != 1 or p.etp not in (0, p.tp):
            key = f"parallel.ep = {p.ep}" if p.ep != 1 else f"parallel.etp = {p.etp}"
            raise ConfigError(f"{key} needs experts: set model.moe = {{experts = E, ...}}")
        return
    validate_expert_mesh(cfg, moe)
    if moe.experts % p.ep:
        raise ConfigError(f"model.moe.experts = {moe.experts} is not divisible by parallel.ep = {p.ep} (each "
                          f"expert-parallel rank holds experts / ep of them)")


def validate_expert_mesh(cfg, moe: MoeSettings) -> None:
    """The experts' mesh etp x ep x edp (mpitrain/comm/mesh.py): what it needs that the rank count does not say."""
    p = cfg.parallel
    if p.etp not in (0, 1, p.tp):
        raise ConfigError(f"parallel.etp = {p.etp} must be 1 (whole experts, the tp ranks route their own share of "
                          f"the tokens) or parallel.tp = {p.tp} (experts split like the MLP); 0 means parallel.tp")
    if p.cp > 1 and moe.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor = {moe.capacity_factor} with parallel.cp = {p.cp}: capacity "
                          f"serves an expert's picks first come first served in the order of the whole sequence's "
                          f"tokens, which context parallelism splits over the cp ranks, so no cp rank can tell which "
                          f"of its picks fit; use capacity_factor = 0 (dropless) or parallel.cp = 1")
