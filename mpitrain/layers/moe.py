"""Mixture of experts: a sublayer in place of the dense MLP of every `model.moe.every`-th block.

    logits = x W_router (E experts)      probs = softmax(logits)      each token picks its top_k experts
    y = sum over its picks j of probs[e_j] * expert_{e_j}(x)              (the raw softmax weights, not renormalised)

An expert is the block's MLP (gpt2: GELU, llama: SwiGLU; no biases), all E of them held as one batch of weights
(E, C, F) and (E, F, C). Capacity (`capacity_factor` f > 0): expert e takes at most ceil(f * N * k / E) of the N*k
picks of a micro-batch's N tokens, first come first served in (pick rank, token) order, GShard's priority; a dropped
pick adds nothing, so a token whose every pick is dropped passes through the block's residual alone. f = 0:
dropless, every pick is served.

Auxiliary losses, per micro-batch of N tokens (Switch Transformer / GShard and ST-MoE), in the loss as
N * (aux_loss * balance + seq_aux_loss * seq_balance + z_loss * z), i.e. their micro-batch means enter the mean
loss per token:
    balance = E * sum_e f_e * P_e    f_e: share of the N*k picks routed to e (before capacity), P_e: mean prob of e;
                                     1 when routing is uniform; gradient through P only (f counts are constant)
    z       = mean over tokens of logsumexp(logits)^2     keeps the router's logits small
    seq_balance = mean over the micro-batch's sequences of E * sum_e f_e,s * P_e,s   (DeepSeek-V3's sequence-wise
                  balance loss, weight seq_aux_loss: f and P of each sequence's own tokens; gradient through P only;
                  under cp the per-sequence sums are summed over the cp ranks, the gradient stays local)

Balancing (`balance`): "aux_loss" weighs the balance loss above by aux_loss. "bias" is DeepSeek-V3's auxiliary-loss-free
balancing instead: a per-expert routing bias (`router_bias`, a frozen tensor, saved in checkpoints like any) is added
to the probabilities for the top-k choice only, the gates stay the raw probabilities; after each step the model moves
it by bias_rate * sign(mean load - load of e), from the step's picks per expert summed over the data-parallel ranks
(update_routing_bias): the same numbers, hence the same bias, on every rank of every layout.

Parallelism. Expert parallelism (mpitrain/layers/expert_parallel.py): this rank holds E/ep consecutive experts and
routes its own tokens to the ranks that hold their experts with all-to-all(v), forward and backward. Tensor
parallelism: the input enters the tp region as for the dense MLP (replicated or gathered along the sequence), every
tp rank routes the same tokens the same way (the router is replicated), each expert is split like the dense MLP
(up/gate by output columns, down by input rows: experts' (E, C, F/t) and (E, F/t, C) pieces) and the combined output
leaves the region with the MLP's all-reduce (or reduce-scatter). The pick weights' gradient needs the full expert
output, so its (picks,) partial sums are all-reduced over tp. The router's input gradient is the same on every tp
rank: only tp rank 0 adds it before the region's gradient reduction.

Gradients: the router is reduced over dp like every other tensor; experts over expert_dp (ParamSpec.reduce_over)
when ep > 1, and their gradient norm is summed over ep too (each ep rank holds other experts).
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import array_module, to_host
from mpitrain.config_moe import MoeSettings
from mpitrain.layers import fp8_lt, ops
from mpitrain.layers.expert_parallel import ExpertParallel
from mpitrain.layers.mlp import MLP
from mpitrain.state.params import ParamSpec


def make_mlp(cfg, index: int, tp, ep: ExpertParallel | None):
    """Block `index`'s MLP sublayer: an MoE layer where model.moe says so, else the dense MLP."""
    moe = MoeSettings.of(cfg)
    if not moe.is_moe_block(index):
        return MLP(cfg, tp)
    return MoE(cfg, moe, tp, ep or ExpertParallel(None, moe.experts), index)


def inactive_params(cfg) -> int:
    """Expert weights a token does not use (E - k experts per MoE layer): all parameters less these are the active
    parameters per token that FLOPs and MFU count."""
    moe = MoeSettings.of(cfg)
    per_expert = cfg.d_model * cfg.ff_dim * (3 if cfg.arch == "llama" else 2)
    layers = sum(moe.is_moe_block(i) for i in range(cfg.n_layer))
    return layers * (moe.experts - moe.top_k) * per_expert if moe.experts else 0


def rank_experts(cfg) -> ExpertParallel:
    """Expert-parallel rank 0's share of the experts, without a group (mpitrain memory plans shapes only)."""
    p = cfg.parallel
    return ExpertParallel(None, MoeSettings.of(cfg.model).experts or 1, size=p.ep, etp_size=p.etp or p.tp,
                          share=(0, p.tp // (p.etp or p.tp)))


def sequence_statistics(ep: ExpertParallel, routed, probs, sequences: int, moe: MoeSettings):
    """f and P of DeepSeek-V3's sequence-level balance loss, each (sequences, E): each sequence's share of its
    seq_len * k picks routed to each expert (before capacity) and its mean probability of each expert. Tokens are
    rows of the (sequences * local seq_len) micro-batch; under cp each rank holds a chunk of every sequence, so the
    sums over the sequence's tokens are summed over the cp ranks."""
    token, expert = routed
    local_len = probs.shape[0] // sequences
    counts = np.zeros((sequences, moe.experts))
    np.add.at(counts, (token // local_len, expert), 1.0)
    prob_sums = to_host(probs).reshape(sequences, local_len, moe.experts).sum(axis=1)
    if ep.tokens is not None:
        sums = ep.token_sums(np.concatenate([counts.ravel(), prob_sums.ravel(), [local_len]]))
        counts, prob_sums = sums[:counts.size].reshape(counts.shape), sums[counts.size:-1].reshape(counts.shape)
        local_len = sums[-1]  # the whole sequence's length
    return counts / (local_len * moe.top_k), prob_sums / local_len


def update_routing_bias(bias, loads, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: after a step, each expert's routing bias moves by
    `rate` towards balance, up for an expert that got fewer than the mean of the step's picks and down for one that
    got more (`loads`: the step's picks per expert over every rank, the same numbers on every rank)."""
    loads = np.asarray(loads, dtype=np.float64)
    step = rate * np.sign(loads.mean() - loads)
    bias += array_module(bias).asarray(step, dtype=bias.dtype)


def _expert_spec(name, full_shape, tp_axis, ep, std) -> ParamSpec:
    """This rank's experts (axis 0, ep) and their etp slice (tp_axis) of a (E, ., .) batch of weights."""
    shape, offset = list(full_shape), [0, 0, 0]
    shape[0], offset[0] = ep.local, ep.first
    shape[tp_axis] //= ep.etp_size
    offset[tp_axis] = ep.etp_rank * shape[tp_axis]
    return ParamSpec(name, tuple(shape), "normal", std, tuple(full_shape), tuple(offset),
                     tp_replicated=ep.etp_size == 1, tp_axis=tp_axis if ep.etp_size > 1 else None,
                     reduce_over="expert_dp" if ep.folded else "dp")


def micro_batch_shares(ep: ExpertParallel, routed, picks: int):
    """f of the balance loss: each expert's share of the micro-batch's picks, whose tokens the cp ranks split."""
    if ep.tokens is None:
        return routed / picks
    sums = ep.token_sums(np.append(routed, picks))
    return sums[:-1] / sums[-1]


def micro_batch_mean_probs(ep: ExpertParallel, probs):
    """P of the balance loss: each expert's mean probability over the micro-batch's tokens (over the cp ranks)."""
    mean = to_host(probs.mean(axis=0))
    if ep.tokens is None:
        return mean
    n = probs.shape[0]
    sums = ep.token_sums(np.append(mean * n, n))
    return sums[:-1] / sums[-1]


class MoE:
    def __init__(self, cfg, moe: MoeSettings, tp, ep: ExpertParallel, index: int = 0):
        c, f, e = cfg.d_model, cfg.ff_dim, moe.experts
        self.index = index  # the block's: names this layer's routing counts in the logged metrics
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.moe, self.tp, self.ep, self.d_model = moe, tp, ep, c
        self.gated, self.local_width = cfg.arch == "llama", f // ep.etp_size
        self.ups = ["expert_w_gate", "expert_w_up"] if self.gated else ["expert_w_fc"]
        self.down = "expert_w_down" if self.gated else "expert_w_proj"
        self.specs = [ParamSpec("router", (c, e), "normal", std)]
        if moe.balance == "bias":  # not learned: moved after each step by the step's loads (update_routing_bias)
            self.specs.append(ParamSpec("router_bias", (e,), "zeros", trainable=False))
        self.specs += [_expert_spec(name, (e, c, f), 2, ep, std) for name in self.ups]
        self.specs.append(_expert_spec(self.down, (e, f, c), 1, ep, out_std))
        self.partial_grads: list[str] = []
        self.expert_weights = [*self.ups, self.down]
        self.adapters: dict = {}  # LoRA (mpitrain/layers/lora.py): expert weight name -> ExpertAdapter
        self.frozen_experts, self.router_trainable = False, True  # LoRA freezes both (the router unless targeted)
        self.fp8 = None  # precision.fp8: the experts' GEMMs in FP8 (mpitrain/layers/fp8.py Fp8Gemms; the router not)

    # -- routing (every tp rank the same)
    def _route(self, params, x2d):
        xp, moe, n = array_module(x2d), self.moe, x2d.shape[0]
        x_router, w_router = x2d, params["router"]
        if x2d.dtype.itemsize < 4:  # the router in float32 (Switch's selective precision): bf16 logits would tie
            x_router, w_router = x2d.astype(np.float32), w_router.astype(np.float32)
        logits = ops.linear_forward(x_router, w_router)[0]
        top = logits.max(axis=-1, keepdims=True)
        probs = xp.exp(logits - top)
        total = probs.sum(axis=-1, keepdims=True)
        probs /= total
        lse = (top + xp.log(total))[:, 0]
        scores = to_host(probs)
        if "router_bias" in params:  # bias balancing: the bias steers the choice, the gates stay the probabilities
            scores = scores + to_host(params["router_bias"]).astype(scores.dtype)
        picks = np.argsort(-scores, axis=1, kind="stable")[:, :moe.top_k]  # ties: the lower expert
        # picks in GShard's priority order: all first choices (token order), then all second choices, ...
        token = np.tile(np.arange(n), moe.top_k)
        expert = picks.T.reshape(-1)
        rank_of = np.repeat(np.arange(moe.top_k), n)
        routed = np.bincount(expert, minlength=moe.experts)
        keep = np.ones(expert.size, bool)
        if moe.capacity_factor > 0:
            capacity = math.ceil(moe.capacity_factor * n * moe.top_k / moe.experts)
            order = np.argsort(expert, kind="stable")
            place = np.empty(expert.size, np.int64)
            place[order] = np.arange(expert.size) - np.repeat(np.cumsum(routed) - routed, routed)
            keep = place < capacity
        order = np.argsort(expert[keep], kind="stable")  # by expert, priority order within
        picked = {"token": token[keep][order], "expert": expert[keep][order], "rank": rank_of[keep][order]}
        picked["gate"] = probs[picked["token"], picked["expert"]]
        shares = micro_batch_shares(self.ep, routed, n * moe.top_k)  # the whole micro-batch's, over cp
        return probs, lse, picked, shares, (token, expert)

    def forward(self, params, x, ctx=None):
        h = self.tp.enter(x)
        x2d = h.reshape(-1, self.d_model)
        n, xp = x2d.shape[0], array_module(x2d)
        probs, lse, picked, shares, routed = self._route(params, x2d)
        mine = self.ep.my_picks(picked["token"], n)  # etp = 1 < tp: this tp rank's share of the tokens
        sent = {key: value[mine] for key, value in picked.items()}
        routing = self.ep.route(np.bincount(sent["expert"], minlength=self.moe.experts))
        rows = self.ep.dispatch(x2d[sent["token"]], routing, self.moe.dispatch_dtype)  # fp8: e4m3 on the wire
        expert_out, expert_saved = self._experts_forward(params, rows, routing)
        out = self.ep.combine(expert_out, routing)  # (sent picks, C), partial over tp (etp, or the token shares)
        y = xp.zeros_like(x2d)
        for j in range(self.moe.top_k):  # one pick per token per rank j: plain fancy-index adds, fixed order
            rank_j = sent["rank"] == j
            y[sent["token"][rank_j]] += sent["gate"][rank_j, None] * out[rank_j]
        y = self.tp.exit(y.reshape(h.shape))
        seq_shares, seq_probs = sequence_statistics(self.ep, routed, probs, h.shape[0], self.moe)
        losses = {"balance": self.moe.experts * float(shares @ micro_batch_mean_probs(self.ep, probs)),
                  "seq_balance": self.moe.experts * float((seq_shares * seq_probs).sum(axis=1).mean()),
                  "z": float((lse * lse).mean())}
        if ctx is not None and ctx.get("loss_scale") is not None and "aux_losses" in ctx:  # training: log them
            self._record(ctx["aux_losses"], n, losses, np.bincount(routed[1], minlength=self.moe.experts),
                         dropped=routed[0].size - picked["token"].size)
        saved = {"h": h, "probs": probs, "lse": lse, "picked": picked, "shares": shares, "seq_shares": seq_shares,
                 "mine": mine, "routing": routing, "experts": expert_saved, "out": out,
                 "loss_scale": (ctx or {}).get("loss_scale")}
        return y, saved

    def _record(self, record: dict, n: int, losses: dict, counts, dropped: int) -> None:
        """Adds this micro-batch's auxiliary losses (their share of the loss sum: n tokens times the mean) and this
        layer's picks per expert of this rank's tokens (before capacity: whole numbers, exact in any sum) and
        dropped picks to the step's record."""
        moe = self.moe
        weighted = moe.batch_aux_loss * losses["balance"] + moe.seq_aux_loss * losses["seq_balance"]
        record["weighted"] = record.get("weighted", 0.0) + n * (weighted + moe.z_loss * losses["z"])
        for key, value in losses.items():
            record[key] = record.get(key, 0.0) + n * value
        record["layers"] = record.get("layers", 0) + 1
        for key, value in (("routed", counts), ("dropped", dropped)):
            per_layer = record.setdefault(key, {})
            per_layer[self.index] = per_layer.get(self.index, 0) + value

    def _experts_forward(self, params, rows, routing):
        """Each of this rank's experts on its block of the expert-major rows (a block may be empty)."""
        xp = array_module(rows)
        outputs, saved, start = [], [], 0
        for e, count in enumerate(routing.per_local_expert):
            block = rows[start:start + int(count)]
            start += int(count)
            ups = [self._expert_linear(params, w, e, block) for w in self.ups]
            act, act_saved = ops.swiglu_forward(*ups) if self.gated else ops.gelu_forward(ups[0])
            outputs.append(self._expert_linear(params, self.down, e, act))
            saved.append((block, act_saved, act))
        out = xp.concatenate(outputs) if outputs else rows[:0]
        return out, saved

    def _expert_linear(self, params, weight: str, e: int, x):
        """x W[e], plus its LoRA adapter's term where it has one."""
        keys = self._fp8_keys(weight, e)  # FP8 on a GPU: cuBLASLt where the expert's rows allow (layers/fp8_lt.py)
        y = fp8_lt.linear_forward(self.fp8, keys, *self._fp8_operands(weight, e, x, params[weight][e]))[0].astype(
            x.dtype, copy=False)
        if weight in self.adapters:
            self.adapters[weight].add_forward(params, e, x, y)
        return y

    def _fp8_keys(self, weight: str, e: int) -> tuple[str, str]:
        """The Fp8Gemms keys of expert e's GEMM input and weight (gate and up share their input and its scale),
        named by the global expert: layout-independent checkpoints."""
        shared = self.ups[0] if weight in self.ups else weight
        return f"{shared}.{self.ep.first + e}.x", f"{weight}.{self.ep.first + e}"

    def _fp8_operands(self, weight: str, e: int, x, w):
        """Expert e's GEMM input and weight: as they are, or their fp8 values (up/gate split over etp by output
        columns, down by input rows)."""
        if self.fp8 is None:
            return x, w
        x_key, w_key = self._fp8_keys(weight, e)
        return self.fp8.inputs([x_key], [x])[0], self.fp8.weights([w_key], [w], -1 if weight in self.ups else -2)[0]

    def _expert_linear_backward(self, params, grads, weights: list[str], e: int, x, d_ys):
        """The input gradient of expert e's linears `weights` (one input x, outputs' gradients d_ys); their weight
        gradients (none when frozen) and their adapters' gradients added."""
        gemm_input, gemm_weights = x, [params[w][e] for w in weights]
        gemm_grads = list(d_ys)
        keys = [self._fp8_keys(w, e) for w in weights]  # (input, weight) per linear
        grad_keys = [f"{key}.dy" for _, key in keys]
        if self.fp8 is not None:
            gemm_input = self.fp8.inputs([keys[0][0]], [x])[0]
            gemm_weights = self.fp8.weights([key for _, key in keys], gemm_weights,
                                            -1 if weights[0] in self.ups else -2)
            gemm_grads = self.fp8.output_grads(grad_keys, gemm_grads)
        dx = fp8_lt.linear_input_grad(self.fp8, [key for _, key in keys], gemm_weights, grad_keys, gemm_grads).astype(
            x.dtype, copy=False)
        for w, dy, gemm_grad, (x_key, _), dy_key in zip(weights, d_ys, gemm_grads, keys, grad_keys):
            if not self.frozen_experts:
                fp8_lt.add_weight_grad(self.fp8, (x_key, dy_key), grads[w][e], gemm_input, gemm_grad)
            if w in self.adapters:
                dx += self.adapters[w].backward(params, grads, e, x, dy)
        return dx

    def _experts_backward(self, params, grads, experts_saved, d_out, routing):
        xp = array_module(d_out)
        d_rows, start = [], 0
        for e, (block, act_saved, act) in enumerate(experts_saved):
            d_block = d_out[start:start + block.shape[0]]
            start += block.shape[0]
            d_act = self._expert_linear_backward(params, grads, [self.down], e, act, [d_block])
            d_ups = ops.swiglu_backward(act_saved, d_act) if self.gated else [ops.gelu_backward(act_saved, d_act)]
            d_rows.append(self._expert_linear_backward(params, grads, self.ups, e, block, d_ups))
        return xp.concatenate(d_rows) if d_rows else d_out[:0]

    def backward(self, params, grads, saved, dy, deferred=None):
        moe, picked, probs = self.moe, saved["picked"], saved["probs"]
        xp = array_module(probs)
        x2d = saved["h"].reshape(-1, self.d_model)
        d_y = self.tp.exit_backward(dy).reshape(-1, self.d_model)
        sent = {key: value[saved["mine"]] for key, value in picked.items()}
        d_token = d_y[sent["token"]]
        d_gate = xp.zeros(picked["token"].shape, d_token.dtype)  # picks of the other tp ranks' token shares: 0
        d_gate[saved["mine"]] = (d_token * saved["out"]).sum(axis=-1)  # this tp rank's part of <dy, expert output>
        self.tp.all_reduce(d_gate)
        routing = saved["routing"]
        d_rows = self.ep.dispatch((sent["gate"][:, None] * d_token).astype(d_token.dtype), routing)  # wire dtype
        d_in = self.ep.combine(self._experts_backward(params, grads, saved["experts"], d_rows, routing), routing)
        dx = xp.zeros_like(x2d)
        for j in range(moe.top_k):
            rank_j = sent["rank"] == j
            dx[sent["token"][rank_j]] += d_in[rank_j]
        d_probs = xp.zeros_like(probs)
        d_probs[picked["token"], picked["expert"]] = d_gate
        scale = saved["loss_scale"] or 0.0  # d(loss)/d(loss sum), as the head receives it
        d_probs += scale * moe.batch_aux_loss * moe.experts * xp.asarray(saved["shares"], dtype=probs.dtype)
        if moe.seq_aux_loss:  # each token's row: its sequence's shares (the mean over the sequence's tokens)
            seq_term = np.repeat(saved["seq_shares"], probs.shape[0] // len(saved["seq_shares"]), axis=0)
            d_probs += scale * moe.seq_aux_loss * moe.experts * xp.asarray(seq_term, dtype=probs.dtype)
        d_logits = probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))
        d_logits += (2.0 * scale * moe.z_loss) * saved["lse"][:, None] * probs
        if self.router_trainable:
            ops.add_weight_grad(grads["router"], x2d, d_logits)
        if self.tp.rank == 0:  # the same on every tp rank: entered once into the region's gradient sum
            dx += ops.linear_input_grad([params["router"]], [d_logits])
        return self.tp.start_enter_backward(dx.reshape(saved["h"].shape)).wait()

    # -- selective recomputation (mpitrain/layers/recompute.py): keep the routing and the experts' inputs
    def keep_selective(self, saved) -> dict:
        """What a selective block keeps of `saved`: the router's probabilities and log-sum-exp, the picks and the
        exchange's counts, the experts' dispatched inputs and nonlinearity inputs, the combined expert output. Dropped
        (recomputed without a matmul or an exchange): the entered input and each nonlinearity's output."""
        kept = {key: value for key, value in saved.items() if key != "h"}
        kept["experts"] = [(block, act_saved) for block, act_saved, _ in saved["experts"]]
        return kept

    def restore_selective(self, kept, normed) -> dict:
        """The saved state of the forward, from `kept` and the recomputed norm output `normed` (entered again)."""
        experts = [(block, act_saved, self._activation(act_saved)) for block, act_saved in kept["experts"]]
        return {**kept, "h": self.tp.enter(normed), "experts": experts}

    def _activation(self, act_saved):
        return ops.swiglu_forward(*act_saved)[0] if self.gated else ops.gelu_forward(act_saved)[0]

    def selective_saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """saved_arrays less the entered input and the nonlinearity's output."""
        arrays = self.saved_arrays(batch, seq_len, dtype)[1:]
        del arrays[-2]
        return arrays

    def saved_arrays(self, batch: int, seq_len: int, dtype) -> list:
        """The entered input, router probabilities, and per pick (N*k, balanced routing assumed) the routed row,
        the activation's input(s) and output, and the expert output."""
        n, e = batch * seq_len, self.moe.experts
        picks = n * self.moe.top_k // self.ep.shares  # etp = 1 < tp: this tp rank's share of the tokens
        hidden = ((picks, self.local_width), dtype)
        return [((batch, seq_len, self.d_model), dtype), ((n, e), dtype), ((picks, self.d_model), dtype),
                *[hidden] * (2 if self.gated else 1), hidden, ((picks, self.d_model), dtype)]
