"""`mpitrain plan MODEL CLUSTER ...` and `mpitrain plan calibrate`: the click command (registered by cli.py)."""
from __future__ import annotations

from pathlib import Path

import click

from mpitrain.errors import MpitrainError


@click.command("plan")
@click.argument("model")
@click.argument("cluster", required=False)
@click.option("--gpus", type=int, default=None, help="GPUs to plan for (default: one node of CLUSTER).")
@click.option("--seq", type=int, default=None, help="Sequence length (default: the model's).")
@click.option("--global-batch", type=int, default=None, help="Sequences per step (default: the model's).")
@click.option("--top", type=int, default=8, show_default=True, help="Layouts to list.")
@click.option("--attention", type=click.Choice(["fused", "unfused"]), default=None,
              help="Attention to count: fused (cuDNN SDPA, no T x T matrix) or unfused. Default: fused where the "
                   "cluster computes in bf16/fp16.")
@click.option("--fp8", type=click.Choice(["none", "tensor", "delayed", "block", "mxfp8", "any"]), default="none",
              show_default=True, help="Search with FP8 GEMMs (precision.fp8) of this recipe, or of each (any); FP8 "
                                      "changes the numerics, so the search tries it only when asked.")
@click.option("--allow", "allow", multiple=True, type=click.Choice(["quantized-comm"]),
              help="Also search what changes the numerics: quantized-comm, ZeRO++'s int8/int4 gradient reductions "
                   "and int8 ZeRO-3 gathers (parallel.zero_grad_reduce, zero_gather_dtype).")
@click.option("--json", "as_json", is_flag=True, help="Print the evaluated layouts as JSON.")
@click.option("--emit-config", type=click.Path(dir_okay=False), default=None, help="Write the best layout's config.")
@click.option("--layout", "layout_text", default=None,
              help='Evaluate this layout alone, e.g. "dp64 tp8 pp16 zero1 mb1 interleaved/v4 rc-selective": memory '
                   'rows, step time by part, MFU, and the nearest faster layout.')
@click.option("--set", "layout_sets", multiple=True, metavar="KEY=VALUE",
              help="With or instead of --layout: parallel.tp=8, train.micro_batch=2, memory.recompute=full, ...")
@click.option("-n", "ranks", type=int, default=2, show_default=True, help="calibrate: local MPI ranks to measure.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="calibrate: where to write (default: configs/clusters/this-machine.toml).")
def plan_command(model, cluster, gpus, seq, global_batch, top, attention, fp8, allow, as_json, emit_config,
                 layout_text, layout_sets, ranks, out_path):
    """Which layout fits MODEL (preset or config) on CLUSTER (configs/clusters/NAME.toml), and how fast it runs.
    `mpitrain plan calibrate` measures this machine into configs/clusters/this-machine.toml."""
    try:
        if layout_text is not None or layout_sets:
            if fp8 != "none" or allow:  # the search's options: a layout names its own settings
                raise click.UsageError("--fp8 and --allow choose what the search tries; with --layout name the "
                                       "setting in it (fp8-tensor, grad-int8) or --set it (precision.fp8=tensor)")
            from mpitrain.plan.search import evaluate_layout  # the model stack: loaded when the command runs
            click.echo(evaluate_layout(model, cluster or "", layout_text or "", layout_sets, gpus, seq, global_batch,
                                       attention))
            return
        _plan(model, cluster, gpus, seq, global_batch, top, attention, as_json, emit_config, ranks, out_path, fp8,
              allow)
    except MpitrainError as exc:  # a user error: one line on stderr, exit status 1
        raise click.ClickException(str(exc)) from None


def _plan(model, cluster, gpus, seq, global_batch, top, attention, as_json, emit_config, ranks, out_path, fp8="none",
          allow=()):
    # cli.py imports this module at start-up to list the command; the planner loads the model stack, so it is
    # imported when the command runs (mpitrain --help stays fast)
    from mpitrain.plan import search as planner
    from mpitrain.plan.calibrate import calibrate
    from mpitrain.plan.clusters import CLUSTER_DIR
    if model == "calibrate":
        calibrate(Path(out_path or CLUSTER_DIR / "this-machine.toml"), ranks, say=click.echo)
        return
    if not cluster:
        raise click.UsageError("missing CLUSTER (h100, h200, a100, b200, this-machine or a .toml file)")
    cfg, name, spec, found, gpus = planner.plan(model, cluster, gpus, seq, global_batch, attention, fp8, tuple(allow))
    click.echo(planner.as_json(found, spec, top) if as_json else
               planner.report(found, spec, name, cfg, gpus, top, attention))
    if emit_config and found["fits"]:
        planner.emit_config(cfg, found["fits"][0], spec, emit_config)
        click.echo(f"wrote {emit_config}", err=as_json)
    elif emit_config:
        raise click.ClickException(f"nothing fits on {gpus} x {spec.name}: no config written to {emit_config}")
