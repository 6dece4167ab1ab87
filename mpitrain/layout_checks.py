"""Config checks of the parallel layout that need no MPI (tensor, context and pipeline splits): what each way of
splitting requires of the model's shape, refused with the key to change. Called by config_checks.validate.
Each takes the run's Config; this module does not import config.py, which imports it."""
from __future__ import annotations

from mpitrain.config_moe import MoeSettings
from mpitrain.config_rules import positive_degree, require


def validate_tensor_parallel(cfg) -> None:
    """What tensor parallelism splits must split evenly (the vocabulary need not: it is padded)."""
    m, t = cfg.model, cfg.parallel.tp
    positive_degree("config key parallel.tp", t)
    for key, value in (("model.n_head", m.n_head), ("model.d_model", m.d_model), ("model.d_ff (MLP width)", m.ff_dim)):
        require(value % t == 0, f"{key} = {value} is not divisible by parallel.tp = {t} (tensor parallelism splits "
                                 f"it across the tp ranks); choose parallel.tp dividing {value}")
    require(m.kv_heads % t == 0 or t % m.kv_heads == 0,
            f"model.n_kv_head = {m.kv_heads} and parallel.tp = {t}: key/value heads are split across the tp ranks "
            f"when n_kv_head is a multiple of tp and replicated when tp is a multiple of n_kv_head; choose one")
    require(not cfg.parallel.sequence_parallel or m.seq_len % t == 0,
            f"model.seq_len = {m.seq_len} is not divisible by parallel.tp = {t} (parallel.sequence_parallel "
            f"splits the sequence across the tp ranks)")
    require(not cfg.parallel.tp_overlap or (t > 1 and cfg.parallel.sequence_parallel),
            f"parallel.tp_overlap pipelines sequence parallelism's all-gathers and reduce-scatters with the linears' "
            f"matmuls, chunk by chunk along the sequence: it needs parallel.tp > 1 (is {t}) and "
            f"parallel.sequence_parallel = true (without it a region ends in an all-reduce of the whole sequence, "
            f"which has no sequence chunks to pipeline)")
    # train.collectives = 'nccl' is allowed: the ring's tag has NCCL lanes on the tp group (comm/nccl.py P2P_TAGS)


def validate_context_parallel(cfg) -> None:
    """parallel.cp = c cuts each sequence into 2c equal chunks (zig-zag: mpitrain/parallel/context.py)."""
    p, m = cfg.parallel, cfg.model
    positive_degree("config key parallel.cp", p.cp)
    if p.cp == 1:
        return
    require(m.seq_len % (2 * p.cp) == 0,
            f"model.seq_len = {m.seq_len} is not divisible by 2 * parallel.cp = {2 * p.cp} (context parallelism "
            f"cuts each sequence into 2 cp chunks); choose parallel.cp with 2 cp dividing {m.seq_len}")
    require(not p.sequence_parallel or (m.seq_len // p.cp) % p.tp == 0,
            f"model.seq_len / parallel.cp = {m.seq_len // p.cp} tokens per cp rank are not divisible by parallel.tp "
            f"= {p.tp} (parallel.sequence_parallel splits them across the tp ranks)")
    if p.cp_kind == "ulysses":
        validate_ulysses(cfg)
    # cp_kind 'hybrid' splits the heads over the cp ranks of a node, known once the nodes are: checked then
    # (parallel/context.check_heads_split)
    # train.device = 'cuda' is allowed: the ring's buffers are the backend's arrays end to end (ring_attention.py
    # and ContextParallel use array_module) and travel on the cp group's NCCL lanes, or host-staged through MPI.


def validate_ulysses(cfg) -> None:
    """parallel.cp_kind = 'ulysses' gives each cp rank H/c of a tp rank's heads (layers/ulysses_attention.py)."""
    p, m = cfg.parallel, cfg.model
    heads = m.n_head // p.tp
    require(heads % p.cp == 0,
            f"parallel.cp_kind = 'ulysses': the {heads} attention heads per tp rank (model.n_head = {m.n_head} / "
            f"parallel.tp = {p.tp}) are not divisible by parallel.cp = {p.cp}, so the heads cannot be split evenly "
            f"over the cp ranks; choose parallel.cp dividing {heads} or parallel.cp_kind = 'ring'")
    kv = m.kv_heads // p.tp if m.kv_heads % p.tp == 0 else 1
    require(kv % p.cp == 0 or p.cp % kv == 0,
            f"parallel.cp_kind = 'ulysses': the {kv} key/value heads per tp rank (model.n_kv_head = {m.kv_heads}) "
            f"are split over the cp ranks when a multiple of parallel.cp = {p.cp} and replicated when parallel.cp "
            f"is a multiple of them; choose one")


def validate_pipeline(cfg) -> None:
    """What the pipeline split needs, before the world size is known (the micro-batch count is checked in
    resolve_layout, once dp is)."""
    p, layers = cfg.parallel, cfg.model.n_layer
    stages = p.pp * p.virtual_stages
    require(p.schedule not in ("zbv", "dualpipev") or p.virtual_stages == 2,
            f"parallel.schedule = {p.schedule!r} runs two model chunks per rank in a V; set parallel.virtual_stages "
            f"= 2 (got {p.virtual_stages})")
    require(p.virtual_stages == 1 or p.schedule in ("interleaved", "zbv", "dualpipev"),
            f"parallel.virtual_stages = {p.virtual_stages} needs parallel.schedule = 'interleaved', 'zbv' or "
            f"'dualpipev' (got "
            f"{p.schedule!r}); set parallel.virtual_stages = 1 or change the schedule")
    require(layers >= stages,
            f"model.n_layer = {layers} is fewer than the {stages} pipeline stages (parallel.pp * "
            f"parallel.virtual_stages = {p.pp} * {p.virtual_stages}): every stage needs a layer; lower parallel.pp "
            f"or parallel.virtual_stages")
    if p.stage_layers:
        require(len(p.stage_layers) == stages,
                f"parallel.stage_layers has {len(p.stage_layers)} entries but there are {stages} pipeline stages "
                f"(parallel.pp * parallel.virtual_stages); give one layer count per stage")
        require(min(p.stage_layers) >= 1,
                f"parallel.stage_layers = {p.stage_layers} leaves a stage without layers; every stage needs one")
        require(sum(p.stage_layers) == layers,
                f"parallel.stage_layers = {p.stage_layers} sums to {sum(p.stage_layers)}, not model.n_layer = "
                f"{layers}")


def thread_replica_blockers(cfg) -> list[str]:
    """What keeps a rank from splitting its micro-batches' rows over threads (mpitrain/parallel/replicas.py): layers
    that communicate inside forward and backward (tp, cp, MoE's all-to-all and auxiliary losses), parameters gathered
    per unit (ZeRO-3), a pipeline's sends between units, and arrays on a GPU (one stream already fills it)."""
    p = cfg.parallel
    checks = [(cfg.train.device == "cpu", f"train.device = {cfg.train.device!r}"), (p.pp == 1, f"parallel.pp = {p.pp}"),
              (p.tp == 1, f"parallel.tp = {p.tp}"), (p.cp == 1, f"parallel.cp = {p.cp}"),
              (p.zero < 3, "parallel.zero = 3"), (not MoeSettings.of(cfg.model).experts, "model.moe"),
              # a per-tensor fp8 scale is the amax of a whole micro-batch, not of a replica's rows
              (cfg.precision.fp8 == "none", f"precision.fp8 = {cfg.precision.fp8!r}")]
    return [what for allowed, what in checks if not allowed]


def validate_thread_replicas(cfg) -> None:
    """train.thread_replicas > 1 asks for replicas; refused with the reason where the layout has none."""
    asked, blockers = cfg.train.thread_replicas, thread_replica_blockers(cfg)
    require(asked <= 1 or not blockers,
            f"train.thread_replicas = {asked} with {', '.join(blockers)}: thread replicas run one whole pipeline "
            f"stage on one CPU, without tensor, context or expert parallelism and without ZeRO-3; set "
            f"train.thread_replicas = 0 (auto: replicas where the layout allows) or 1")


def dp_split_kind(parallel) -> str:
    """The group hierarchical data parallelism splits by node: the one gradients are summed over (dp, or dp_cp when
    cp > 1: the cp ranks' gradients are part of the same sum)."""
    return "dp_cp" if parallel.cp > 1 else "dp"


def hierarchical_dp(parallel) -> bool:
    """parallel.zero_shard = 'node' or parallel.dp_reduce = 'two_level' (state/hierarchical.py)."""
    return parallel.zero_shard == "node" or parallel.dp_reduce == "two_level"


def validate_hierarchical_dp(cfg) -> None:
    """What the two-level gradient reduction and hybrid sharding need (the ranks per node are checked by the mesh)."""
    p = cfg.parallel
    if not hierarchical_dp(p):
        return
    require(p.zero_shard == "world" or p.zero >= 1,
            "parallel.zero_shard = 'node' shards ZeRO's state inside a node and needs parallel.zero >= 1; for plain "
            "data parallelism use parallel.dp_reduce = 'two_level'")
    require(p.zero_shard == "world" or p.dp_reduce == "flat",
            "parallel.zero_shard = 'node' already reduces in two levels (inside the node, then across on the shard); "
            "set parallel.dp_reduce = 'flat'")
    require(p.zero_shard == "world" or (p.ep == 1 and p.etp in (0, p.tp)),
            f"parallel.zero_shard = 'node' with parallel.ep = {p.ep}, parallel.etp = {p.etp}: experts summed over "
            "their own group are sharded flat; set parallel.zero_shard = 'world' (or parallel.dp_reduce = "
            "'two_level')")
    key = "parallel.zero_shard = 'node'" if p.zero_shard == "node" else "parallel.dp_reduce = 'two_level'"
    require(cfg.precision.grad_reduce == "float32",
            f"{key} sums gradients with reduce-scatters and all-reduces in two levels; precision.grad_reduce = "
            f"'bfloat16' (an all-to-all of bf16 blocks) has no two-level form: set precision.grad_reduce = 'float32'")
    # train.device = 'cuda' is allowed: the two levels' buffers are made on the gradients' array module
    # (comm/two_level.py) and each level is a group of the run's collectives (NCCL, or host-staged MPI)
    # quantized parallel.zero_grad_reduce / zero_gather_dtype are allowed: each level quantizes and sums in full
    # precision (state/hierarchical_quantized.py)


def groups_split_by_node(cfg) -> tuple[str, ...]:
    """The process-group kinds whose two levels (inside a node, across nodes) a run needs, for comm.Mesh; each
    hierarchical feature adds its kind here. The same tuple on every rank: the splits are collective."""
    kinds: list[str] = []
    if hierarchical_dp(cfg.parallel):  # the gradient reduction's two levels (state/hierarchical.py)
        kinds.append(dp_split_kind(cfg.parallel))
    if cfg.parallel.cp_kind == "hybrid" and cfg.parallel.cp > 1:  # Ulysses inside a node, the ring across nodes
        kinds.append("cp")
    return tuple(kinds)
