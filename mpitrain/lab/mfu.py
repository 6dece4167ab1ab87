"""Measure first: where a step's time goes, then remove the largest loss and look at what is largest next.

Two ranks of data parallelism, the step broken down by profile/breakdown.py (every moment charged to one part),
with the gradient all-reduce first left to the end of backward (parallel.overlap = false), then overlapped with
backward (the default), then, the all-reduce still being the largest loss, the next change the chapter suggests:
4x the micro-batches per step (gradient accumulation), which spreads the same once-per-step all-reduce and optimizer
update over 4x the tokens. Checked: the parts add up to the measured step, and every setting moves the same bytes
per step (2(N-1)/N Psi): overlap changes when the traffic happens, accumulation how many tokens share it, neither
how much. Shown: the breakdown, the MFU (model FLOPs per token 6 N + 12 L d s, against this machine's measured
matmul peak) and what became largest next.
"""
from __future__ import annotations

from mpitrain.config import load_config
from mpitrain.lab.runner import Row
from mpitrain.profile.breakdown import COMPUTE_PARTS
from mpitrain.profile.flops import measure_matmul_peak

NAME = "mfu"
TITLE = "Measure first: the step breakdown, overlap off -> on, then 4x micro-batches per step"
PANELS = 1
# label, setting, micro-batches per rank and step (gradient accumulation)
SETTINGS = (("overlap off", "parallel.overlap=false", 2), ("overlap on", "parallel.overlap=true", 2),
            ("overlap on, 4x micro-batches", "parallel.overlap=true", 8))
NOTICE = ("What to notice: the parts add up to the step by construction, so the largest non-compute part is the "
          "first place to look, and the bytes do not change with overlap: only when they move. On a CPU whose "
          "cores the ranks share, an exposed wait is mostly the peer's compute, so these times are noisy (read them "
          "on a real cluster): a faster step can still show a larger wait share, because the compute around it "
          "shrank. The next suspect is whatever part is now largest: with 4x the micro-batches the all-reduce and "
          "the optimizer step are paid once for 4x the tokens, so their shares fall and what is left is compute "
          "itself (the next lever: faster kernels or larger micro-batches; MFU here moves with the machine's load).")


def ranks(quick: bool) -> int:
    return 2


def job(world, quick: bool):
    from mpi4py import MPI

    from mpitrain.backend import make_backend
    from mpitrain.train import Trainer
    # one peak for every setting, the best either rank saw: each Trainer's own short measurement, taken while the
    # other rank computes, can come out low (an MFU over 100%) and differ between settings
    peak = world.allreduce(measure_matmul_peak(make_backend("cpu", "float32"), seconds=1.0), op=MPI.MAX)
    out = {"runs": {}}
    for label, setting, micro_batches in SETTINGS:
        cfg = load_config("configs/tiny.toml" if quick else "configs/bench-small.toml", [
            "data.synthetic=true", "precision.compute=float32", setting, "train.micro_batch=2",
            f"train.global_batch={2 * micro_batches * world.size}", f"logging.peak_flops={peak}"])
        trainer = Trainer(cfg, world)
        best = None
        for step in range(3 if quick else 5):
            result = trainer.train_step(step)
            if step > 0 and (best is None or result.seconds < best.seconds):  # the first step allocates
                best = result
        record = trainer.metrics(best)
        out["runs"][label] = {"breakdown": best.breakdown, "mfu": record["mfu"], "micro_batches": micro_batches,
                              "moved": sum(v for k, v in best.comm_bytes.items() if k != "control")}
        out.update(psi=trainer.model.n_params, n=world.size)
    return out if world.rank == 0 else None


def _suspect(breakdown: dict) -> tuple[str, float]:
    losses = {k: v for k, v in breakdown.items() if k not in ("step_s", *COMPUTE_PARTS)}
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
        compute = sum(run["breakdown"][k] for k in COMPUTE_PARTS)
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
        values = [1e3 * result["runs"][label]["breakdown"].get(part, 0.0) / result["runs"][label]["micro_batches"]
                  for label in labels]  # per micro-batch: the settings do different work per step
        axes[0].barh(labels, values, left=bottom, color=colours(i % 20), label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].set(xlabel="ms per micro-batch (rank 0's step / its micro-batches)", title="step breakdown")
    axes[0].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
