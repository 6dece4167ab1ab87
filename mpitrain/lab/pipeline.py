"""Pipeline bubble vs micro-batches for GPipe, 1F1B, interleaved, zero-bubble (ZB-H1, ZB-V) and DualPipeV, and
GPipe's vs 1F1B's activations.

The checked bubble comes from the ORDER of the events each rank's executor recorded, replayed with unit costs
(F 1, B 2; a split backward's B and W 1 each): it does not depend on how busy the machine is. DualPipeV runs only
with m >= 2p micro-batches. The wall-clock bubble
of the same step is shown beside it (and plotted), never checked.
"""
from __future__ import annotations

from mpitrain.config import load_config
from mpitrain.config_rules import SCHEDULE_KINDS
from mpitrain.lab.runner import Row
from mpitrain.parallel.schedule import V_KINDS, placement_of, theoretical_bubble
from mpitrain.parallel.schedule_analysis import bubble_fraction
from mpitrain.parallel.timeline import bubble_fraction as wall_bubble
from mpitrain.parallel.timeline import merge_events, replay

NAME = "pipeline"
TITLE = "Pipeline bubble vs micro-batches, and activations held by GPipe vs 1F1B"
PANELS = 2
NOTICE = ("What to notice: the bubble of the order each executor really ran equals (p-1)/(m+p-1) for GPipe and "
          "1F1B alike; interleaving divides the fill and drain by v, ZB-H1 by about 3, ZB-V by about 6; DualPipeV "
          "matches ZB-H1 here, as its overlapped pairs hide messages, not compute, on one core. The wall-clock "
          "bubble (crosses) sits above the line on a shared, loaded CPU: ranks wait for cores, not only for each "
          "other. GPipe holds all m micro-batches' activations on stage 0, 1F1B only p.")


def ranks(quick: bool) -> int:
    return 2 if quick else 4


def micro_batches(quick: bool) -> tuple[int, ...]:
    return (2, 4, 8) if quick else (4, 8, 16)


def job(world, quick: bool):
    from mpitrain.train import Trainer
    p, runs = world.size, []
    for kind in SCHEDULE_KINDS:
        v = 2 if kind in ("interleaved",) + V_KINDS else 1
        for m in micro_batches(quick):
            if kind == "dualpipev" and m < 2 * p:
                continue
            cfg = load_config("configs/tiny.toml", [
                "data.synthetic=true", "logging.peak_flops=1e9", "precision.compute=float64",
                f"model.n_layer={2 * p}", "train.micro_batch=1", f"train.global_batch={m}", f"parallel.pp={p}",
                f"parallel.schedule={kind}", f"parallel.virtual_stages={v}"])
            trainer = Trainer(cfg, world)
            trainer.train_step(0)
            trainer.train_step(1)  # the timeline and the activation peak hold the last step's
            pipeline = trainer.pipeline
            events = world.gather(pipeline.timeline.to_dicts(), root=0)
            memory = world.gather([pipeline.activation_peak_bytes, pipeline.saved_bytes_per_micro_batch[0]], root=0)
            if world.rank == 0:
                order = bubble_fraction(replay(events, p, placement_of(kind), t_forward=1.0, t_backward=2.0,
                                               t_backward_input=1.0, t_backward_weight=1.0))
                runs.append({"kind": kind, "m": m, "v": v, "order_bubble": order,
                             "wall_bubble": wall_bubble(merge_events(events)),
                             "peak": memory[0][0], "per_micro_batch": memory[0][1]})
    return {"p": p, "runs": runs} if world.rank == 0 else None


def rows(result: dict) -> list[Row]:
    p, out = result["p"], []
    formulas = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(v*m+p-1)",
                "zb1p": "(p-1)/(3m+p-1)", "zbv": "(p-1)/(6m+p-1)", "dualpipev": "(p-1)/(3m+p-1)"}
    for run in result["runs"]:
        kind, m, v = run["kind"], run["m"], run["v"]
        expected = theoretical_bubble(kind, p, m, v)
        formula = formulas[kind] if kind != "zbv" or m >= 2 * p else "its makespan"  # zbv: m < 2p loses steps
        out.append(Row(f"{kind} bubble, p={p} m={m}" + (f" v={v}" if v > 1 else ""),
                       f"{formula} = {expected:.4f}",
                       f"{run['order_bubble']:.4f} (wall clock {run['wall_bubble']:.3f})",
                       run["order_bubble"], expected, 1e-12))
    m = max(run["m"] for run in result["runs"])
    for kind, held in (("gpipe", m), ("1f1b", p)):
        run = next(r for r in result["runs"] if r["kind"] == kind and r["m"] == m)
        expected = held * run["per_micro_batch"]
        out.append(Row(f"{kind} activations on stage 0, m={m}", f"{'m' if kind == 'gpipe' else 'p'} = {held} "
                       f"micro-batches = {expected / 1e3:.1f} kB", f"{run['peak'] / 1e3:.1f} kB", run["peak"],
                       expected))
    return out


def plot(result: dict, axes) -> None:
    p = result["p"]
    colours = dict(zip(SCHEDULE_KINDS, ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange",
                                        "tab:brown")))
    for kind in SCHEDULE_KINDS:
        runs = [r for r in result["runs"] if r["kind"] == kind]
        ms = [r["m"] for r in runs]
        axes[0].plot(ms, [theoretical_bubble(kind, p, m, r["v"]) for m, r in zip(ms, runs)], "-",
                     color=colours[kind], alpha=0.5)
        axes[0].plot(ms, [r["order_bubble"] for r in runs], "o", color=colours[kind], label=f"{kind} (order)")
        axes[0].plot(ms, [r["wall_bubble"] for r in runs], "x", color=colours[kind])
    axes[0].set(xlabel="micro-batches m", ylabel="bubble fraction", xscale="log",
                title=f"p = {p}: line formula, o order, x clock")
    axes[0].set_xticks([r["m"] for r in result["runs"] if r["kind"] == "gpipe"], minor=False)
    axes[0].xaxis.set_major_formatter("{x:.0f}")
    axes[0].minorticks_off()
    axes[0].legend(fontsize=7)
    for kind in ("gpipe", "1f1b"):
        runs = [r for r in result["runs"] if r["kind"] == kind]
        axes[1].plot([r["m"] for r in runs], [r["peak"] / 1e3 for r in runs], "o-", color=colours[kind], label=kind)
    axes[1].set(xlabel="micro-batches m", ylabel="activation peak, stage 0 (kB)", title="GPipe holds m, 1F1B p")
    axes[1].legend(fontsize=8)
