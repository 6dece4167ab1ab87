"""Run configuration: TOML files with sections, `--set section.key=value` overrides, validation that names the key.

Every key has a typed default here; a config file only lists what it changes (like nanoGPT's override files). The
resolved config is written to RUN_DIR/config.toml so a run can be repeated exactly.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mpitrain.config_checks import ALLOWED, mix_entries, validate  # noqa: F401  (ALLOWED: for make_configuration)
from mpitrain.config_rules import did_you_mean, require
from mpitrain.config_rules import toml_key as _key
from mpitrain.errors import ConfigError, shown_path
from mpitrain.layout_checks import (  # noqa: F401  (re-exported: the planner checks a layout with them)
    validate_context_parallel,
    validate_pipeline,
    validate_tensor_parallel,
)


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2: learned positions, LayerNorm, GELU, tied head; llama: RoPE, RMSNorm, SwiGLU, GQA
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 0  # 0: same as n_head (multi-head attention); fewer: grouped-query attention (llama)
    vocab_size: int = 256
    seq_len: int = 64
    d_ff: int = 0  # 0: 4*d_model for gpt2, 8/3*d_model rounded up to a multiple of 32 for llama
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # {experts, top_k, capacity_factor, aux_loss, z_loss, every, balance, bias_rate, seq_aux_loss}: config_moe.py
    moe: dict = field(default_factory=dict)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.arch == "gpt2":
            return 4 * self.d_model
        return 32 * -(-(8 * self.d_model // 3) // 32)


@dataclass
class ParallelConfig:
    dp: int = 0  # 0: whatever the world size leaves after tp*pp*cp
    tp: int = 1  # tensor parallelism: every layer split over tp ranks (innermost in the mesh: one node)
    sequence_parallel: bool = False  # tp > 1: norm/residual regions split along the sequence (1/tp activations)
    # sequence parallelism: pipeline each linear's all-gather / reduce-scatter with its matmul, one sequence chunk at
    # a time (collective matmul, mpitrain/layers/tp_overlap.py)
    tp_overlap: bool = False
    pp: int = 1  # pipeline stages: each pp rank holds a slice of the layers (embedding first, head last)
    microbatches: int = 0  # pipeline micro-batches per step; 0: global_batch / (dp * micro_batch), the same number
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved | zb1p | zbv | dualpipev
    virtual_stages: int = 1  # model chunks per pp rank (interleaved schedule; zbv and dualpipev need 2)
    stage_layers: list = field(default_factory=list)  # layers per (virtual) stage, in stage order; []: even split
    cp: int = 1
    cp_kind: str = "ring"  # ring (K/V travel) | ulysses (all-to-all of heads) | hybrid (ulysses per node, ring across)
    ep: int = 1
    etp: int = 0  # expert tensor parallelism (model.moe): 1 = whole experts, tp = split like the MLP; 0: tp
    zero: int = 0  # 0 = plain data parallelism; 1: shard optimizer state; 2: + gradients; 3: + parameters (FSDP)
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after forward (False: keep for backward)
    zero_gather_dtype: str = "same"  # ZeRO-3's weight all-gather: same | int8 | fp8 (block-quantized; masters exact)
    zero_grad_reduce: str = "exact"  # ZeRO's gradient reduce-scatter: exact | int8 | int4 (quantized all-to-all)
    zero_quant_block: int = 256  # elements per quantization block of the two keys above (one fp32 scale each); even
    # ZeRO shards over: world (all dp ranks) | node (the dp ranks of one node, one copy per node: hybrid sharding,
    # gathers stay inside the node; state/hierarchical.py)
    zero_shard: str = "world"
    # gradient reduction: flat (one ring over dp) | two_level (inside a node, across nodes on 1/k, inside again)
    dp_reduce: str = "flat"
    bucket_mb: float = 4.0  # gradient all-reduce bucket size (MiB); ZeRO reduces one unit at a time
    overlap: bool = True  # start gradient reductions during backward
    allow_cross_node_tp: bool = False  # accept a tp (or ep) group spanning nodes (slow links); refused by default


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 4  # sequences per rank per forward/backward; accumulation = global/(dp*micro)
    seed: int = 1234
    device: str = "cpu"
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    sample_tokens: int = 200  # sampled at the end of training; 0 to skip
    sample_prompt: str = "def "
    stop_at: int = 0  # save and exit (status 75, "resume me") after this step, mid-schedule; 0: run to the end
    init_from: str = ""  # a checkpoint or run dir: its weights only (any layout), fresh optimizer, from step 0
    collectives: str = "mpi"  # nccl: GPU groups through NCCL (comm/nccl.py); needs device = "cuda"
    thread_replicas: int = 0  # split a micro-batch's rows over this many threads (parallel/replicas.py); 0: auto
    # [start, increment, ramp_samples]: the global batch grows from `start` sequences by `increment` until it is
    # global_batch after ramp_samples samples (Megatron's --rampup-batch-size; optim/schedule.BatchRamp); []: off
    batch_rampup: list = field(default_factory=list)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    schedule: str = "cosine"  # after the warm-up: cosine | linear (to min_lr) | constant | wsd (optim/schedule.py)
    decay_fraction: float = 0.2  # wsd: the last fraction of train.steps decays to min_lr (stable at lr before)
    decay_shape: str = "linear"  # wsd's decay: linear | cosine | sqrt (1 - sqrt of the decay's progress)
    weight_decay: float = 0.1
    clip: float = 1.0  # global gradient-norm clip; 0 disables
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    name: str = "adamw"  # adamw | adafactor | adam8bit | sgd (mpitrain/optim/factory.py)
    momentum: float = 0.9  # sgd only
    adafactor_beta1: float = 0.9  # adafactor only: its first moment (0: none, 4 bytes per parameter less)
    adafactor_momentum: str = "int4"  # adafactor's first moment stored as: int4 (~0.53 B/param) | full (state dtype)


@dataclass
class PrecisionConfig:
    compute: str = "float32"  # parameters, gradients, activations; bfloat16/float16 keep fp32 master weights
    master: str = "float32"  # master weights and Adam moments when compute is lower (float64 runs keep float64)
    grad_reduce: str = "float32"  # bfloat16: gradients travel in bf16 (half the bytes), summed in fp32
    loss_scale_window: int = 1000  # float16: double the loss scale after this many steps without overflow
    # FP8 GEMMs of the attention projections and MLP/expert linears, emulated exactly (docs/fp8.md)
    fp8: str = "none"  # none | tensor | delayed (amax history) | block (1x128, 128x128) | mxfp8 (1x32, e8m0 scales)
    fp8_history: int = 16  # precision.fp8 = "delayed": steps of amax history whose max sets each tensor's scale


@dataclass
class DataConfig:
    path: str = "data/stdlib.h5"  # made by: mpitrain data prepare --source python-stdlib --out data/stdlib.h5
    synthetic: bool = False  # random tokens instead of a file (benchmarks, layout tests): a pure function of step
    # (mpitrain/data/documents.py) documents end at the tokenizer's end-of-document token, else at the file's stored
    # starts; synthetic data ends one at every token 0
    document_mask: bool = False  # attention, learned positions and RoPE stay inside each document packed in a row
    # blend prepared files by weight, replacing data.path (data/mix.py): ["a.h5:3", "b.h5:1"] or
    # [{path = "a.h5", weight = 3}, ...]; each row of a global batch comes from a file with probability ~ its weight
    mix: list = field(default_factory=list)

    def mix_sources(self) -> list[tuple[str, float]]:
        """data.mix as [(path, weight)] (its entries are kept as 'path:weight' strings once read)."""
        return [(path, float(weight)) for path, _, weight in (entry.rpartition(":") for entry in self.mix)]


@dataclass
class CheckpointConfig:
    dir: str = ""  # "": RUN_DIR/checkpoints
    every: int = 0  # save every N steps (and always at the end, and on SIGUSR1/SIGTERM); 0: only those
    keep: int = 3  # newest committed checkpoints kept (the newest is never deleted); 0: keep all
    async_: bool = False  # key `checkpoint.async`: write in a background thread while training goes on
    peer_every: int = 0  # every N steps each rank's state into node memory, and a partner's on another node; 0: off

    def directory(self, run_dir) -> Path:
        """Where the run's checkpoints live; train, launch's restarts and the sbatch loop must agree on it."""
        return Path(self.dir) if self.dir else Path(run_dir) / "checkpoints"


@dataclass
class LoggingConfig:
    peak_flops: float = 0.0  # per rank, FLOP/s; 0: measured with a float32 matmul at start-up
    tensorboard: bool = False  # also RUN_DIR/tensorboard/ event files (tensorboardX, extra [tensorboard])
    wandb: bool = False  # also Weights & Biases from the logging rank (extra [wandb]; offline without an API key)
    wandb_project: str = "mpitrain"  # the W&B project; the run is named after the run directory


@dataclass
class FaultConfig:
    """Surviving faults: hung or slow ranks, bad steps, silent data corruption (mpitrain/resilience/)."""
    timeout_s: float = 300.0  # a collective or transfer not done after this long aborts the job, naming it; 0: off
    heartbeat: bool = True  # every rank's watchdog record, about once a second, in RUN_DIR/heartbeat/node_NNNNN.json
    straggler_factor: float = 1.5  # report a rank computing more than this factor x the median rank; 0: off
    straggler_steps: int = 3  # ... when it is that slow on this many logged steps in a row
    spike_zscore: float = 0.0  # skip the update when the loss exceeds the window's mean by this many std; 0: off
    spike_window: int = 20  # steps of loss history for the spike test
    max_bad_steps: int = 3  # this many bad (skipped) steps in a row roll back to the last committed checkpoint
    sdc_every: int = 0  # every N steps compare a hash of the parameters across data-parallel replicas; 0: off
    skip_steps: list = field(default_factory=list)  # steps (from 1) whose update is skipped on purpose
    mtbf_hours: float = 0.0  # mean time between failures of the job's machines; > 0: print Young/Daly advice
    flight_ops: int = 256  # each rank's last N group operations, for `mpitrain doctor hang` (comm/flight.py); 0: off
    attribute: bool = False  # replay bad steps: transient ones are applied, persistent ones name a host to exclude


@dataclass
class MemoryConfig:
    """Memory savers: each key says what it trades for memory."""
    offload: str = "none"  # none | host | disk: fp32 master and optimizer state off the device (state/offload.py)
    offload_dir: str = ""  # memory.offload = disk: one set of memory-mapped files per rank; "": RUN_DIR/offload
    offload_chunk_mb: float = 16.0  # offloaded state streams through the device in chunks of this size per array
    recompute: str = "none"  # none | selective | full: recompute activations in backward (layers/recompute.py)
    recompute_layers: int = 0  # only the first K blocks of each pipeline stage recompute; 0: all of them


@dataclass
class LoraConfig:
    """LoRA (mpitrain/layers/lora.py): every base tensor frozen, rank-r adapters on the named linears."""
    rank: int = 0  # 0: off
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    targets: list = field(default_factory=lambda: ["wq", "wv"])  # weight names of the blocks' linears


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


def _section_names() -> list[str]:
    return [f.name for f in fields(Config)]


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check a value against the type of the key's default; ints are accepted where floats are expected."""
    kind = type(default)
    if key == "data.mix":
        return mix_entries(key, value)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            value = float(value) if ok else value
        except OverflowError:  # an integer literal too large for a float
            raise ConfigError(f"config key {key} = {value} is too large for a float") from None
    elif kind is list and default and isinstance(default[0], str):  # lists of names (lora.targets)
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif kind is list:  # lists of integers (parallel.stage_layers)
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        if kind is list and default and isinstance(default[0], str):
            raise ConfigError(f"config key {key} must be a list of strings, got {value!r}")
        if kind is list:
            raise ConfigError(f"config key {key} must be a list of integers, got {value!r}")
        raise ConfigError(f"config key {key} must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def config_from_dict(raw: dict, source: str = "config") -> Config:
    cfg = Config()
    for section_name, section_values in raw.items():
        if section_name not in _section_names():
            hint = did_you_mean(section_name, _section_names(), "[{}]")
            raise ConfigError(f"unknown config section [{section_name}] in {source}; {hint}"
                              f"allowed: {', '.join(_section_names())}")
        if not isinstance(section_values, dict):
            raise ConfigError(f"config section [{section_name}] in {source} must be a table of keys")
        section = getattr(cfg, section_name)
        known = {_key(f.name): f.name for f in fields(section)}
        for key, value in section_values.items():
            full = f"{section_name}.{key}"
            if key not in known:
                hint = did_you_mean(key, known, section_name + ".{}")
                raise ConfigError(f"unknown config key {full} in {source}; {hint}"
                                  f"allowed in [{section_name}]: {', '.join(sorted(known))}")
            setattr(section, known[key], _coerce(full, value, getattr(section, known[key])))
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' with value read as a TOML literal (numbers, booleans, quoted strings), else a bare string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.steps=50")
    path, literal = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {literal}")["v"]
    except tomllib.TOMLDecodeError:
        value = literal
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {shown_path(path)}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
        source = str(path)
    given: dict = {}
    for text in overrides:
        section, key, value = parse_override(text)
        given.setdefault(section, {})[key] = value
    config_from_dict(given, "--set")  # a bad override is reported as one, not as the file's
    for section, values in given.items():
        raw.setdefault(section, {}).update(values)
    cfg = config_from_dict(raw, source)
    validate(cfg)
    return cfg


def resolve_layout(cfg: Config, world_size: int) -> None:
    """Fill parallel.dp = 0 from the world size and check the batch splits evenly. No MPI calls: safe before any."""
    p = cfg.parallel
    others = p.tp * p.pp * p.cp
    if p.dp == 0:
        require(world_size % others == 0,
                f"world size {world_size} is not divisible by parallel.tp*pp*cp = {others}")
        p.dp = world_size // others
    # the rank count first: a wrong parallel.dp would otherwise be reported as a batch that does not divide
    require(p.dp * others == world_size,
            f"world size {world_size} does not match parallel dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = "
            f"{p.dp * others}; change parallel.dp (0: the world size decides) or run with -n {p.dp * others}")
    t = cfg.train
    per_step = p.dp * t.micro_batch
    require(t.global_batch % per_step == 0,
            f"train.global_batch = {t.global_batch} is not divisible by parallel.dp * train.micro_batch = "
            f"{p.dp} * {t.micro_batch} = {per_step}; pick a global batch that is a multiple of {per_step}")
    micro_batches = t.global_batch // per_step
    require(p.microbatches in (0, micro_batches),
            f"parallel.microbatches = {p.microbatches} does not match train.global_batch / (parallel.dp * "
            f"train.micro_batch) = {t.global_batch} / ({p.dp} * {t.micro_batch}) = {micro_batches} (pipeline "
            f"micro-batches are the accumulation micro-batches); set parallel.microbatches = 0 or change "
            f"train.micro_batch")
    require(p.schedule != "interleaved" or p.virtual_stages == 1 or micro_batches % p.pp == 0,
            f"the interleaved schedule needs the micro-batches per step ({micro_batches} = train.global_batch / "
            f"(parallel.dp * train.micro_batch)) to be a multiple of parallel.pp = {p.pp}; change "
            f"train.global_batch or train.micro_batch")
    require(p.schedule != "dualpipev" or micro_batches >= 2 * p.pp,
            f"parallel.schedule = 'dualpipev' needs at least 2 * parallel.pp = {2 * p.pp} micro-batches per step, got "
            f"{micro_batches} = train.global_batch / (parallel.dp * train.micro_batch); raise train.global_batch or "
            f"lower train.micro_batch")
    _validate_ramp_layout(cfg)


def _validate_ramp_layout(cfg: Config) -> None:
    """Every global batch of train.batch_rampup splits into whole micro-batches on every dp rank (and, for the
    interleaved schedule, into a multiple of parallel.pp of them): the first size that does not is named."""
    t, p = cfg.train, cfg.parallel
    if not t.batch_rampup:
        return
    start, increment, _ = t.batch_rampup
    require(p.microbatches == 0, f"config key parallel.microbatches = {p.microbatches} must be 0 with "
                                 "train.batch_rampup: the micro-batch count grows with the ramp's batch")
    per_step = p.dp * t.micro_batch
    interleaved = p.schedule == "interleaved" and p.virtual_stages > 1
    for size in range(start, t.global_batch + 1, increment):
        require(size % per_step == 0,
                f"config key train.batch_rampup = {t.batch_rampup}: its global batch of {size} is not a multiple of "
                f"parallel.dp * train.micro_batch = {p.dp} * {t.micro_batch} = {per_step}; make start and "
                f"increment multiples of {per_step}")
        require(not interleaved or (size // per_step) % p.pp == 0,
                f"config key train.batch_rampup = {t.batch_rampup}: its global batch of {size} is "
                f"{size // per_step} micro-batches, which the interleaved schedule needs to be a multiple of "
                f"parallel.pp = {p.pp}")
        require(p.schedule != "dualpipev" or size // per_step >= 2 * p.pp,
                f"config key train.batch_rampup = {t.batch_rampup}: its global batch of {size} is "
                f"{size // per_step} micro-batches, fewer than the 2 * parallel.pp = {2 * p.pp} that "
                f"parallel.schedule = 'dualpipev' needs; start the ramp higher")


def grad_accumulation_steps(cfg: Config) -> int:
    """Micro-batches per step per rank: the gradient accumulation steps, and the pipeline's micro-batches."""
    return cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (tomllib has no writer; our values are flat scalars, so this stays short)."""
    def literal(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, dict):  # an inline table (model.moe)
            return "{" + ", ".join(f"{k} = {literal(v)}" for k, v in value.items()) + "}"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        return repr(value)

    lines = []
    for section_name in _section_names():
        lines.append(f"[{section_name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section_name)).items():
            lines.append(f"{_key(key)} = {literal(value)}")
        lines.append("")
    return "\n".join(lines)
