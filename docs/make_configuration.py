"""Write docs/configuration.md from mpitrain/config.py: every key of every section, its default, the values it
allows and the comment beside it in the source. Run it after adding or changing a key:

    .venv/bin/python docs/make_configuration.py           # rewrites docs/configuration.md
    .venv/bin/python docs/make_configuration.py --check   # exits 1 when the page is out of date

tests/test_readme.py fails when a key of mpitrain/config.py is missing from the page.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
from pathlib import Path

from mpitrain import config, config_moe

PAGE = Path(__file__).resolve().parent / "configuration.md"

INTRO = """# Configuration

A config is a TOML file with the sections below; it lists only what it changes from the defaults, e.g.
`configs/quickstart.toml`. Any key can be set on the command line of `mpitrain train`, `launch`, `memory` and
`bench step`:

```bash
mpitrain launch -n 2 configs/quickstart.toml --set train.steps=50 --set model.arch='"llama"'
```

Values are TOML literals (`50`, `true`, `"llama"`, `[3, 5]`); a bare word is taken as a string. An unknown section or
key, a value of the wrong type, or one outside the allowed set stops the run before any communication, with one line
naming the key (and the closest key when it looks mistyped). A run writes its resolved config to `RUN_DIR/config.toml`,
so it can be repeated exactly.

This page is generated from the dataclasses of `mpitrain/config.py` and the comments beside their fields
(`python docs/make_configuration.py`); where a section has a page of its own, the section's heading links to it.
"""

# Pages that explain a section in depth (docs/ relative).
SECTION_PAGES = {"parallel": "parallelism.md", "memory": "memory.md", "lora": "memory.md", "optim": "memory.md",
                 "checkpoint": "checkpoints.md", "fault": "checkpoints.md", "precision": "memory.md"}

# Meanings for fields that carry no comment in the source (a comment there, once written, takes over).
UNCOMMENTED = {
    "model.n_layer": "transformer blocks",
    "model.d_model": "width of the residual stream",
    "model.n_head": "attention heads (query heads under grouped-query attention)",
    "model.vocab_size": "vocabulary size: at least the dataset's tokenizer's",
    "model.seq_len": "context length in tokens",
    "model.rope_theta": "RoPE base frequency (llama)",
    "model.norm_eps": "epsilon of LayerNorm / RMSNorm",
    "model.init_std": "standard deviation of the initial weights",
    "model.moe.top_k": "experts each token is routed to",
    "model.moe.aux_loss": "weight of the load-balance loss E * sum_e f_e * P_e",
    "model.moe.z_loss": "weight of the router z-loss mean(logsumexp(logits)^2)",
    "parallel.cp": "context parallelism: every sequence split over cp ranks (zig-zag ring attention)",
    "parallel.ep": "expert parallelism: the experts spread over ep ranks of their own mesh, drawn from dp x cp (and "
                   "the tp ranks' token shares at parallel.etp = 1)",
    "train.steps": "optimizer steps",
    "train.seed": "the global batch of step s is a pure function of (seed, s)",
    "train.log_every": "print and log to metrics.jsonl every N steps",
    "train.eval_batches": "validation batches per evaluation",
    "train.sample_prompt": "the prompt of the sample printed at the end",
    "optim.lr": "peak learning rate, reached after warmup_steps",
    "optim.min_lr": "the learning rate the cosine decay ends at, on the last step",
    "optim.warmup_steps": "linear warm-up steps",
    "optim.weight_decay": "decoupled weight decay, on matrices only",
    "optim.beta1": "first-moment decay (AdamW, 8-bit Adam)",
    "optim.beta2": "second-moment decay (AdamW, 8-bit Adam)",
    "optim.eps": "added to the root of the second moment",
    "data.mix": "blend prepared files by weight instead of data.path: [\"a.h5:3\", \"b.h5:1\"]; each row of a global "
                "batch comes from file i with probability weight_i / the sum; the files must share one tokenizer",
}

MODEL_MOE = """`model.moe` is an inline table, e.g. `moe = {experts = 8, top_k = 2}` under `[model]`; its keys
(`mpitrain/config_moe.py`, explained in [parallelism.md](parallelism.md#mixture-of-experts-and-expert-parallelism)):
"""


def source_comments(module) -> dict[tuple[str, str], str]:
    """{(class name, field name): the comment on the field's line} for every dataclass field in `module`'s source."""
    source = Path(module.__file__).read_text()
    by_line = {token.start[0]: token.string.lstrip("#").strip()
               for token in tokenize.generate_tokens(io.StringIO(source).readline)
               if token.type == tokenize.COMMENT}
    comments = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    comments[(node.name, item.target.id)] = by_line.get(item.lineno, "")
    return comments


def class_docstrings(module) -> dict[str, str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {node.name: ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def literal(value) -> str:
    """A default as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}"
    return repr(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_rows(section_object, prefix: str, comments: dict) -> list[str]:
    rows = []
    for item in dataclasses.fields(section_object):
        key = f"{prefix}.{item.name.rstrip('_')}"  # a trailing underscore only dodges a Python keyword (async)
        meaning = comments.get((type(section_object).__name__, item.name), "") or UNCOMMENTED.get(key, "")
        allowed = config.ALLOWED.get(key)
        if allowed:
            meaning += ("; " if meaning else "") + "allowed: " + ", ".join(literal(v) for v in allowed)
        rows.append(f"| `{key}` | `{cell(literal(getattr(section_object, item.name)))}` | {cell(meaning)} |")
    return rows


def page() -> str:
    comments = source_comments(config) | source_comments(config_moe)
    docs = class_docstrings(config)
    defaults = config.Config()
    parts = [INTRO]
    for section in dataclasses.fields(config.Config):
        section_object = getattr(defaults, section.name)
        heading = f"## [{section.name}]"
        if section.name in SECTION_PAGES:
            heading += f" (see [{SECTION_PAGES[section.name]}]({SECTION_PAGES[section.name]}))"
        parts += ["", heading, ""]
        doc = docs.get(type(section_object).__name__, "")
        if doc:
            parts += [" ".join(doc.split()), ""]
        parts += ["| key | default | meaning |", "|---|---|---|", *key_rows(section_object, section.name, comments)]
        if section.name == "model":
            parts += ["", MODEL_MOE, "| key | default | meaning |", "|---|---|---|",
                      *key_rows(config_moe.MoeSettings(), "model.moe", comments)]
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    text = page()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python docs/make_configuration.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
