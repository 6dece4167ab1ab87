"""Training holds about 16 bytes per parameter (bf16 weights and grads, fp32 master, Adam's m and v); serving holds
the bf16 weights only, about 2. Measured: the arrays the training state and the optimizer allocate, and the
weights buffer a forward pass reads, for the same model.
"""
from __future__ import annotations

from mpitrain.config import load_config, resolve_layout
from mpitrain.lab.runner import Row

NAME = "memory"
TITLE = "Training ~16 bytes per parameter, serving ~2"
PANELS = 1
NOTICE = ("What to notice: training holds 2 (bf16 weights) + 2 (grads) + 4 (fp32 master) + 8 (Adam m and v) = 16 "
          "bytes per parameter before any activation; a forward pass for serving reads only the 2-byte weights "
          "(`mpitrain generate` holds just those: state/inference.py, plus its KV cache).")


def ranks(quick: bool) -> int:
    return 1


def job(world, quick: bool):
    from mpitrain.backend import make_backend
    from mpitrain.comm.mesh import Mesh
    from mpitrain.model.gpt import GPT
    from mpitrain.optim.adamw import AdamW, AdamWHyper
    from mpitrain.state.factory import make_state
    from mpitrain.state.inference import InferenceState
    cfg = load_config("configs/tiny.toml" if quick else "configs/bench-small.toml", ["precision.compute=bfloat16"])
    resolve_layout(cfg, 1)
    backend = make_backend("cpu", "bfloat16")
    model = GPT(cfg.model, backend)
    state = make_state(cfg, model, backend, Mesh(world, dp=1))
    held = dict(state.memory())
    held["optimizer"] = AdamW(state.optimizer_segments(), AdamWHyper()).state_nbytes()
    serving = InferenceState(model.layouts, backend).memory()["params"]  # what `mpitrain generate` allocates
    return {"psi": model.n_params, "training": held, "serving": serving}


def rows(result: dict) -> list[Row]:
    psi, held = result["psi"], result["training"]
    out = [Row(f"training {kind}", f"{per} B x Psi = {per * psi / 1e6:.3f} MB", f"{held[kind] / 1e6:.3f} MB",
               held[kind], per * psi) for kind, per in (("params", 2), ("grads", 2), ("master", 4), ("optimizer", 8))]
    training = sum(held.values())
    out.append(Row("training total", "16 B / parameter", f"{training / psi:.3f} B / parameter", training / psi, 16))
    out.append(Row("serving (weights only)", "2 B / parameter", f"{result['serving'] / psi:.3f} B / parameter",
                   result["serving"] / psi, 2))
    return out


def plot(result: dict, axes) -> None:
    psi, held = result["psi"], result["training"]
    bottom = 0.0
    for kind, colour in zip(("params", "grads", "master", "optimizer"), ("tab:blue", "tab:cyan", "tab:orange",
                                                                        "tab:red")):
        axes[0].bar(["training"], [held[kind] / psi], bottom=bottom, color=colour, label=kind)
        bottom += held[kind] / psi
    axes[0].bar(["serving"], [result["serving"] / psi], color="tab:blue")
    axes[0].set(ylabel="bytes per parameter", title=f"Psi = {psi:,} parameters (bf16)")
    axes[0].legend(fontsize=8)
