"""The Trainer, one training step: wires config, mesh, data, model, gradient sync and optimizer together. The loop
that runs its steps, with the run's log, checkpoints and resilience around them, is mpitrain/train_loop.py.

One code path for every layout: with one process the mesh has groups of size 1, whose collectives cost nothing.
Everything that can fail because of the user's input (config, layout, dataset) is checked before the first
collective, so a mistake ends every rank with the same clear line instead of a hang.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from mpitrain import tiles
from mpitrain.backend import make_backend
from mpitrain.checkpoint.manager import CheckpointManager
from mpitrain.comm.counters import merge_counters
from mpitrain.comm.failure import agree_on_user_errors
from mpitrain.comm.mesh import Mesh
from mpitrain.comm.nccl import make_group_factory
from mpitrain.comm.nodes import discover_nodes
from mpitrain.config import Config, grad_accumulation_steps
from mpitrain.config_moe import MoeSettings
from mpitrain.data.documents import documents_from_starts
from mpitrain.kernels.attention import describe_attention_path
from mpitrain.kernels.fp8_gemm import describe_fp8_path
from mpitrain.layers.expert_parallel import ExpertParallel
from mpitrain.layers.fp8 import apply_fp8, delayed_state, end_delayed_step, load_delayed_state, scales_only
from mpitrain.layers.recompute import apply_recompute
from mpitrain.layers.tensor_parallel import TensorParallel
from mpitrain.layout_checks import groups_split_by_node
from mpitrain.model.gpt import GPT
from mpitrain.optim.adamw import clip_scale
from mpitrain.optim.factory import make_optimizer
from mpitrain.optim.loss_scale import make_loss_scale
from mpitrain.optim.schedule import lr_at
from mpitrain.parallel.context import ContextParallel, apply_context_parallel, split_sequence
from mpitrain.parallel.pipeline import PipelineExecutor, rank_stages, stage_layer_counts
from mpitrain.parallel.replicas import ThreadReplicas, replica_count
from mpitrain.parallel.schedule import make_schedule, placement_of
from mpitrain.parallel.timeline import bubble_fraction, merge_events
from mpitrain.profile.breakdown import Breakdown, RunSummary, device_synchronize, gather_step
from mpitrain.profile.flops import peak_flops, recomputed_flops_per_token
from mpitrain.profile.moe_metrics import moe_step_metrics, step_expert_loads
from mpitrain.resilience.attribution import FaultAttribution, flip_gradient_exponent
from mpitrain.resilience.faults import FaultPlan
from mpitrain.resilience.guard import GOOD, NONFINITE_GRAD, OVERFLOW, BadStepGuard
from mpitrain.resilience.sdc import flip_one_bit
from mpitrain.resilience.stragglers import compute_seconds, inject_slowdown
from mpitrain.run.start import check_start, forget_refused_start, make_samplers, warn_zero3_with_pipeline  # noqa: F401
from mpitrain.state.factory import make_state
from mpitrain.state.offload import make_placement


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    comm_bytes: dict
    bubble: float | None = None  # measured pipeline bubble (pp > 1, on the logging rank, when asked for)
    compute_seconds: float = 0.0  # this rank's forward/backward time (waits on peers excluded): stragglers
    breakdown: dict | None = None  # profile/breakdown.py: {part: seconds} of this rank, and step_s
    verdict: int = GOOD  # resilience/guard.py: GOOD, or why the update was skipped
    stop_requested: bool = False  # some rank was asked to stop (learnt with the verdict, in the same all-reduce)
    global_batch: int = 0  # sequences in this step's global batch (train.batch_rampup grows it)

    @property
    def skipped(self) -> bool:
        return self.verdict != GOOD


class Trainer:
    def __init__(self, cfg: Config, world_comm, progress=None, run_dir: Path | None = None):
        """progress: the watchdog's record (comm/operations.py); run_dir: where injected faults are recorded."""
        self.cfg = cfg
        world_size, world_rank = world_comm.Get_size(), world_comm.Get_rank()
        say = print if world_rank == 0 else None
        # --- checks without communication, then one small all-gather of their verdicts: a rank that alone fails
        # (a data file missing on its node) ends every rank with its line instead of leaving them in a collective
        self.ramp, (self.train_data, self.val_data, self.tokenizer) = agree_on_user_errors(
            world_comm, lambda: check_start(cfg, world_size))
        p = cfg.parallel
        self.tokenizer_description = self.tokenizer.description() if self.tokenizer is not None else None
        nodes = discover_nodes(world_comm) if cfg.train.device == "cuda" else None  # a GPU per node-local rank
        self.backend = make_backend(cfg.train.device, cfg.precision.compute,
                                    nodes.node_local_rank if nodes else world_rank, cfg.precision.master)
        self.faults = FaultPlan.from_environment(world_rank, run_dir)  # MPITRAIN_FAULT: injected (tests, demos)
        # where each step's time goes: the rank's waits (the mesh's), the pipeline's events, the linears' dW (tp)
        self.breakdown = Breakdown(synchronize=device_synchronize(self.backend))  # GPU: synchronized at each part
        self.run_summary = RunSummary()
        # --- from here on, collectives
        self.mesh = Mesh(world_comm, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, progress=progress,
                         allow_cross_node_tp=p.allow_cross_node_tp, nodes=nodes, listener=self.breakdown,
                         split_by_node=groups_split_by_node(cfg),
                         group_factory=make_group_factory(cfg.train.collectives, cfg.train.device, say=say))
        self.model = self._build_model()
        # memory.offload: where master weights and moments live (the same placement on every rank: no collective)
        self.placement = make_placement(cfg.memory, cfg.optim.name, self.backend, world_rank, run_dir, say=say)
        self.state = make_state(cfg, self.model, self.backend, self.mesh, self.placement)
        self.optimizer = make_optimizer(cfg.optim, self.state, self.placement, self.mesh.tp, self.mesh.ep)
        self.loss_scale = make_loss_scale(cfg.precision.compute, cfg.precision.loss_scale_window)
        # pipeline micro-batches are the accumulation micro-batches; with pp = 1 the schedule is "F0 B0 F1 B1 ..."
        self.accumulation = grad_accumulation_steps(cfg)
        # a rank with several cores splits its micro-batches' rows over thread replicas where the layout allows
        self.replicas = replica_count(cfg, tiles.thread_count())
        self.pipeline = self._build_pipeline()
        self._programs = {self.accumulation: self.pipeline.program}  # this rank's program per micro-batch count
        if p.zero == 3 and p.pp > 1 and world_rank == 0:
            warn_zero3_with_pipeline(p.pp, self.accumulation)
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len  # the full batch's (the ramp's last)
        self.peak_flops, self.peak_source = peak_flops(cfg.logging.peak_flops, self.backend, cfg.precision.compute)
        self.recomputed_flops = recomputed_flops_per_token(cfg.model, stage_layer_counts(
            cfg.model.n_layer, p.pp * p.virtual_stages, p.stage_layers), cfg.memory.recompute,
            cfg.memory.recompute_layers, ring=p.cp > 1)
        self.recent_step_s: list[float] = []  # for the ETA
        self.cluster_peak_flops = self.mesh.world.all_reduce_scalar(self.peak_flops)
        self.guard = BadStepGuard(cfg.fault, self.mesh.world, self.faults)  # bad steps: skip, roll back
        self.attribution = FaultAttribution(cfg.fault.attribute, self.mesh, self.guard, run_dir, print)

    def _build_model(self) -> GPT:
        """This rank's stages of the model, with recomputation and ring attention (parallel.cp) applied."""
        cfg, p = self.cfg, self.cfg.parallel
        stages = rank_stages(cfg.model.n_layer, p.pp, p.virtual_stages, self.mesh.pp_rank, p.stage_layers,
                             placement_of(p.schedule))
        tp = TensorParallel(self.mesh.tp, p.sequence_parallel, breakdown=self.breakdown, overlap=p.tp_overlap)
        experts = ExpertParallel.of_mesh(self.mesh, MoeSettings.of(cfg.model).experts or 1)  # the expert mesh
        model = GPT(cfg.model, self.backend, tp=tp, stages=stages, lora=cfg.lora, ep=experts)
        apply_recompute(model, cfg.memory.recompute, cfg.memory.recompute_layers)
        # precision.fp8: activation amaxes reduced over cp (a micro-batch's sequence is split over its ranks)
        self.fp8_gemms = apply_fp8(model.units, cfg.precision.fp8, cfg.precision.fp8_history, self.mesh.cp)
        apply_context_parallel(model, ContextParallel.of_mesh(self.mesh, p.cp_kind))  # parallel.cp: dp x cp
        model.document_mask = cfg.data.document_mask  # every stage gets its micro-batches' documents
        return model

    def _build_pipeline(self) -> PipelineExecutor:
        """This rank's program of the schedule, run over the model (or its thread replicas)."""
        cfg, p = self.cfg, self.cfg.parallel
        program = make_schedule(p.schedule, p.pp, self.accumulation, p.virtual_stages)[self.mesh.pp_rank]
        seq_len = cfg.model.seq_len // p.cp  # a cp rank's two zig-zag chunks
        seq_len = seq_len // p.tp if p.sequence_parallel else seq_len
        computing = ThreadReplicas(self.model, self.replicas) if self.replicas > 1 else self.model
        return PipelineExecutor(computing, self.state, self.mesh.pp, program, self.accumulation,
                                (cfg.train.micro_batch, seq_len, cfg.model.d_model), self.backend,
                                breakdown=self.breakdown, placement=placement_of(p.schedule))

    @property
    def is_logger(self) -> bool:
        return self.mesh.world.rank == 0

    def _rows(self, micro: int, global_batch: int, dp_rank: int | None = None) -> range:
        """dp_rank: whose rows (default this rank's; a replay's peer check computes another's)."""
        dp_rank = self.mesh.dp_rank if dp_rank is None else dp_rank
        first = dp_rank * (global_batch // self.cfg.parallel.dp) + micro * self.cfg.train.micro_batch
        return range(first, first + self.cfg.train.micro_batch)

    def _micro_batch(self, data, batch: int, micro: int, global_batch: int, dp_rank: int | None = None):
        """(inputs, targets) of this rank: its dp rows of a global batch of `global_batch` sequences, and of each row
        its cp rank's zig-zag chunks; with data.document_mask also the whole rows' documents (GPT.document_context)."""
        rows = self._rows(micro, global_batch, dp_rank)
        cp, parts = self.mesh.cp, data.global_batch_rows(batch, rows)
        local = tuple(split_sequence(part, cp.size, cp.rank) for part in parts)
        if not self.cfg.data.document_mask:
            return local
        return (*local, documents_from_starts(data.document_starts(batch, rows)))

    def batch_size(self, batch: int) -> int:
        """Sequences in the global batch of data batch `batch` (train.batch_rampup, else train.global_batch)."""
        return self.ramp.batch_size(batch) if self.ramp is not None else self.cfg.train.global_batch

    def _use_batch_size(self, global_batch: int) -> None:
        """Point the pipeline at the program of this many sequences' micro-batches (built once per count: the
        schedule is a pure function of it, so every rank builds the same one)."""
        p = self.cfg.parallel
        micro_batches = global_batch // (p.dp * self.cfg.train.micro_batch)
        if micro_batches not in self._programs:
            self._programs[micro_batches] = make_schedule(p.schedule, p.pp, micro_batches,
                                                          p.virtual_stages)[self.mesh.pp_rank]
        self.pipeline.use_program(self._programs[micro_batches], micro_batches)

    def train_step(self, step: int, measure_bubble: bool = False, stop_here=lambda: False) -> StepResult:
        """One optimizer step. measure_bubble: gather the pipeline ranks' timelines to the logging rank afterwards
        (outside the timed step) and measure the bubble from them. stop_here(): whether this rank was asked to stop
        (run/resilience.py), told to every rank with the step's verdict."""
        cfg, state = self.cfg, self.state
        groups = self.mesh.all_groups()
        for group in groups:  # from here the counters hold this step's bytes alone (StepResult.comm_bytes): what
            group.reset_counters()  # ran before (an evaluation, a forward) is dropped, so a snapshot is no baseline
        self.breakdown.start_step()
        loss_scale = self.loss_scale.scale  # float16's dynamic loss scale; 1 otherwise
        batch = step + self.guard.data_offset  # batches skipped by rollbacks shift the step -> batch mapping
        global_batch = self.batch_size(batch)  # a batch ramp counts in batches, as the samples consumed do
        if self.ramp is not None:
            self._use_batch_size(global_batch)
        tokens = global_batch * cfg.model.seq_len
        loss_sum, aux, compute, _ = self._forward_backward(step, batch, global_batch, loss_scale)
        self.breakdown.push("optimizer")  # the norm, the verdict and the update (their waits apart)
        grad_norm = self.global_grad_norm() / loss_scale
        loss = self._total(loss_sum) / tokens
        verdict, stop_requested = self.guard.step_verdict(step + 1, loss, grad_norm, stop_here())  # same everywhere
        if verdict == NONFINITE_GRAD and self.loss_scale.dynamic:
            verdict = OVERFLOW  # float16: the scale was too large for this step's gradients, no sign of trouble
        if self.attribution.wanted(verdict):  # fault.attribute: replay the step; a transient fault's is applied
            verdict, loss, grad_norm, aux = self._replay(step, batch, global_batch, verdict, (loss, grad_norm))
        if verdict in (GOOD, OVERFLOW):
            self.loss_scale.update(grad_norm if verdict == GOOD else math.inf)  # halves on overflow
        self.guard.record(verdict, loss)
        o = cfg.optim
        lr = lr_at(step, o.lr, o.min_lr, o.warmup_steps, cfg.train.steps, o.schedule, o.decay_fraction, o.decay_shape)
        if verdict == GOOD:
            self.optimizer.step(lr, clip_scale(grad_norm, o.clip) / loss_scale)
            if MoeSettings.of(cfg.model).balance == "bias":  # the routing biases follow the step's expert loads
                self.model.update_routing_biases(state, step_expert_loads(aux, self.mesh.dp_cp))
        state.after_step()
        end_delayed_step(self.fp8_gemms, {"dp_cp": self.mesh.dp_cp, "expert_dp": self.mesh.expert_dp})  # fp8 delayed
        self.breakdown.pop()
        if self.guard.strikes("flip", step + 1):
            flip_one_bit(self.optimizer.segments)
        self.backend.synchronize()
        parts = self.breakdown.finish_step()
        self.run_summary.add(parts)
        result = StepResult(step, loss, lr, grad_norm, parts["step_s"], merge_counters(groups),
                            compute_seconds=compute, verdict=verdict, breakdown=parts, global_batch=global_batch,
                            stop_requested=stop_requested)
        if measure_bubble and self.mesh.pp.size > 1:
            gathered = self.mesh.pp.gather_object(self.pipeline.timeline.to_dicts())
            if gathered is not None:
                result.bubble = bubble_fraction(merge_events(gathered))
        return result

    def _forward_backward(self, step: int, batch: int, global_batch: int, loss_scale: float) -> tuple:
        """(this rank's loss sum, MoE auxiliary losses, compute seconds, its loss sum without them) of step `step`
        on data batch `batch`, from the current parameters, its gradients reduced into the state; injected faults of
        the loss and the gradient strike here."""
        self.state.zero_grads()
        tokens = global_batch * self.cfg.model.seq_len
        dloss = loss_scale / tokens  # the loss is the mean over every token of this step's global batch
        loss_sum = self.pipeline.run_step(lambda micro: self._fetch(batch, micro, global_batch), dloss)
        if self.guard.strikes("lossnan", step + 1):
            loss_sum = math.nan
        aux = self.model.pop_aux_losses()  # model.moe
        self.moe_metrics, aux_sum = moe_step_metrics(aux, self.model.moe_layers, self.mesh, tokens)
        compute = compute_seconds(self.pipeline.timeline.events)
        compute += inject_slowdown(self.faults, step + 1, compute)
        self.guard.inject(step + 1, self.optimizer.segments)
        if self.guard.strikes("gradflip", step + 1):
            flip_gradient_exponent(self.optimizer.segments)
        # MoE auxiliary losses are part of the loss (their gradients already are)
        return loss_sum + aux_sum, aux, compute, loss_sum

    def _replay(self, step: int, batch: int, global_batch: int, verdict: int, first: tuple) -> tuple:
        """Bad step `step` computed again from the same parameters (its update was skipped) and attributed
        (resilience/attribution.py, collective): (verdict, loss, grad norm, MoE auxiliary losses) of the replay."""
        loss_scale, tokens = self.loss_scale.scale, global_batch * self.cfg.model.seq_len
        self.breakdown.pop()  # the replay's parts are charged as the step's were
        loss_sum, aux, _, own_loss_sum = self._forward_backward(step, batch, global_batch, loss_scale)
        self.breakdown.push("optimizer")
        grad_norm = self.global_grad_norm() / loss_scale
        loss = self._total(loss_sum) / tokens
        verdict = self.attribution.judge(step + 1, verdict, first, (loss, grad_norm), own_loss_sum,
                                         lambda peer: self._peer_loss_sum(batch, global_batch, peer))
        return verdict, loss, grad_norm, aux

    def _peer_loss_sum(self, batch: int, global_batch: int, peer: int) -> float:
        """The loss sum of data-parallel rank `peer`'s micro-batches of data batch `batch`, forward only from this
        rank's parameters (the same as the peer's): a replay's check of the peer's own result."""
        micro_batches = global_batch // (self.cfg.parallel.dp * self.cfg.train.micro_batch)
        with scales_only(self.fp8_gemms):  # precision.fp8: a check, not a training forward
            loss_sum = self.pipeline.forward_only(
                lambda micro: self._micro_batch(self.train_data, batch, micro, global_batch, peer), micro_batches)
        self.model.pop_aux_losses()  # model.moe: not part of the compared sum
        return loss_sum

    def _fetch(self, batch: int, micro: int, global_batch: int):
        with self.breakdown.part("data"):
            return self._micro_batch(self.train_data, batch, micro, global_batch)

    def global_grad_norm(self) -> float:
        """The norm of the whole model's gradient: squares summed over the groups each tensor is split over (tp),
        then over the pipeline stages; tied copies (the embedding beside a gpt2 head on the last stage) are left out
        by the state, so each tensor counts once."""
        stage = 0.0
        for groups, squares in self.state.grad_sq_sums().items():  # keyed by ParamSpec.norm_groups
            for name in groups:
                squares = getattr(self.mesh, name).all_reduce_scalar(squares)
            stage += squares
        return math.sqrt(self.mesh.pp.all_reduce_scalar(stage))

    def _total(self, loss_sum: float) -> float:
        """The loss sum of the whole global batch on every rank: the last stage's, summed over dp x cp (cp ranks
        hold other tokens of the same rows), then over pp (the other stages add zeros)."""
        return self.mesh.pp.all_reduce_scalar(self.mesh.dp_cp.all_reduce_scalar(loss_sum))

    def evaluate(self) -> float:
        """Mean validation loss over train.eval_batches global batches, forward-only through the pipeline (FP8
        delayed scaling: at the current scales, its amaxes not recorded)."""
        loss_sum = 0.0
        for batch in range(self.cfg.train.eval_batches):
            with scales_only(self.fp8_gemms):
                loss_sum += self.pipeline.forward_only(lambda micro, batch=batch: self._micro_batch(
                    self.val_data, batch, micro, self.cfg.train.global_batch), self.accumulation)
        return self._total(loss_sum) / (self.tokens_per_step * self.cfg.train.eval_batches)

    def metrics(self, result: StepResult) -> dict:
        batch_tokens = result.global_batch * self.cfg.model.seq_len
        tokens_per_s = batch_tokens / result.seconds
        mfu = self.model.flops_per_token() * tokens_per_s / self.cluster_peak_flops
        hardware_mfu = (self.model.flops_per_token() + self.recomputed_flops) * tokens_per_s / self.cluster_peak_flops
        self.recent_step_s = (self.recent_step_s + [result.seconds])[-20:]
        eta_s = (self.cfg.train.steps - result.step - 1) * sum(self.recent_step_s) / len(self.recent_step_s)
        # "step" counts from 1, as the console and the checkpoints do: row N is the state of step_N
        record = {"step": result.step + 1, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "tokens_per_s": tokens_per_s, "mfu": mfu, "hardware_mfu": hardware_mfu, "eta_s": eta_s,
                  "step_time_s": result.seconds, "global_batch": result.global_batch, "batch_tokens": batch_tokens,
                  "comm_bytes": result.comm_bytes, "time": time.time()}  # time: wall clock, for time lost
        if self.loss_scale.dynamic:
            record["loss_scale"], record["overflow_steps"] = self.loss_scale.scale, self.loss_scale.skipped
        if result.bubble is not None:
            record["bubble"] = result.bubble
        record.update(self.guard.metrics(result.skipped))
        record.update(self.moe_metrics)  # model.moe: the auxiliary losses and each expert's share of the picks
        return record

    def gather_breakdown(self, record: dict, result: StepResult, timeline_path: Path) -> None:
        """Collective: every rank's breakdown of the step into the logging rank's record, which also writes the
        step's pipeline events to `timeline_path`."""
        per_rank = gather_step(self.mesh.world, result.breakdown, self.pipeline.timeline.to_dicts(), timeline_path,
                               result.step + 1)
        if per_rank is not None:
            record["breakdown"] = per_rank

    def checkpoint_manager(self, directory: Path, keep: int, echo=print) -> CheckpointManager:
        """What saves and restores this trainer's state; the bad-step guard's counters are saved beside it."""
        return CheckpointManager(directory, keep, cfg=self.cfg, mesh=self.mesh, state=self.state,
                                 optimizer=self.optimizer, tied_copies=self.model.tied_copies,
                                 tokenizer=self.tokenizer_description, save_extra=self._extra_state,
                                 load_extra=self._load_extra_state, echo=echo, faults=self.faults)

    def _extra_state(self) -> dict:
        """What a checkpoint keeps beside the tensors: the bad-step guard's counters and delayed scaling's amax
        histories (precision.fp8 = "delayed": gathered over pp, a collective of every save)."""
        return {**self.guard.state(), **delayed_state(self.fp8_gemms, self.cfg.precision.fp8, self.mesh.pp)}

    def _load_extra_state(self, extra: dict) -> None:
        self.guard.load_state(extra)
        load_delayed_state(self.fp8_gemms, extra)

    def banner(self, run_dir: Path) -> list[str]:
        """The lines printed before the first step: the model and layout, MFU's reference, placement, pipeline."""
        cfg, t, p = self.cfg, self.cfg.train, self.cfg.parallel
        replicas = f" (rows split over {self.replicas} thread replicas)" if self.replicas > 1 else ""
        headline = (f"mpitrain: {cfg.model.arch} with {self.model.n_params:,} parameters on {self.mesh.describe()}, "
                    f"{self.accumulation} micro-batch(es) of {t.micro_batch} x {cfg.model.seq_len} tokens per rank "
                    f"per step{replicas}, {cfg.precision.compute} on {t.device}; run dir {run_dir}")
        lines = [headline, f"MFU against {self.peak_flops / 1e12:.3g} TFLOP/s per rank ({self.peak_source})",
                 self.mesh.describe_placement()]
        if self.ramp is not None:
            lines.append(self.ramp.describe())
        if t.device == "cuda":
            m = cfg.model
            lines.append(describe_attention_path(self.backend.dtype, m.n_head, m.kv_heads, m.head_dim, p.cp > 1,
                                                 documents=cfg.data.document_mask))
            lines += describe_fp8_path(cfg.precision.fp8, self.backend.dtype)  # precision.fp8: cuBLASLt or emulated
        if p.pp > 1 or p.virtual_stages > 1:
            layers = stage_layer_counts(cfg.model.n_layer, p.pp * p.virtual_stages, p.stage_layers)
            chunks = f" x {p.virtual_stages} chunks" if p.virtual_stages > 1 else ""
            lines.append(f"pipeline: {p.schedule} schedule over {p.pp} stages{chunks}, layers per stage {layers}")
        return lines
