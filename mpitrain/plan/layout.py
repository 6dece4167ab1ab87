"""`mpitrain plan MODEL CLUSTER --layout "dp64 tp8 pp16 zero1 ..."`: one layout, evaluated alone and explained.

The layout is written the way the planner's table names layouts (Layout.describe): dpN tpN ppN cpN epN etpN zeroN
mbN, a schedule (1f1b, gpipe, zb1p, zbv, dualpipev, interleaved or interleaved/vN), rc-none / rc-selective / rc-full,
offload-none / offload-host / offload-disk, ring / ulysses / hybrid for cp's kind, and the settings beyond those
(Layout.extras): two-level, shard-node, gather-int8|fp8, grad-int8|int4, tp-overlap, fp8-RECIPE; `--set
parallel.tp=8` style keys set the same fields. What is not given keeps the Layout default (dp: the GPUs left
over by tp x pp x cp).
"""
from __future__ import annotations

import re
from dataclasses import fields, replace

from mpitrain.config_checks import ALLOWED
from mpitrain.errors import ConfigError
from mpitrain.parallel.schedule import V_KINDS
from mpitrain.plan.cost import Layout

GB = 1e9
SCHEDULES = ALLOWED["parallel.schedule"]
NUMBERED = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp", "zero": "zero",
            "mb": "micro_batch", "v": "virtual_stages"}
SET_KEYS = {"parallel.dp": "dp", "parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp", "parallel.ep": "ep",
            "parallel.etp": "etp", "parallel.zero": "zero", "parallel.schedule": "schedule",
            "parallel.virtual_stages": "virtual_stages", "parallel.cp_kind": "cp_kind",
            "parallel.dp_reduce": "dp_reduce", "parallel.zero_shard": "zero_shard",
            "parallel.zero_gather_dtype": "zero_gather_dtype", "parallel.zero_grad_reduce": "zero_grad_reduce",
            "parallel.tp_overlap": "tp_overlap", "precision.fp8": "fp8",
            "train.micro_batch": "micro_batch", "memory.recompute": "recompute", "memory.offload": "offload"}
# the values each named field takes: the config's own lists, so that --layout accepts what a config does
CHOICES = {field: ALLOWED[key] for key, field in SET_KEYS.items()
           if key in ALLOWED and all(isinstance(value, str) for value in ALLOWED[key])}
# the settings' tokens (Layout.extras) and the fields they set
FLAG_TOKENS = {"two-level": {"dp_reduce": "two_level"}, "shard-node": {"zero_shard": "node"},
               "tp-overlap": {"tp_overlap": True}}
PREFIX_TOKENS = {"gather": "zero_gather_dtype", "grad": "zero_grad_reduce", "fp8": "fp8"}
# the parts of estimate()'s step, in words, in the order they are printed
PART_WORDS = {"matmul": "compute: matmuls", "elementwise": "compute: elementwise (HBM traffic)",
              "overhead": "fixed overhead (launches, per step)", "tp": "tp collectives (exposed)",
              "cp_ring": "cp exchange (exposed)", "ep_all_to_all": "ep all-to-all (exposed)",
              "pp_send": "pipeline sends", "zero_exposed": "ZeRO gathers / reduce-scatters (exposed)",
              "dp_reduce": "dp gradient reduction (exposed)", "bubble": "pipeline bubble",
              "optimizer": "optimizer step", "rank_skew": "waiting on the slower rank",
              "quantize": "ZeRO++ quantize / dequantize passes"}


def parse_layout(text: str, sets: tuple = ()) -> dict:
    """The Layout fields that `text` and the `--set KEY=VALUE` items give (ConfigError naming the bad token)."""
    given: dict = {}
    for token in text.replace(",", " ").split():
        given.update(_token_fields(token.lower()))
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in SET_KEYS:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(SET_KEYS)}")
        name, value = SET_KEYS[key.strip()], value.strip().strip("'\"")
        given[name] = _value(name, value, f"--set {item!r}")
    return given


def _token_fields(token: str) -> dict:
    if token in SCHEDULES:
        return {"schedule": token}
    if token in CHOICES["cp_kind"]:
        return {"cp_kind": token}
    if token in FLAG_TOKENS:
        return dict(FLAG_TOKENS[token])
    match = re.fullmatch(r"(gather|grad|fp8)-(\w+)", token)
    if match:
        name = PREFIX_TOKENS[match.group(1)]
        return {name: _value(name, match.group(2), f"--layout token {token!r}")}
    match = re.fullmatch(r"interleaved/v(\d+)", token)
    if match:
        return {"schedule": "interleaved", "virtual_stages": int(match.group(1))}
    match = re.fullmatch(r"(rc|recompute|offload)-(\w+)", token)
    if match:
        name = "offload" if match.group(1) == "offload" else "recompute"
        return {name: _value(name, match.group(2), f"--layout token {token!r}")}
    match = re.fullmatch(r"(dp|tp|pp|cp|ep|etp|zero|mb|v)(\d+)", token)
    if match:
        return {NUMBERED[match.group(1)]: int(match.group(2))}
    raise ConfigError(f"--layout: bad token {token!r}; expected dpN tpN ppN cpN epN etpN zeroN mbN, a schedule "
                      f"({', '.join(SCHEDULES)}, interleaved/vN), rc-none|selective|full, offload-none|host|disk, "
                      "ring|ulysses|hybrid, two-level, shard-node, gather-int8|fp8, grad-int8|int4, tp-overlap, "
                      "fp8-tensor|delayed|block|mxfp8")


def _value(name: str, value: str, where: str):
    if name == "tp_overlap":
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"{where}: tp_overlap must be true or false, not {value!r}")
        return value.lower() == "true"
    if name in CHOICES:
        if value not in CHOICES[name]:
            raise ConfigError(f"{where}: {name} must be one of {', '.join(CHOICES[name])}, not {value!r}")
        return value
    if not value.isdigit():
        raise ConfigError(f"{where}: {name} must be a whole number, not {value!r}")
    return int(value)


def layout_for(given: dict, gpus: int | None) -> tuple[Layout, int]:
    """The Layout the fields describe and its GPU count: dp fills the GPUs left by tp x pp x cp where not given."""
    tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
    if min(tp, pp, cp) < 1:
        raise ConfigError(f"--layout: tp, pp and cp must be >= 1 (tp{tp} pp{pp} cp{cp})")
    model_ranks = tp * pp * cp
    if "dp" not in given:
        if gpus is None or gpus % model_ranks:
            raise ConfigError(f"--layout gives no dp: --gpus {gpus} must be a multiple of tp x pp x cp = "
                              f"{model_ranks} (or write dpN)")
        given = {**given, "dp": gpus // model_ranks}
    world = given["dp"] * model_ranks
    if gpus is not None and gpus != world:
        raise ConfigError(f"--layout dp{given['dp']} tp{tp} pp{pp} cp{cp} is {world} GPUs, but --gpus {gpus}")
    if given.get("virtual_stages", 1) > 1 and "schedule" not in given:
        given = {**given, "schedule": "interleaved"}
    if given.get("schedule") in V_KINDS and "virtual_stages" not in given:
        given = {**given, "virtual_stages": 2}  # the V: two chunks per rank
    given = {"etp": tp, **given}  # experts split like the MLP unless etpN says otherwise (the search's spelling)
    names = {f.name for f in fields(Layout)}
    return replace(Layout(dp=1, tp=1, pp=1), **{k: v for k, v in given.items() if k in names}), world


def explain(result: dict, cluster, better: dict | None, best: dict | None) -> str:
    """One layout's memory rows, its step by part (the parts add up to the step), its MFU, and what would be faster."""
    memory = result["memory"]
    lines = [(f"layout {result['name']} on {result['world']} x {cluster.name}: {result['micro_batches']} micro-batches "
             "per step per pipeline"), "", "memory per rank (the fuller pipeline stage decides):"]
    for name, value in memory["rows"].items():
        lines.append(f"  {name:<12} {value / GB:>9.2f} GB")
    lines += [f"  {'transient':<12} {memory['transient'] / GB:>9.2f} GB  (gradient buckets, ZeRO-3 gathered units)",
              f"  {'total':<12} {memory['total'] / GB:>9.2f} GB of {cluster.usable_bytes / GB:.0f} GB usable: "
              + ("fits" if result["fits"] else f"does NOT fit by {-memory['headroom'] / GB:.1f} GB"), "",
              "step time by part:"]
    step = result["step_s"]
    for part, words in PART_WORDS.items():
        seconds = result["parts"][part]
        if seconds:
            lines.append(f"  {words:<42} {seconds:>10.4f} s  {100 * seconds / step:>5.1f}%")
    lines += [f"  {'step (the sum)':<42} {step:>10.4f} s", "",
              (f"MFU {100 * result['mfu']:.1f}%, {result['tokens_per_s']:,.0f} tokens/s, bubble fraction "
              f"{result['bubble']:.3f}; bottleneck: {result['bottleneck']}")]
    lines += ["", faster_line(result, better, best)]
    return "\n".join(lines)


def faster_line(result: dict, better: dict | None, best: dict | None) -> str:
    """What would make the layout faster: the nearest faster layout that fits (fewest fields changed) and which parts
    shrink, and the search's best where that is another one."""
    if better is None:
        return "nothing faster fits: this is the search's best layout" if best else \
            "no layout of the search fits, so nothing faster to suggest"
    lines = [(f"nearest faster layout: {better['name']}, {result['step_s'] / better['step_s']:.2f}x faster "
             f"(changes {', '.join(changed_fields(result, better))}): {shrinking_parts(result, better)}")]
    if best is not better and best is not None:
        lines.append(f"search's best: {best['name']}, {result['step_s'] / best['step_s']:.2f}x faster: "
                     f"{shrinking_parts(result, best)}")
    return "\n".join(lines)


def changed_fields(a: dict, b: dict) -> list[str]:
    return [f"{key} {a['layout'][key]} -> {b['layout'][key]}" for key in a["layout"]
            if a["layout"][key] != b["layout"][key]]


def shrinking_parts(slower: dict, faster: dict, most: int = 3) -> str:
    """The parts that shrink most from `slower` to `faster`, in words with seconds."""
    deltas = sorted(((slower["parts"][k] - faster["parts"][k], k) for k in PART_WORDS), reverse=True)
    shrink = [f"{PART_WORDS[k]} -{d:.3g} s" for d, k in deltas[:most] if d > 0]
    grow = [f"{PART_WORDS[k]} +{-d:.3g} s" for d, k in reversed(deltas) if d < 0][:2]
    return "; ".join(shrink) + (f" (while {', '.join(grow)})" if grow else "")


def nearest_better(result: dict, fits: list[dict]) -> dict | None:
    """Among the layouts that fit and are faster, the one that changes fewest fields (the faster on a tie)."""
    faster = [r for r in fits if r["step_s"] < result["step_s"] * (1 - 1e-9) and r["name"] != result["name"]]
    if not faster:
        return None
    return min(faster, key=lambda r: (len(changed_fields(result, r)), r["step_s"]))
