"""Named model shapes for `mpitrain plan MODEL ...`: the published architectures (sizes only, no weights).

Each preset is a dict of [model] keys plus the global batch (sequences) its paper trained with, so that a plan
answers the question the authors faced. Sources: GPT-3, Brown et al. 2020, Table 2.1 (n_layer, d_model, n_head,
batch: the paper's tokens / 2048 rounded to a multiple of 256 sequences); Llama 3, Dubey et al. 2024, Table 3
(8B/70B/405B; 8192 tokens, batch 16M tokens at 405B); Mixtral 8x7B, Jiang et al. 2024 (Mistral 7B's shape with 8
experts, top-2).
"""
from __future__ import annotations

from pathlib import Path

from mpitrain.config import Config, config_from_dict, load_config, validate
from mpitrain.errors import ConfigError


def _gpt3(n_layer: int, d_model: int, n_head: int, global_batch: int) -> dict:
    return {"model": {"arch": "gpt2", "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "vocab_size": 50257,
                      "seq_len": 2048}, "global_batch": global_batch}


def _llama3(n_layer: int, d_model: int, n_head: int, d_ff: int, global_batch: int) -> dict:
    return {"model": {"arch": "llama", "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "n_kv_head": 8,
                      "d_ff": d_ff, "vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0},
            "global_batch": global_batch}


PRESETS = {
    "gpt3-125m": _gpt3(12, 768, 12, 256),  # 0.5M tokens
    "gpt3-350m": _gpt3(24, 1024, 16, 256),
    "gpt3-1.3b": _gpt3(24, 2048, 16, 512),  # the paper's 24 heads of 128 do not divide 2048 evenly; 16 of 128
    "gpt3-2.7b": _gpt3(32, 2560, 32, 512),  # 1M tokens
    "gpt3-6.7b": _gpt3(32, 4096, 32, 1024),  # 2M tokens
    "gpt3-13b": _gpt3(40, 5120, 40, 1024),
    "gpt3-175b": _gpt3(96, 12288, 96, 1536),  # 3.2M tokens
    "llama3-8b": _llama3(32, 4096, 32, 14336, 512),  # 4M tokens
    "llama3-70b": _llama3(80, 8192, 64, 28672, 1024),  # 8M tokens
    "llama3-405b": _llama3(126, 16384, 128, 53248, 2048),  # 16M tokens
    "mixtral-8x7b": {"model": {"arch": "llama", "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8,
                               "d_ff": 14336, "vocab_size": 32000, "seq_len": 4096, "rope_theta": 1e6,
                               "moe": {"experts": 8, "top_k": 2}}, "global_batch": 1024},
}


def model_config(name_or_path: str) -> tuple[Config, str]:
    """The config of a preset name or a config file, and what to call it in the output."""
    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        raw = {"model": dict(preset["model"]), "data": {"synthetic": True},
               "train": {"global_batch": preset["global_batch"], "micro_batch": 1}}
        cfg = config_from_dict(raw, f"preset {name_or_path}")
        validate(cfg)
        return cfg, name_or_path
    if not Path(name_or_path).is_file():
        raise ConfigError(f"MODEL {name_or_path!r} is neither a config file nor a preset; presets: "
                          f"{', '.join(PRESETS)}")
    return load_config(name_or_path), name_or_path

