"""Measure first: where a step's time goes, then remove the largest loss and look at what is largest next.

Two ranks of data parallelism, the step broken down by profile/breakdown.py (every moment charged to one part),
with the gradient all-reduce first left to the end of backward (parallel.overlap = false), then overlapped with
backward (the default). Checked: the parts add up to the measured step, and overlapping moves the same bytes
(2(N-1)/N Psi): it changes when the traffic happens, not how much. Shown: the breakdown, the MFU (model FLOPs per
token 6 N + 12 L d s, against this machine's measured matmul peak) and the next suspect.
"""
from __future__ import annotations

from mpitrain.lab.runner import Row

NAME = "mfu"
TITLE = "Measure first: the step breakdown, overlap off -> on, and the next suspect"
PANELS = 1
SETTINGS = (("overlap off", "parallel.overlap=false"), ("overlap on", "parallel.overlap=true"))
NOTICE = ("What to notice: the parts add up to the step by construction, so the largest non-compute part is the "
          "first place to look, and the bytes do not change with overlap: only when they move. On a CPU whose "
          "cores the ranks share, an exposed wait is mostly the peer's compute, so these times are noisy (read them "
          "on a real cluster): a faster step can still show a larger wait share, because the compute around it "
          "shrank. The next suspect is whatever part is now largest.")


def ranks(quick: bool) -> int:
    return 2


def job(world, quick: bool):
    from mpitrain.config import load_config
    from mpitrain.train import Trainer
    out = {"runs": {}}
    for label, setting in SETTINGS:
        cfg = load_config("configs/tiny.toml" if quick else "configs/bench-small.toml", [
            "data.synthetic=true", "precision.compute=float32", setting, "train.micro_batch=2",
            f"train.global_batch={4 * world.size}"])
        trainer = Trainer(cfg, world)
        best = None
        for step in range(3 if quick else 5):
            result = trainer.train_step(step)
            if step > 0 and (best is None or result.seconds < best.seconds):  # the first step allocates
                best = result
        record = trainer.metrics(best)
        out["runs"][label] = {"breakdown": best.breakdown, "mfu": record["mfu"],
                              "moved": sum(v for k, v in best.comm_bytes.items() if k != "control")}
        out.update(psi=trainer.model.n_params, n=world.size)
    return out if world.rank == 0 else None


def _suspect(breakdown: dict) -> tuple[str, float]:
    losses = {k: v for k, v in breakdown.items() if k not in ("step_s", "forward", "backward_input",
                                                              "backward_weight")}
    name = max(losses, key=losses.get)
    return name, losses[name] / breakdown["step_s"]


def rows(result: dict) -> list[Row]:
    n, psi = result["n"], result["psi"]
    out = []
    for label, run in result["runs"].items():
        parts = run["breakdown"]
        total = sum(v for k, v in parts.items() if k != "step_s")
        out.append(Row(f"{label}: parts add up to the step", f"step = {parts['step_s'] * 1e3:.3f} ms",
                       f"{total * 1e3:.3f} ms", total, parts["step_s"], 1e-9 * max(1.0, parts["step_s"])))
        expected = 2 * (n - 1) / n * 4 * psi
        out.append(Row(f"{label}: bytes moved per rank", f"2(N-1)/N Psi = {expected / 1e6:.3f} MB",
                       f"{run['moved'] / 1e6:.3f} MB", run["moved"], expected, 8 * n * 16))
    for label, run in result["runs"].items():
        name, share = _suspect(run["breakdown"])
        compute = sum(run["breakdown"][k] for k in ("forward", "backward_input", "backward_weight"))
        out.append(Row(f"{label}: largest loss", "max over non-compute parts",
                       f"{name} {100 * share:.0f}% (compute {100 * compute / run['breakdown']['step_s']:.0f}%, "
                       f"MFU {100 * run['mfu']:.1f}%)"))
    return out


def plot(result: dict, axes) -> None:
    labels = list(result["runs"])
    parts = sorted({k for run in result["runs"].values() for k, v in run["breakdown"].items()
                    if k != "step_s" and v > 0})
    bottom = [0.0] * len(labels)
    colours = __import__("matplotlib").colormaps["tab20"]
    for i, part in enumerate(parts):
        values = [1e3 * result["runs"][label]["breakdown"].get(part, 0.0) for label in labels]
        axes[0].barh(labels, values, left=bottom, color=colours(i % 20), label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].set(xlabel="ms per step (rank 0)", title="step breakdown")
    axes[0].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
