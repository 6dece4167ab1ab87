"""The `mpitrain` command: data prepare, train, launch, generate, ckpt, memory, schedule, report; the doctor and bench
groups are cli_doctor.py and cli_bench.py, plan and lab their packages' command.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from mpitrain.cli_bench import bench
from mpitrain.cli_common import CONFIG_ARG, SET_OPTION, user_errors
from mpitrain.cli_doctor import doctor
from mpitrain.config_rules import SCHEDULE_KINDS, positive_degree
from mpitrain.errors import ConfigError, MpitrainError
from mpitrain.lab.command import lab_command
from mpitrain.launcher import default_run_dir, find_mpiexec, rank_environment, run_locations, warn_unset_threads
from mpitrain.plan.command import plan_command

# Each command imports what it runs inside its own function: `mpitrain --help` and the light commands start without
# numpy, the model stack or MPI (importing mpi4py.MPI initialises MPI, which `train` alone needs at once).


@click.group()
@click.version_option(package_name="mpitrain")
def main():
    """Train transformer language models across MPI ranks, every parallel layout written to be read."""


# ----------------------------------------------------------------------------- data
@main.group()
def data():
    """Prepare token datasets."""


@data.command("prepare")
@click.option("--source", "sources", multiple=True, required=True,
              help="'python-stdlib' (this Python's own source tree, no download), or files / folders of plain text, "
                   "JSON lines (.jsonl, .jsonl.gz) and Parquet (.parquet); repeatable.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="HDF5 file to write.")
@click.option("--tokenizer", type=click.Choice(["byte", "bpe"]), default="byte", show_default=True)
@click.option("--vocab-size", type=int, default=None, help="BPE vocabulary size (needs the 'tokenizers' package).")
@click.option("--val-fraction", type=float, default=0.05, show_default=True)
@click.option("--max-bytes", type=int, default=None, help="Use at most this many bytes of text.")
@click.option("--tokenizer-file", type=click.Path(dir_okay=False), default=None,
              help="Tokenize with this tokenizer.json (e.g. a Hugging Face model's) instead of --tokenizer.")
@click.option("--text-field", default="text", show_default=True,
              help="The JSON lines field / Parquet column that holds each document's text.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Tokenizing processes (default: min(4, CPU count)); the file is the same for any number.")
@user_errors
def data_prepare(sources, out_path, tokenizer, vocab_size, val_fraction, max_bytes, tokenizer_file, text_field,
                 workers):
    """Tokenize documents into an HDF5 token file with train and val splits and each document's start."""
    from mpitrain.data.prepare import default_workers, prepare_dataset
    source = "python-stdlib" if list(sources) == ["python-stdlib"] else list(sources)
    summary = prepare_dataset(source, out_path, tokenizer=tokenizer, vocab_size=vocab_size,
                              val_fraction=val_fraction, max_bytes=max_bytes, tokenizer_file=tokenizer_file,
                              text_field=text_field, workers=workers or default_workers())
    click.echo(f"wrote {summary['out']}: {summary['train_tokens']:,} train + {summary['val_tokens']:,} val tokens "
               f"from {summary['documents']:,} documents ({summary['bytes']:,} bytes), "
               f"{summary['tokenizer']} tokenizer, vocabulary {summary['vocab_size']}, {summary['workers']} worker(s)")


# ----------------------------------------------------------------------------- train
@main.command()
@CONFIG_ARG
@SET_OPTION
@click.option("--out", "run_dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/<config name>).")
@click.option("--resume", default=None, metavar="auto|PATH",
              help="Continue from a checkpoint: 'auto' = the newest committed one of the run (fresh when none), "
                   "a run directory (its newest that verifies) or a step_* directory. Any parallel layout can "
                   "resume any other.")
@click.option("--allow-changes", "allowed_changes", multiple=True, metavar="KEY",
              help="Resume although KEY (a learning-rate schedule key, train.steps or train.global_batch) differs "
                   "from the checkpoint's config (repeatable).")
def train(config, overrides, run_dir, resume, allowed_changes):
    """Train (run under mpiexec for several ranks; one process works without it).

    Exits with status 75 after saving when asked to stop (SIGUSR1/SIGTERM): resume with --resume auto. A user error
    (config, layout, data, checkpoint) is one line from rank 0 and exit status 1; a run directory another live job
    writes (RUN_DIR/.lock) exits with 73, a checkpoint the storage refuses (disk full, quota, read-only, I/O error)
    with 74."""
    from mpi4py import MPI

    from mpitrain.checkpoint.resume import check_allowed_changes
    from mpitrain.comm.failure import agree_on_user_errors, end_job_on_error
    from mpitrain.config import load_config
    from mpitrain.train import forget_refused_start
    from mpitrain.train_loop import train as run_training

    comm = MPI.COMM_WORLD
    out = Path(run_dir) if run_dir else default_run_dir(config)
    forget = forget_refused_start(out) if comm.Get_rank() == 0 else None  # asked before any rank writes there
    with end_job_on_error(comm, on_refused=forget):
        cfg, allowed = agree_on_user_errors(comm, lambda: (load_config(config, overrides),
                                                           check_allowed_changes(allowed_changes)))
        warn_unset_threads(comm)
        status = run_training(cfg, comm, out, echo=click.echo, resume=resume, allowed_changes=allowed)
    sys.exit(status)


# ----------------------------------------------------------------------------- launch
@main.command(context_settings={"ignore_unknown_options": True})
@click.option("-n", "n_ranks", type=int, required=True, help="Number of MPI ranks.")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="After a failure (an exit status other than 0, 73, 74 and 75), run the job again from its last "
                   "committed checkpoint (--resume auto), at most this many times; prints the time each restart "
                   "lost.")
@CONFIG_ARG
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def launch(n_ranks, max_restarts, config, train_args):
    """Run `mpitrain train CONFIG ...` on N local ranks through mpiexec, with BLAS threads set per rank."""
    positive_degree("-n", n_ranks, MpitrainError)
    if max_restarts < 0:
        raise MpitrainError(f"--max-restarts must be >= 0, got {max_restarts}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    command = [find_mpiexec(), "-n", str(n_ranks), sys.executable, "-m", "mpitrain", "train", config]
    env = rank_environment(n_ranks, cores, os.environ)
    click.echo(f"launch: {' '.join(command + list(train_args))}  (OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
               + (f", up to {max_restarts} restarts" if max_restarts else "") + ")", err=True)
    sys.stdout.flush()
    if not max_restarts:
        os.execvpe(command[0], command + list(train_args), env)
    from mpitrain.resilience.restart import Supervisor
    run_dir, checkpoint_dir = run_locations(config, list(train_args))
    supervisor = Supervisor(command, list(train_args), env, max_restarts, run_dir / "metrics.jsonl", checkpoint_dir,
                            lambda text: click.echo(text, err=True))
    sys.exit(supervisor.run())


# ----------------------------------------------------------------------------- generate
@main.command()
@click.argument("checkpoint", type=click.Path())  # not found: said by the loader, with where it looked
@click.option("--prompt", default="def ", show_default=True)
@click.option("--tokens", "n_tokens", type=int, default=200, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--top-k", type=int, default=0, help="Sample among the k likeliest tokens (0: all).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True,
              help="Keep keys and values of past positions (one position per new token) or rerun the window.")
@user_errors
def generate(checkpoint, prompt, n_tokens, temperature, top_k, seed, kv_cache):
    """Sample text from a trained model: a run directory (its newest checkpoint whose checksums verify, falling back
    past broken ones) or a step_* checkpoint directory (which must verify)."""
    from mpitrain.generate import load_checkpoint_model, sample
    model, state, tokenizer, _ = load_checkpoint_model(checkpoint, echo=lambda text: click.echo(text, err=True),
                                                       announce=True)
    if tokenizer is None:
        raise MpitrainError(f"{checkpoint} has no tokenizer to sample text with (trained on synthetic data, or "
                            f"imported from a Hugging Face folder without tokenizer.json)")
    click.echo(sample(model, state, tokenizer, prompt, n_tokens, temperature, top_k, seed, kv_cache))


# ----------------------------------------------------------------------------- ckpt
@main.group()
def ckpt():
    """Inspect, verify and export sharded checkpoints."""


@ckpt.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@user_errors
def ckpt_inspect(path):
    """Step, layout, tensors and sizes of a checkpoint (or the newest one of a run)."""
    from mpitrain.checkpoint.resume import resolve_checkpoint
    from mpitrain.checkpoint.store import Checkpoint
    checkpoint = Checkpoint.open(resolve_checkpoint(path))
    index = checkpoint.index
    layout = ", ".join(f"{k}={v}" for k, v in index["layout"].items())
    total = sum(record["bytes"] for record in index["files"])
    click.echo(f"{checkpoint.path}: step {index['step']}, layout {layout}, {len(index['files'])} files, "
               f"{total:,} bytes")
    for name, info in index["tensors"].items():
        click.echo(f"  {name:<28} {tuple(info['global_shape'])!s:<16} {info['dtype']}")


@ckpt.command("verify")
@click.argument("path", type=click.Path(exists=True))
@user_errors
def ckpt_verify(path):
    """Checksums of every shard, and every tensor covered exactly once."""
    from mpitrain.checkpoint.resume import resolve_checkpoint
    from mpitrain.checkpoint.store import Checkpoint
    checkpoint = Checkpoint.open(resolve_checkpoint(path))
    checkpoint.verify_files()
    checkpoint.verify_coverage()
    click.echo(f"{checkpoint.path}: OK ({len(checkpoint.index['files'])} files, "
               f"{len(checkpoint.tensors())} tensors, each covered exactly once)")


@ckpt.command("export")
@click.argument("path", type=click.Path(exists=True))
@click.argument("out", type=click.Path())
@click.option("--optimizer", is_flag=True, help="Also export the optimizer's state (e.g. the Adam moments).")
@click.option("--merge-lora", is_flag=True, help="Merge the LoRA adapters into the base weights (params only).")
@click.option("--format", "out_format", type=click.Choice(["hdf5", "hf"]), default="hdf5", show_default=True,
              help="hf: a Hugging Face folder (config.json, model.safetensors) that transformers loads.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Tensor dtype of --format hf.")
@user_errors
def ckpt_export(path, out, optimizer, merge_lora, out_format, dtype):
    """One consolidated HDF5 file of full tensors (params/<name>, optionally exp_avg/ and exp_avg_sq/), or with
    --format hf a Hugging Face folder OUT."""
    from mpitrain.checkpoint.resume import resolve_checkpoint
    from mpitrain.checkpoint.store import Checkpoint
    checkpoint = Checkpoint.open(resolve_checkpoint(path))
    checkpoint.verify_files()
    if out_format == "hf":  # mpitrain/checkpoint/hf.py; LoRA adapters are always merged
        if optimizer:
            raise click.BadParameter("a Hugging Face folder holds weights only", param_hint="--optimizer")
        from mpitrain.checkpoint.hf import export_hf
        for note in export_hf(checkpoint, Path(out), dtype):
            click.echo(note)
        click.echo(f"wrote {out} (step {checkpoint.step}, Hugging Face format, {dtype})")
        return
    if Path(out).is_dir():
        raise click.BadParameter(f"{out} is a directory (the HDF5 export writes one file)", param_hint="OUT")
    if merge_lora:
        from mpitrain.checkpoint.weights import export_merged
        merged = export_merged(checkpoint, Path(out))
        click.echo(f"wrote {out} (step {checkpoint.step}, {merged} LoRA adapters merged into their weights)")
        return
    saved_kinds = sorted({piece["kind"] for record in checkpoint.index["files"] for piece in record["pieces"]}
                         - {"param"})
    checkpoint.export(Path(out), kinds=("param", *saved_kinds) if optimizer else ("param",))  # any optim.name's state
    click.echo(f"wrote {out} (step {checkpoint.step})")


@ckpt.command("import")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@user_errors
def ckpt_import(hf_dir, out):
    """A Hugging Face GPT-2 or Llama folder (config.json, *.safetensors) as a one-rank checkpoint at step 0 in the
    new checkpoint directory OUT (for train.init_from, generate; or give train.init_from the folder itself)."""
    from mpitrain.checkpoint.hf import import_hf
    final, notes = import_hf(hf_dir, Path(out))
    for note in notes:
        click.echo(note)
    click.echo(f"wrote {final} (from {hf_dir})")


# ----------------------------------------------------------------------------- memory
@main.command()
@CONFIG_ARG
@SET_OPTION
@click.option("-n", "world_size", type=int, default=1, show_default=True, help="Number of ranks to plan for.")
@click.option("--attention", type=click.Choice(["fused", "unfused"]), default=None,
              help="Attention to count: fused (cuDNN SDPA, no T x T matrix) or unfused. Default: fused for "
                   "train.device = cuda in bf16/fp16.")
@click.option("--dry-run", "shapes_only", is_flag=True,
              help="Also build this rank's state and optimizer through the training code with arrays that hold no "
                   "memory, and print their bytes beside the formulas' (any model size).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="Ranks per node, where parallel.zero_shard = node shards ZeRO over one node's ranks (default: as "
                   "MPITRAIN_FAKE_NODES splits the -n ranks).")
@user_errors
def memory(config, overrides, world_size, attention, shapes_only, gpus_per_node):
    """Per-rank bytes of parameters, gradients, optimizer state and activations for CONFIG's layout."""
    from mpitrain.config import load_config, resolve_layout
    from mpitrain.plan.memory import default_attention, memory_report, rank_param_count

    cfg = load_config(config, overrides)
    resolve_layout(cfg, world_size)
    gpus_per_node = memory_node_size(cfg, world_size, gpus_per_node)
    n_params = rank_param_count(cfg)
    attention = attention or default_attention(cfg.precision.compute, on_gpu=cfg.train.device == "cuda")
    report = memory_report(cfg, n_params, attention=attention, gpus_per_node=gpus_per_node)
    shares = [f"its 1/{cfg.parallel.tp} tensor-parallel share"] if cfg.parallel.tp > 1 else []
    shares += ["of the first pipeline stage"] if cfg.parallel.pp > 1 else []
    where = f" (this rank's: {', '.join(shares)})" if shares else ""
    ranks = f"dp x cp N = {cfg.parallel.dp} x {cfg.parallel.cp}" if cfg.parallel.cp > 1 else f"dp N = {cfg.parallel.dp}"
    if cfg.parallel.zero_shard == "node":  # the shards' N is a node's ranks of the group
        from mpitrain.plan.cost_sharding import dp_levels
        shard = dp_levels(cfg.parallel, gpus_per_node)[0]
        ranks = f"{ranks.replace(' N =', '')}, N = {shard} (ZeRO sharded inside nodes of {gpus_per_node} GPUs)"
    click.echo(f"{config}: {n_params:,} parameters (Psi){where}, ZeRO-{cfg.parallel.zero}, {ranks}, "
               f"{cfg.precision.compute} (e = {report['e']} bytes), micro-batch {cfg.train.micro_batch} x "
               f"{cfg.model.seq_len} tokens; per rank:")
    for kind, value in report["bytes"].items():
        click.echo(f"  {kind:<12} {value / 2**20:>10.2f} MiB   {report['formulas'][kind]}")
    click.echo(f"  {'total':<12} {report['total'] / 2**20:>10.2f} MiB")
    if shapes_only:
        from mpitrain.plan.dryrun import dry_run, format_dry_run
        click.echo(format_dry_run(dry_run(cfg, gpus_per_node=gpus_per_node or None)))


def memory_node_size(cfg, world_size: int, gpus_per_node: int | None) -> int:
    """The ranks per node `mpitrain memory` counts with: --gpus-per-node, else as MPITRAIN_FAKE_NODES splits the
    world (the dry run's and the training code's nodes on one machine), else 0 (one node). parallel.zero_shard = node
    shards by node, so it is refused without a node size rather than counted world-sharded."""
    from mpitrain.comm.nodes import fake_node_count
    if gpus_per_node is not None:
        if gpus_per_node < world_size and world_size % gpus_per_node:
            raise ConfigError(f"--gpus-per-node {gpus_per_node} does not divide the {world_size} ranks (-n)")
        return min(gpus_per_node, world_size)
    fake = fake_node_count(world_size)
    if fake:
        return world_size // fake
    if cfg.parallel.zero_shard == "node" and cfg.parallel.zero >= 1:
        raise ConfigError("parallel.zero_shard = 'node' shards ZeRO over one node's ranks: give the node size with "
                          "--gpus-per-node N (or MPITRAIN_FAKE_NODES)")
    return 0


main.add_command(plan_command)  # mpitrain plan MODEL CLUSTER, mpitrain plan calibrate (mpitrain/plan/command.py)
main.add_command(lab_command)  # mpitrain lab list | NAME [--quick] [--png FILE] (mpitrain/lab/)
main.add_command(doctor)  # mpitrain doctor hang | parity | precision (mpitrain/cli_doctor.py)
main.add_command(bench)  # mpitrain bench step | comm (mpitrain/cli_bench.py)


# ----------------------------------------------------------------------------- schedule (pipeline, no MPI)
@main.command("schedule")
@click.option("--pp", type=int, required=True, help="Pipeline stages (ranks).")
@click.option("--microbatches", type=int, required=True, help="Micro-batches per step.")
@click.option("--schedule", "kind", type=click.Choice(SCHEDULE_KINDS), default="1f1b",
              show_default=True)
@click.option("--virtual-stages", type=int, default=1, show_default=True,
              help="Model chunks per rank (interleaved; zbv and dualpipev always 2).")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Also draw the timeline into this PNG file (needs matplotlib: pip install 'mpitrain[plot]').")
@click.option("--width", type=int, default=120, show_default=True, help="Columns of the text timeline.")
@click.option("--instructions", is_flag=True, help="Also print every rank's instruction list.")
@user_errors
def schedule_command(pp, microbatches, kind, virtual_stages, png_path, width, instructions):
    """Simulate a pipeline schedule: timeline, bubble (theoretical and simulated), peak activations per rank."""
    from mpitrain.parallel.schedule import V_KINDS, dualpipev_pairs, make_schedule, placement_of, theoretical_bubble
    from mpitrain.parallel.schedule_analysis import (
        bubble_fraction,
        format_schedule,
        peak_activations,
        simulate,
        validate,
    )
    from mpitrain.parallel.timeline import render_png, render_text

    v = 2 if kind in V_KINDS and virtual_stages == 1 else virtual_stages  # zbv, dualpipev: two chunks in a V
    plan, placement = make_schedule(kind, pp, microbatches, v), placement_of(kind)
    validate(plan, pp, microbatches, v, placement)
    # time unit: one micro-batch's forward through a whole stage; an interleaved chunk is 1/v of a stage
    timeline = simulate(plan, t_forward=1 / v, t_backward=2 / v, t_backward_input=1 / v, t_backward_weight=1 / v,
                        placement=placement)
    times = "forward 1, input grad 1, weight grad 1" if kind in ("zb1p",) + V_KINDS else "forward 1, backward 2"
    click.echo(f"{kind}: pp = {pp}, {microbatches} micro-batches" + (f", {v} chunks per rank" if v > 1 else "")
               + f"; time per micro-batch and stage: {times}")
    if instructions:
        click.echo(format_schedule(plan))
    click.echo(render_text(timeline, width=width))
    formula = {"zbv": "(p-1)/(6m+p-1)" if microbatches >= 2 * pp else "", "dualpipev": "(p-1)/(3m+p-1)"}.get(kind)
    click.echo(f"bubble: theoretical {formula + ' = ' if formula else ''}"
               f"{theoretical_bubble(kind, pp, microbatches, v):.4f}, simulated {bubble_fraction(timeline):.4f}")
    if kind == "dualpipev":  # a pair's messages move while its other half computes
        click.echo("overlapped pairs per rank: " + ", ".join(str(len(pairs)) for pairs in
                                                             dualpipev_pairs(pp, microbatches)))
    unit = f"(micro-batch, chunk) pairs, 1/{v} stage each" if v > 1 else "micro-batches"
    click.echo(f"peak activations ({unit}): "
               + ", ".join(f"rank {rank} {n}" for rank, n in enumerate(peak_activations(plan))))
    if png_path:
        title = f"{kind} pp={pp} m={microbatches}" + (f" v={v}" if v > 1 else "")
        render_png(timeline, png_path, title)
        click.echo(f"wrote {png_path}")
# ----------------------------------------------------------------------------- end schedule


@main.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="report.png or report.html (default: RUN_DIR/report.png).")
@user_errors
def report_command(run_dir, out_path):
    """Plot a run (also one still going): loss, tokens/s and MFU, time breakdown, bytes, pipeline timeline."""
    from mpitrain.profile.report import render
    out_path = out_path or str(Path(run_dir) / "report.png")
    click.echo(f"wrote {out_path}: {', '.join(render(run_dir, out_path))}")


if __name__ == "__main__":
    main()
