"""Activation recomputation: full keeps only each block's input (activations divided by ~10 in the chapter's
models, here by what this model's shapes give), at the price of one more forward (time up by about a third);
selective drops the attention internals only.

Checked: the bytes the saved state really holds equal the layers' declaration that `mpitrain memory` counts.
Times (forward + backward, best of a few, the modes taking turns) are shown, not checked.
"""
from __future__ import annotations

import time

from mpitrain.config import load_config
from mpitrain.lab.runner import Row
from mpitrain.profile.flops import recomputed_flops_per_token

NAME = "recompute"
TITLE = "Recomputation: activation bytes and step time, none / selective / full"
PANELS = 2
NOTICE = ("What to notice: full recomputation keeps only each block's input, so the saved state falls by the ratio "
          "of a block's activations to its input (larger for wider models and longer sequences); it "
          "costs one more forward, about a third more time. Selective drops the attention "
          "internals (the T x T scores) for little time. The time ratios are noisy on a loaded machine.")
MODES = ("none", "selective", "full")


def ranks(quick: bool) -> int:
    return 1


def job(world, quick: bool):
    import numpy as np

    from mpitrain.backend import make_backend, nbytes_of
    from mpitrain.layers.recompute import apply_recompute
    from mpitrain.model.gpt import GPT
    from mpitrain.plan.memory import activation_bytes
    from mpitrain.state.replicated import ReplicatedState
    runs = {}
    for mode in MODES:
        cfg = load_config("configs/tiny.toml" if quick else "configs/bench-small.toml",
                          [f"memory.recompute={mode}", "train.micro_batch=2", "precision.compute=float32"])
        backend = make_backend("cpu", "float32")
        model = GPT(cfg.model, backend)
        apply_recompute(model, mode)
        runs[mode] = (cfg, model, ReplicatedState(model.layouts, backend, 0))
    out = {mode: {"declared": activation_bytes(cfg, 2), "seconds": float("inf")} for mode, (cfg, _, _) in runs.items()}
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    for _ in range(3 if quick else 5):
        for mode, (_, model, state) in runs.items():  # modes take turns, so a busy moment hits them alike
            start = time.perf_counter()
            _, saved = model.forward(state, tokens, np.roll(tokens, -1, axis=1))
            out[mode]["held"] = nbytes_of(saved)
            model.backward(state, saved, 1.0 / tokens.size)
            out[mode]["seconds"] = min(out[mode]["seconds"], time.perf_counter() - start)
    for mode, (cfg, model, _) in runs.items():  # FLOPs per token: the model's, plus what recomputation repeats
        extra = recomputed_flops_per_token(cfg.model, [cfg.model.n_layer], mode)
        out[mode]["flops_ratio"] = (model.flops_per_token() + extra) / model.flops_per_token()
    return out


def rows(result: dict) -> list[Row]:
    out = [Row(f"{mode}: saved state of one micro-batch", f"layers' saved_arrays = {r['declared'] / 1e3:.1f} kB",
               f"{r['held'] / 1e3:.1f} kB", r["held"], r["declared"]) for mode, r in result.items()]
    none = result["none"]
    for mode, claim in (("full", "full: activations / ~10, time x ~1.33"),
                        ("selective", "selective: attention internals dropped, little time")):
        r = result[mode]
        out.append(Row(claim, f"none / mode; time ~ FLOPs x {r['flops_ratio']:.2f}",
                       f"/ {none['held'] / r['held']:.1f}; time x {r['seconds'] / none['seconds']:.2f}"))
    return out


def plot(result: dict, axes) -> None:
    modes = list(MODES)
    axes[0].bar(modes, [result[m]["held"] / 1e3 for m in modes], color="tab:blue")
    axes[0].set(ylabel="saved state per micro-batch (kB)", title="activation memory")
    axes[1].bar(modes, [result[m]["seconds"] / result["none"]["seconds"] for m in modes], color="tab:orange")
    axes[1].axhline(4 / 3, color="k", ls="--", lw=1, label="4/3 (one more forward)")
    axes[1].set(ylabel="forward+backward time / none", title="time (measured, not checked)")
    axes[1].legend(fontsize=8)
