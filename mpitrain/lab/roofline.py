"""The roofline: a decode step (batch 1, KV cache) is memory-bound, a training step compute-bound.

A kernel that does F FLOPs while moving B bytes has arithmetic intensity I = F / B. On a machine of matmul peak P
(FLOP/s) and memory bandwidth W (bytes/s) it runs at most at min(P, W I) FLOP/s: below the ridge I = P / W it is
limited by memory, above it by compute. P and W are measured as `mpitrain plan calibrate` measures them
(profile/flops.measure_matmul_peak on one rank's thread, profile/comm_bench.memcpy_bandwidth; a copy reads and
writes each byte).

The counting model, in the compute dtype's b bytes per element, N = the matmul weights (the blocks' Q, K, V, O and
MLP weights and the output projection; profile/flops.block_matmul_weights), kv = n_kv_head x head_dim:
  decode, one token against a cache of L positions (its own included):
    FLOPs = 2 N + 4 n_layer d L          (every weight once; q.k and p.v over L keys per layer)
    bytes = b (N + 2 n_layer kv L + 2 n_layer kv)   (weights read, the cache's K and V read, the new K and V written;
                                                     norms, biases, one embedding row and the token's activations,
                                                     a few d-vectors, left out)
  training, forward + backward of one micro-batch of B x T tokens (the optimizer's update, once per step, left out):
    FLOPs = (6 N + 12 n_layer d T) B T   (GPT.flops_per_token, the basis of MFU)
    bytes = b (2 P + 2 P) + 2 S          (all P parameters read in forward and in backward, gradients read and
                                          written once, the saved state S written in forward and read in backward)
Measured side of the checks: the weights the model's layouts hold, the bytes and keys the KV cache counts as it is
used (layers/kv_cache.py), the arrays the training forward really saved, the state's buffers; times are shown only.
"""
from __future__ import annotations

import math
import time

from mpitrain.config import load_config
from mpitrain.lab.runner import Row
from mpitrain.layers.kv_cache import KVCache
from mpitrain.profile.flops import block_matmul_weights, measure_matmul_peak

NAME = "roofline"
TITLE = "Roofline: decode (batch 1, KV cache) is memory-bound, training compute-bound"
PANELS = 2
DECODE_BOUND = 1.0  # FLOP/byte: below every ridge (a ridge under 1 would need more bytes/s than FLOP/s)
TRAINING_BOUND = 25.0  # FLOP/byte: above a CPU core's ridge (this VM ~8; one core in float32 is typically 5-20)
NOTICE = ("What to notice: a decode step reads every weight to do 2 FLOPs with it (a 4-byte float32 weight: "
          "intensity about 0.5 FLOP/byte), so it sits far left of the ridge and its speed is the memory's; a "
          "training micro-batch reuses each weight for all B x T tokens, so it sits right of the ridge. The checked "
          f"bounds are fixed, not the measured ridge: decode below {DECODE_BOUND:g} FLOP/byte (under any machine's "
          f"ridge), training above {TRAINING_BOUND:g} (above a CPU core's). On a GPU (ridge ~300 FLOP/byte in "
          "bf16) this small model's training would itself be memory-bound: the claim is about large batches. On "
          "a CPU a tiny decode step is also slowed by Python's per-op overhead, so it lands below the roof.")


def ranks(quick: bool) -> int:
    return 1


def _config(quick: bool):
    return load_config("configs/bench-small.toml", ["precision.compute=float32", "data.synthetic=true"] + (
        ["model.n_layer=2", "model.seq_len=128", "train.micro_batch=4"] if quick else []))


def matmul_weights(model) -> int:
    """N counted from the tensors the model holds: the 2-D weights of the blocks and the head, plus the tied
    embedding table when the head projects with it (a lookup of the embedding is no matmul)."""
    held = sum(math.prod(spec.shape) for unit in model.units[1:] for spec in unit.layout.specs
               if len(spec.shape) == 2)
    return held + (model.cfg.vocab_size * model.cfg.d_model if model.units[-1].head.tied else 0)


def job(world, quick: bool):
    import numpy as np

    from mpitrain.backend import make_backend
    from mpitrain.model.gpt import GPT
    from mpitrain.profile.comm_bench import memcpy_bandwidth
    from mpitrain.state.inference import InferenceState
    from mpitrain.state.replicated import ReplicatedState

    cfg = _config(quick)
    m = cfg.model
    backend = make_backend("cpu", "float32")
    model = GPT(m, backend)
    trained = ReplicatedState(model.layouts, backend, seed=0)
    serving = InferenceState(model.layouts, backend)  # what `mpitrain generate` holds: the weights only
    serving.params.data[...] = trained.params.data
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (cfg.train.micro_batch, m.seq_len))
    return {"peak": measure_matmul_peak(backend, n=512, seconds=0.5 if quick else 1.0),
            "bandwidth": memcpy_bandwidth() * 1e9 * 2,  # as plan calibrate: a copy reads and writes each byte
            "n_formula": m.n_layer * block_matmul_weights(m) + m.vocab_size * m.d_model,
            "n_counted": matmul_weights(model), "n_params": model.n_params,
            "vectors": sum(spec.size for layout in model.layouts for spec in layout.specs if len(spec.shape) == 1),
            "itemsize": np.dtype(backend.dtype).itemsize, "n_layer": m.n_layer, "d": m.d_model,
            "kv": m.kv_heads * m.head_dim, "batch": cfg.train.micro_batch, "seq": m.seq_len,
            "training": _training(model, trained, tokens, 3 if quick else 5),
            "decode": _decode(model, serving, tokens[0, :m.seq_len // 2].tolist(), m.seq_len // (4 if quick else 2)),
            "tokens_per_s": _generation(model, serving, tokens[0, :m.seq_len // 2].tolist(),
                                        m.seq_len // (4 if quick else 2))}


def _training(model, state, tokens, repeats: int) -> dict:
    """Forward + backward of one micro-batch, the best of `repeats` (the first allocates)."""
    import numpy as np

    from mpitrain.backend import nbytes_of
    best = math.inf
    for _ in range(repeats):
        state.zero_grads()
        start = time.perf_counter()
        _, saved = model.forward(state, tokens, np.roll(tokens, -1, axis=1))
        held = nbytes_of(saved)
        model.backward(state, saved, 1.0 / tokens.size)
        best = min(best, time.perf_counter() - start)
    return {"flops_per_token": model.flops_per_token(tokens.shape[1]), "seconds": best, "saved": held,
            "saved_declared": sum(model.saved_bytes(tokens.shape[0], model.backend.dtype)),
            "params_bytes": state.params.data.nbytes, "grads_bytes": state.grads.data.nbytes}


def _decode(model, state, prompt: list[int], steps: int) -> dict:
    """Batch 1: the prompt prefilled, then `steps` single-token decodes timed; the faster of two runs (a busy moment
    only slows), with what the cache counted during its decodes."""
    import numpy as np

    best = None
    for _ in range(2):
        cache = KVCache.for_model(model.cfg, 1, model.backend)
        model.decode(state, np.asarray([prompt]), cache)
        before, seconds = cache.moved(), 0.0
        for step in range(steps):
            start = time.perf_counter()
            model.decode(state, np.asarray([[prompt[step % len(prompt)]]]), cache)
            seconds += time.perf_counter() - start
        after = cache.moved()
        if best is None or seconds < best["seconds"]:
            best = {"steps": steps, "seconds": seconds, "first_length": len(prompt) + 1, "last_length": cache.length,
                    "flops": 2 * steps * matmul_weights(model)
                    + 4 * model.cfg.d_model * (after["keys_attended"] - before["keys_attended"]),
                    "cache_bytes": sum(after[k] - before[k] for k in ("bytes_read", "bytes_written"))}
    return best


def _generation(model, state, prompt: list[int], steps: int) -> dict:
    """Tokens/s of the same greedy generation with and without the cache (prompt + steps within the window)."""
    import numpy as np

    from mpitrain.generate import generate_ids
    speeds = {}
    for kv_cache in (True, False):
        start = time.perf_counter()
        generate_ids(model, state, prompt, steps, lambda logits: int(np.argmax(logits)), kv_cache)
        speeds["cache" if kv_cache else "no cache"] = steps / (time.perf_counter() - start)
    return speeds


def _decode_formula(r: dict) -> tuple[float, float]:
    """(FLOPs, bytes) of the decode run by the formulas: steps with cache lengths first_length..last_length."""
    lengths = range(r["decode"]["first_length"], r["decode"]["last_length"] + 1)
    n, layers, kv, size = r["n_formula"], r["n_layer"], r["kv"], r["itemsize"]
    flops = sum(2 * n + 4 * layers * r["d"] * length for length in lengths)
    moved = sum(size * (n + 2 * layers * kv * length + 2 * layers * kv) for length in lengths)
    return flops, moved


def moved_bytes(r: dict) -> tuple[float, float]:
    """(decode run, training micro-batch) bytes by the counting model, from what was measured: the weights the
    model holds and what the cache counted; the state's buffers read and written twice, the saved state twice."""
    decode = r["decode"]["steps"] * r["itemsize"] * r["n_counted"] + r["decode"]["cache_bytes"]
    tr = r["training"]
    return decode, 2 * tr["params_bytes"] + 2 * tr["grads_bytes"] + 2 * tr["saved"]


def intensities(r: dict) -> tuple[float, float]:
    """(decode, training) FLOP per byte, from the measured counts."""
    decode, training = moved_bytes(r)
    return r["decode"]["flops"] / decode, r["training"]["flops_per_token"] * r["batch"] * r["seq"] / training


def rows(r: dict) -> list[Row]:
    dec, tr = r["decode"], r["training"]
    steps, tokens, ridge = dec["steps"], r["batch"] * r["seq"], r["peak"] / r["bandwidth"]
    flops, moved = _decode_formula(r)
    length = dec["last_length"]
    n, layers, d, seq = r["n_formula"], r["n_layer"], r["d"], r["seq"]
    train_formula = 6 * (n + r["vectors"]) + 12 * layers * d * seq  # MFU's N: the non-embedding parameters
    decode_i, train_i = intensities(r)
    decode_bytes, train_bytes = moved_bytes(r)
    out = [
        Row(f"decode FLOPs / token (mean, L = {dec['first_length']}..{length})", f"2N + 4 n_layer d L, N = {n:,}",
            f"{dec['flops'] / steps:,.0f}", dec["flops"] / steps, flops / steps),
        Row("training FLOPs / token", f"6(N + {r['vectors']:,} norms, biases) + 12 n_layer d s",
            f"{tr['flops_per_token']:,.0f}", tr["flops_per_token"], train_formula),
        Row("decode bytes / step (mean)", "b(N + 2 n_layer kv L + 2 n_layer kv)", f"{decode_bytes / steps:,.0f}",
            decode_bytes / steps, moved / steps),
        Row(f"training bytes / micro-batch ({r['batch']} x {seq})", f"4 b P + 2 S, P = {r['n_params']:,}",
            f"{train_bytes / 1e6:.3f} MB", train_bytes, 4 * r["itemsize"] * r["n_params"] + 2 * tr["saved_declared"]),
        Row("decode is memory-bound", f"I < {DECODE_BOUND:g} FLOP/B (any ridge)",
            f"I = {decode_i:.3f} FLOP/B (ridge here {ridge:.1f})", float(decode_i < DECODE_BOUND), 1.0),
        Row("training is compute-bound", f"I > {TRAINING_BOUND:g} FLOP/B (a CPU core's ridge)",
            f"I = {train_i:.1f} FLOP/B (ridge here {ridge:.1f})", float(train_i > TRAINING_BOUND), 1.0),
        Row("this machine's roof", "ridge = peak / bandwidth",
            f"{r['peak'] / 1e9:.1f} GFLOP/s / {r['bandwidth'] / 1e9:.1f} GB/s = {ridge:.1f} FLOP/B"),
    ]
    decode_s, train_s = dec["seconds"], tr["seconds"]
    out += [
        Row("decode runs at the memory's speed", "bytes/s -> bandwidth",
            f"{decode_bytes / decode_s / 1e9:.2f} GB/s ({100 * decode_bytes / decode_s / r['bandwidth']:.0f}%), "
            f"{dec['flops'] / decode_s / 1e9:.2f} GFLOP/s ({100 * dec['flops'] / decode_s / r['peak']:.1f}%)"),
        Row("training runs at the matmuls' speed", "FLOP/s -> peak",
            f"{tr['flops_per_token'] * tokens / train_s / 1e9:.1f} GFLOP/s "
            f"({100 * tr['flops_per_token'] * tokens / train_s / r['peak']:.0f}% of peak)"),
        Row("KV cache speeds up generation", "work per token: 1 position, not the window",
            f"{r['tokens_per_s']['cache']:.0f} vs {r['tokens_per_s']['no cache']:.0f} tokens/s "
            f"({r['tokens_per_s']['cache'] / r['tokens_per_s']['no cache']:.1f}x)"),
    ]
    return out


def plot(r: dict, axes) -> None:
    import numpy as np
    ridge = r["peak"] / r["bandwidth"]
    x = np.logspace(-2, 3, 200)
    axes[0].loglog(x, np.minimum(r["peak"], r["bandwidth"] * x) / 1e9, "k-", lw=1.5, label="roof: min(peak, bw I)")
    axes[0].axvline(ridge, color="grey", ls=":", lw=1, label=f"ridge {ridge:.1f} FLOP/B")
    decode_i, train_i = intensities(r)
    tokens = r["batch"] * r["seq"]
    points = (("decode (batch 1)", decode_i, r["decode"]["flops"] / r["decode"]["seconds"], "tab:blue"),
              ("training micro-batch", train_i,
               r["training"]["flops_per_token"] * tokens / r["training"]["seconds"], "tab:red"))
    for label, intensity, achieved, colour in points:
        axes[0].loglog([intensity], [achieved / 1e9], "o", color=colour, label=label)
    axes[0].set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="GFLOP/s", title="measured, under this roof")
    axes[0].legend(fontsize=7)
    speeds = r["tokens_per_s"]
    axes[1].bar(list(speeds), list(speeds.values()), color=["tab:blue", "tab:grey"])
    axes[1].set(ylabel="tokens / s (batch 1)", title="generation with and without KV cache")
