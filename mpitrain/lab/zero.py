"""ZeRO: per-rank state bytes fall as 1/N of the sharded parts; ZeRO-3 moves 1.5x the bytes of plain DP.

State bytes are the arrays the state strategies really allocate (bfloat16 weights/grads, fp32 master and Adam
moments; building the state is enough). Traffic is what the comm groups' byte counters saw during one float32 step.
"""
from __future__ import annotations

from mpitrain.config import load_config, resolve_layout
from mpitrain.lab.runner import Row

NAME = "zero"
TITLE = "ZeRO-1/2/3: state bytes per rank and bytes moved per step"
PANELS = 2
NOTICE = ("What to notice: the bytes per rank follow the formulas to the byte (padding aside) because they are the "
          "arrays the strategies allocate: ZeRO-1 splits the 12 optimizer bytes, ZeRO-2 also the gradients, ZeRO-3 "
          "everything. Plain DP, ZeRO-1 and ZeRO-2 move the same 2(N-1)/N Psi per step (a reduce-scatter plus an "
          "all-gather is an all-reduce); ZeRO-3 gathers the parameters again for backward, hence 1.5x.")
# bytes per parameter kept between steps at bfloat16: (whole, sharded over N), mpitrain/plan/memory.py's table
STATE = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}
TRAFFIC_FACTOR = {0: 2, 1: 2, 2: 2, 3: 3}  # x (N-1)/N Psi per rank and step, ring algorithms


def ranks(quick: bool) -> int:
    return 2 if quick else 4


def _config(quick: bool, n: int, stage: int, compute: str):
    return load_config("configs/tiny.toml" if quick else "configs/bench-small.toml", [
        "data.synthetic=true", f"parallel.zero={stage}", "train.micro_batch=1", f"train.global_batch={n}",
        f"precision.compute={compute}", "logging.peak_flops=1e9"])


def job(world, quick: bool):
    from mpitrain.backend import make_backend
    from mpitrain.comm.mesh import Mesh
    from mpitrain.model.gpt import GPT
    from mpitrain.optim.adamw import AdamW, AdamWHyper
    from mpitrain.state.factory import make_state
    from mpitrain.train import Trainer
    n, out = world.size, {"n": world.size, "stages": {}}
    for stage in STATE:
        cfg = _config(quick, n, stage, "bfloat16")
        resolve_layout(cfg, n)
        backend = make_backend("cpu", "bfloat16")
        model = GPT(cfg.model, backend)
        state = make_state(cfg, model, backend, Mesh(world, dp=n))
        held = state.memory()
        held_total = sum(held.values()) + AdamW(state.optimizer_segments(), AdamWHyper()).state_nbytes()
        trainer = Trainer(_config(quick, n, stage, "float32"), world)
        trainer.train_step(0)  # the first step allocates; the second is the one measured
        step = trainer.train_step(1)
        moved = sum(v for k, v in step.comm_bytes.items() if k != "control")
        out["stages"][stage] = {"held": held_total, "moved": moved, "seconds": step.seconds}
        out.update(psi=model.n_params, units=len(model.layouts))
    return out if world.rank == 0 else None


def rows(result: dict) -> list[Row]:
    n, psi, units = result["n"], result["psi"], result["units"]
    padding = 16 * n * units  # at most n-1 padding elements per unit and array, 4 arrays of <= 4 bytes
    out = []
    for stage, (whole, sharded) in STATE.items():
        held = result["stages"][str(stage)]["held"]
        formula = " + ".join(([str(whole)] if whole else []) + ([f"{sharded}/N"] if sharded else []))
        expected = (whole + sharded / n) * psi
        out.append(Row(f"ZeRO-{stage} state per rank, N={n}", f"({formula}) B x Psi = {expected / 1e6:.3f} MB",
                       f"{held / 1e6:.3f} MB", held, expected, padding))
    psi_bytes = 4 * psi  # float32 parameters
    for stage, factor in TRAFFIC_FACTOR.items():
        moved = result["stages"][str(stage)]["moved"]
        expected = factor * (n - 1) / n * psi_bytes
        out.append(Row(f"ZeRO-{stage} bytes moved per rank and step", f"{factor}(N-1)/N Psi = {expected / 1e6:.3f} MB",
                       f"{moved / 1e6:.3f} MB", moved, expected, factor * 4 * n * units))
    ratio = result["stages"]["3"]["moved"] / result["stages"]["0"]["moved"]
    out.append(Row("ZeRO-3 moves 1.5x DP", "3 / 2 = 1.5", f"{ratio:.4f}", ratio, 1.5, 4 * n * units * 3 / psi_bytes))
    seconds = [result["stages"][str(s)]["seconds"] for s in STATE]
    out.append(Row("step time ZeRO-0/1/2/3 (float32)", "time: shown, not checked",
                   " / ".join(f"{s * 1e3:.0f} ms" for s in seconds)))
    return out


def plot(result: dict, axes) -> None:
    n, psi = result["n"], result["psi"]
    stages = list(STATE)
    held = [result["stages"][str(s)]["held"] / psi for s in stages]
    formula = [STATE[s][0] + STATE[s][1] / n for s in stages]
    axes[0].bar(stages, held, color="tab:blue", label="measured")
    axes[0].plot(stages, formula, "k_", markersize=30, label="formula")
    axes[0].set(xlabel="ZeRO stage", ylabel="state bytes / parameter", title=f"state per rank, N={n} (bf16)")
    axes[0].legend(fontsize=8)
    moved = [result["stages"][str(s)]["moved"] / (4 * psi) for s in stages]
    axes[1].bar(stages, moved, color="tab:orange", label="measured")
    axes[1].plot(stages, [TRAFFIC_FACTOR[s] * (n - 1) / n for s in stages], "k_", markersize=30, label="formula")
    axes[1].set(xlabel="ZeRO stage", ylabel="bytes moved / Psi", title="traffic per rank and step")
    axes[1].legend(fontsize=8)
