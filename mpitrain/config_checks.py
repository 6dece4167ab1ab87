"""What a resolved config must satisfy before anything starts (no MPI, no arrays): the allowed values, the range
checks by key, the schedules' and data mix's own checks, and the layout checks of layout_checks.py. Each takes the
run's Config; this module does not import config.py, which imports it (and re-exports `validate`)."""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from mpitrain.config_moe import MoeSettings, validate_moe
from mpitrain.config_rules import (
    DECAY_SHAPES,
    LR_SCHEDULES,
    OPTIMIZERS,
    SCHEDULE_KINDS,
    positive_degree,
    require,
    toml_key,
)
from mpitrain.errors import ConfigError
from mpitrain.layout_checks import (
    validate_context_parallel,
    validate_hierarchical_dp,
    validate_pipeline,
    validate_tensor_parallel,
    validate_thread_replicas,
)

ALLOWED = {
    "model.arch": ("gpt2", "llama"),
    "train.device": ("cpu", "cuda"),
    "train.collectives": ("mpi", "nccl"),
    "precision.compute": ("float32", "float64", "bfloat16", "float16"),
    "precision.master": ("float32",),
    "precision.grad_reduce": ("float32", "bfloat16"),
    "precision.fp8": ("none", "tensor", "delayed", "block", "mxfp8"),  # mpitrain/layers/fp8.py RECIPES
    "parallel.zero": (0, 1, 2, 3),
    "parallel.zero_shard": ("world", "node"),
    "parallel.dp_reduce": ("flat", "two_level"),
    "parallel.zero_gather_dtype": ("same", "int8", "fp8"),
    "parallel.zero_grad_reduce": ("exact", "int8", "int4"),
    "memory.offload": ("none", "host", "disk"),
    "memory.recompute": ("none", "selective", "full"),
    "parallel.cp_kind": ("ring", "ulysses", "hybrid"),
    "parallel.schedule": SCHEDULE_KINDS,
    "optim.schedule": LR_SCHEDULES,
    "optim.decay_shape": DECAY_SHAPES,
}
DEGREES = ("parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.cp", "parallel.ep")  # dp = 0: auto


def mix_entries(key: str, value: Any) -> list[str]:
    """data.mix as 'path:weight' strings, from a list of such strings or of {path, weight} tables; weights > 0."""
    form = "a list of 'path:weight' strings or {path = ..., weight = ...} tables"
    if not isinstance(value, list):
        raise ConfigError(f"config key {key} must be {form}, got {value!r}")
    entries = []
    for index, entry in enumerate(value):
        where = f"config key {key}[{index}] = {entry!r}"
        if isinstance(entry, dict) and set(entry) == {"path", "weight"}:
            path, weight = entry["path"], entry["weight"]
        elif isinstance(entry, str) and ":" in entry:
            path, _, weight = entry.rpartition(":")
            try:
                weight = float(weight)
            except ValueError:
                raise ConfigError(f"{where}: the weight after the last ':' is not a number") from None
        else:
            raise ConfigError(f"{where}: expected 'path:weight' or {{path = ..., weight = ...}}")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{where}: the path must be a non-empty string")
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
        if not (ok and weight > 0):
            raise ConfigError(f"{where}: the weight must be a finite number > 0")
        entries.append(f"{path}:{float(weight)!r}")
    return entries


def validate(cfg) -> None:
    """Checks that need no MPI: run on every rank before any collective, so a bad config never hangs a job.

    Range checks are written `require(value > 0)`, i.e. "refuse unless provably in range", so that NaN (for which
    every comparison is False) is refused by them too; infinities are refused first, for every float key."""
    _require_finite_floats(cfg)
    for key, allowed in ALLOWED.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value in allowed,
                f"config key {key} = {value!r} is not allowed; allowed: {', '.join(map(repr, allowed))}")
    for key in DEGREES:
        positive_degree(f"config key {key}", getattr(cfg.parallel, key.split(".")[1]))
    positive = ["model.n_layer", "model.d_model", "model.n_head", "model.vocab_size", "model.seq_len",
                "train.steps", "train.global_batch", "train.micro_batch", "train.log_every", "train.eval_batches",
                "optim.beta1", "optim.beta2", "optim.eps", "parallel.bucket_mb", "model.rope_theta", "model.norm_eps",
                "precision.loss_scale_window", "fault.straggler_steps", "fault.spike_window", "fault.max_bad_steps",
                "memory.offload_chunk_mb", "precision.fp8_history"]
    for key in positive:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value > 0, f"config key {key} must be > 0, got {value}")
    nonneg = ["model.n_kv_head", "model.d_ff", "parallel.dp", "parallel.microbatches", "train.eval_every",
              "train.sample_tokens", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay",
              "optim.clip", "checkpoint.every", "checkpoint.keep", "logging.peak_flops", "train.stop_at",
              "fault.timeout_s", "fault.straggler_factor", "fault.spike_zscore", "fault.sdc_every",
              "fault.mtbf_hours", "fault.flight_ops", "model.init_std", "train.seed", "lora.rank", "lora.alpha",
              "memory.recompute_layers", "train.thread_replicas", "checkpoint.peer_every"]
    for key in nonneg:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value >= 0, f"config key {key} must be >= 0, got {value}")
    m = cfg.model
    require(m.d_model % m.n_head == 0, f"model.d_model = {m.d_model} must be divisible by model.n_head = {m.n_head}")
    require(m.head_dim % 2 == 0 or m.arch != "llama", "model.d_model / model.n_head must be even for RoPE (llama)")
    require(m.n_head % m.kv_heads == 0,
            f"model.n_head = {m.n_head} must be divisible by model.n_kv_head = {m.kv_heads}")
    require(m.arch == "llama" or m.kv_heads == m.n_head,
            "model.n_kv_head (grouped-query attention) is for model.arch = 'llama'; gpt2 uses n_kv_head = n_head")
    validate_tensor_parallel(cfg)
    validate_pipeline(cfg)
    validate_context_parallel(cfg)
    validate_hierarchical_dp(cfg)
    validate_moe(cfg)
    validate_thread_replicas(cfg)
    require(cfg.optim.beta1 < 1 and cfg.optim.beta2 < 1, "optim.beta1 and optim.beta2 must be < 1")
    require(cfg.optim.name in OPTIMIZERS, f"config key optim.name = {cfg.optim.name!r}: expected "
                                          f"{', '.join(OPTIMIZERS[:-1])} or {OPTIMIZERS[-1]}")
    require(0 <= cfg.optim.momentum < 1, f"config key optim.momentum = {cfg.optim.momentum} must be in [0, 1)")
    require(0 <= cfg.optim.adafactor_beta1 < 1,
            f"config key optim.adafactor_beta1 = {cfg.optim.adafactor_beta1} must be in [0, 1)")
    require(cfg.optim.adafactor_momentum in ("int4", "full"),
            f"config key optim.adafactor_momentum = {cfg.optim.adafactor_momentum!r}: expected int4 or full")
    require(all(s >= 1 for s in cfg.fault.skip_steps), "config key fault.skip_steps: steps count from 1")
    require(not cfg.fault.attribute or cfg.parallel.zero == 0,
            f"config key fault.attribute needs parallel.zero = 0, got {cfg.parallel.zero}: sharded gradients reduce "
            "the norm over the replicas, so a rank's own fault could not be told from the data's")
    require(cfg.optim.min_lr <= cfg.optim.lr or cfg.optim.lr == 0, "optim.min_lr must be <= optim.lr")
    _validate_schedules(cfg)
    validate_fp8_layout(cfg)
    validate_quantized_zero(cfg)
    require(cfg.logging.wandb_project.strip() != "", "config key logging.wandb_project is empty; name a W&B project")
    require(cfg.fault.straggler_factor == 0 or cfg.fault.straggler_factor > 1,
            f"config key fault.straggler_factor = {cfg.fault.straggler_factor} must be > 1 (slower than the median "
            "by this factor), or 0 to turn straggler reports off")
    require(cfg.data.synthetic or cfg.data.mix or cfg.data.path.strip() != "",
            "config key data.path is empty; give a dataset file (mpitrain data prepare) or set data.synthetic = true")
    if cfg.data.mix:
        mix_entries("data.mix", cfg.data.mix)  # a config built in code has not passed _coerce
        require(not cfg.data.synthetic, "config keys data.mix and data.synthetic = true exclude each other")


def validate_fp8_layout(cfg) -> None:
    """precision.fp8: what the layout must allow (block scales whole on every tp shard, the rows each GEMM shares);
    the planner asks the same of a layout it costs. On the CPU an exact emulation (mpitrain/layers/fp8.py); on
    train.device = "cuda" its GEMMs go through cuBLASLt where it takes the recipe (mpitrain/layers/fp8_lt.py;
    untested on a device, the banner says so). LoRA's adapters run in the compute dtype on the unquantized input.
    Any compute dtype is allowed: the fp8 values are multiplied in fp32 (float64 under float64) and only the GEMM
    outputs are stored in the compute dtype; with float16 the loss scale is absorbed by the output gradients' own
    fp8 scale, so it changes no fp8 code."""
    fp8 = cfg.precision.fp8
    if fp8 == "none":
        return
    if fp8 in ("block", "mxfp8"):
        _validate_fp8_blocks(cfg, 128 if fp8 == "block" else 32)
    _validate_fp8_rows(cfg)


def _validate_fp8_rows(cfg) -> None:
    """Where a layout changes which rows share one FP8 GEMM, no scale can equal one process's: a per-tensor scale
    is the amax of all the GEMM's rows, so experts under ep > 1 (or etp = 1 < tp), whose GEMM takes the rows of
    several ranks' micro-batches (or a rank's share of them), differ; row-wise block and MX scales do not. Key and
    value heads replicated over tp (tp > n_kv_head) differ under every recipe: each rank quantizes its partial
    gradient of K and V before the tp sum (all-reducing it before the weight-gradient GEMM would cost a K/V-sized
    all-reduce per layer; not built)."""
    m, p, fp8 = cfg.model, cfg.parallel, cfg.precision.fp8
    experts_split = MoeSettings.of(m).experts and (p.ep > 1 or (p.etp or p.tp) < p.tp)
    require(fp8 not in ("tensor", "delayed") or not experts_split,
            f"config key precision.fp8 = {fp8!r} with model.moe under parallel.ep = {p.ep}, etp = {p.etp or p.tp}: "
            f"a per-tensor scale is the amax of every row of an expert's GEMM, and this layout puts other rows in "
            f"that GEMM than one process does, so no layout gives one process's numbers; use 'block' or 'mxfp8' "
            f"(row-wise scales)")
    require(m.kv_heads % p.tp == 0 or p.tp == 1,
            f"config key precision.fp8 = {fp8!r} with parallel.tp = {p.tp} > model.n_kv_head = {m.kv_heads}: the "
            f"replicated key/value heads' backward quantizes each tp rank's partial gradient before the sum; use a "
            f"tp that divides n_kv_head")


def _validate_fp8_blocks(cfg, block: int) -> None:
    """Block scales must not cross a tp shard (docs/fp8.md): every split width of an FP8 linear a whole number of
    blocks, checked before any collective (the linears check again at their first call)."""
    m, p = cfg.model, cfg.parallel
    t, head = p.tp, m.head_dim
    widths = {"the query heads (model.n_head x head_dim)": m.n_head * head // t,
              "the key/value heads": m.kv_heads * head // t if m.kv_heads % t == 0 else head,
              "the MLP (model.d_ff)": m.ff_dim // t}
    if MoeSettings.of(m).experts:
        widths["the experts (model.d_ff over parallel.etp)"] = m.ff_dim // (p.etp or t)
    split = [f"{what} {width} wide" for what, width in widths.items() if width % block]
    require(t == 1 or not split, f"config key precision.fp8 = {cfg.precision.fp8!r}: over parallel.tp = {t} each "
            f"rank holds {', '.join(split)}, not a whole number of {block}-element scaling blocks; choose a tp that "
            f"keeps shards whole blocks, or precision.fp8 = 'tensor'")


def _validate_schedules(cfg) -> None:
    """optim.decay_fraction, the wsd decay's room after the warm-up, and train.batch_rampup's three numbers."""
    o, t = cfg.optim, cfg.train
    require(0 < o.decay_fraction <= 1, f"config key optim.decay_fraction = {o.decay_fraction} must be in (0, 1]")
    decay = max(1, round(o.decay_fraction * t.steps))  # optim/schedule.wsd_decay_steps
    require(o.schedule != "wsd" or o.warmup_steps + decay <= t.steps,
            f"config key optim.decay_fraction = {o.decay_fraction}: the wsd decay's {decay} steps and "
            f"optim.warmup_steps = {o.warmup_steps} do not fit in train.steps = {t.steps}")
    if not t.batch_rampup:
        return
    require(len(t.batch_rampup) == 3, f"config key train.batch_rampup = {t.batch_rampup} must be [start, increment, "
                                      "ramp_samples] (Megatron's --rampup-batch-size), or [] for none")
    start, increment, ramp_samples = t.batch_rampup
    require(start > 0 and increment > 0 and ramp_samples > 0,
            f"config key train.batch_rampup = {t.batch_rampup}: start, increment and ramp_samples must be > 0")
    require(start <= t.global_batch and (t.global_batch - start) % increment == 0,
            f"config key train.batch_rampup = {t.batch_rampup}: train.global_batch = {t.global_batch} must be "
            f"start = {start} plus a whole number of increments of {increment}")


def validate_quantized_zero(cfg) -> None:
    """ZeRO++'s quantized collectives (state/zero_quantized.py): which ZeRO stage and dtype they need."""
    p = cfg.parallel
    require(p.zero_quant_block >= 2 and p.zero_quant_block % 2 == 0,
            f"config key parallel.zero_quant_block = {p.zero_quant_block} must be an even number >= 2 (int4 packs "
            "two values per byte)")
    if p.zero_gather_dtype == "same" and p.zero_grad_reduce == "exact":
        return
    require(p.zero_gather_dtype == "same" or p.zero == 3,
            f"config key parallel.zero_gather_dtype = {p.zero_gather_dtype!r} quantizes ZeRO-3's parameter "
            f"all-gather; it needs parallel.zero = 3, got {p.zero}")
    require(p.zero_grad_reduce == "exact" or p.zero >= 1,
            f"config key parallel.zero_grad_reduce = {p.zero_grad_reduce!r} quantizes ZeRO's gradient "
            f"reduce-scatter; it needs parallel.zero >= 1, got {p.zero}")
    require(p.zero_grad_reduce == "exact" or cfg.precision.grad_reduce == "float32",
            f"config key parallel.zero_grad_reduce = {p.zero_grad_reduce!r} excludes precision.grad_reduce = "
            f"{cfg.precision.grad_reduce!r}: the gradients have one wire format")
    # train.device = 'cuda' is allowed: the block codecs (comm/quantized.py) run on the arrays' own module


def _require_finite_floats(cfg) -> None:
    """NaN and infinities pass `>=` checks only by accident (`inf >= 0`) and fail much later: refuse them by key."""
    for section_name in (f.name for f in fields(cfg)):
        section = getattr(cfg, section_name)
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float):
                require(math.isfinite(value), f"config key {section_name}.{toml_key(f.name)} = {value} must be a "
                                              "finite number")
