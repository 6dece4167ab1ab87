"""Hugging Face folders in and out: `mpitrain ckpt export PATH OUT_DIR --format hf`, `mpitrain ckpt import HF_DIR
OUT` and `train.init_from = HF_DIR`. The names and layouts are mapped in hf_names.py; this module reads and writes
the files (config.json, model.safetensors through the `safetensors` package, tokenizer.json).

Export reads full tensors from any layout (the checkpoint's pieces are assembled like any resharded load) and merges
LoRA adapters first. Import reads one or several *.safetensors files (sharded folders have an index), keeps the
stored dtype (bfloat16 included, exact) and writes a committed one-rank checkpoint, or hands the tensors straight
to a run (`HFWeights`, which reads like a Checkpoint, so any layout loads it as it loads our own).
"""
from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from mpitrain.backend import BFLOAT16
from mpitrain.checkpoint.hf_names import HFFormatError, from_hf, hf_config, model_config_from_hf, to_hf
from mpitrain.checkpoint.pieces import Piece
from mpitrain.checkpoint.store import (
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    commit,
    committed_checkpoints,
    rank_file_name,
    step_dir_name,
    write_rank_file,
)
from mpitrain.config import Config, ModelConfig, config_from_dict, to_toml
from mpitrain.data.tokenizer import BPETokenizer
from mpitrain.errors import MpitrainError
from mpitrain.layers.lora import merge

EXPORT_DTYPES = ("float32", "bfloat16")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
BYTE_TOKENIZER_NOTE = ("tokenizer: byte-level, no file (transformers has no tokenizer for raw bytes): feed "
                       "list(text.encode('utf-8')) as input_ids and decode with bytes(ids).decode('utf-8', 'replace')")


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise MpitrainError("Hugging Face export/import needs the 'safetensors' package: "
                            "pip install 'mpitrain[hf]'") from None
    return safetensors.numpy


def is_hf_folder(path) -> bool:
    """A folder transformers' save_pretrained wrote (its config.json; our runs have config.toml): one without
    safetensors weights is then refused by name rather than searched for checkpoints."""
    return (Path(path) / "config.json").is_file()


# ----------------------------------------------------------------------------- export
def export_hf(checkpoint: Checkpoint, out: Path, dtype: str = "float32") -> list[str]:
    """Write config.json, model.safetensors and the tokenizer (if it has a file) into the new folder `out`; returns
    one-line notes on what was adapted. The folder appears whole or not at all (written aside, then renamed)."""
    if dtype not in EXPORT_DTYPES:
        raise HFFormatError(f"--dtype {dtype}: expected one of {', '.join(EXPORT_DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFFormatError(f"{out} already exists and is not an empty folder: give a new output folder")
    stored = tomllib.loads(checkpoint.index.get("config", ""))
    cfg = config_from_dict(stored, str(checkpoint.path / "index.json"))
    infos = checkpoint.tensors()
    tensors = {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                         np.float64) for name, info in infos.items()}  # exact for every dtype
    notes = []
    adapters = [name for name in tensors if name.endswith(("_lora_a", "_lora_b"))]
    if adapters:
        lora = stored.get("lora", {})
        tensors = merge(tensors, int(lora.get("rank", 0)), float(lora.get("alpha", 16.0)))
        notes.append(f"LoRA: {len(adapters) // 2} adapters merged into their weights, W + (alpha / r) a b")
    target = _numpy_dtype(dtype)
    weights = {name: value.astype(target) for name, value in to_hf(cfg.model, tensors).items()}
    if cfg.model.arch == "gpt2":
        notes.append("gpt2: c_attn's key bias written as zeros (mpitrain has none; softmax ignores it)")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _safetensors().save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg.model, dtype), indent=2) + "\n")
    notes.append(_export_tokenizer(checkpoint.index.get("tokenizer"), cfg.model, tmp))
    if out.exists():
        out.rmdir()  # empty, checked above
    tmp.replace(out)
    return notes


def _numpy_dtype(name: str):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _export_tokenizer(description: dict | None, model: ModelConfig, folder: Path) -> str:
    if not description:
        return "tokenizer: none (the run trained on synthetic tokens)"
    if description.get("kind") == "bpe":
        (folder / "tokenizer.json").write_text(description["json"])
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.seq_len}, indent=2) + "\n")
        return "tokenizer: tokenizer.json (byte-level BPE; AutoTokenizer.from_pretrained reads it)"
    return BYTE_TOKENIZER_NOTE


# ----------------------------------------------------------------------------- import
@dataclass
class HFModel:
    """A Hugging Face folder read into mpitrain's terms: full tensors by global name (stored dtype)."""
    path: Path
    model: ModelConfig
    tensors: dict
    tokenizer: dict | None
    notes: list = field(default_factory=list)


def read_hf_folder(path) -> HFModel:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise HFFormatError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        hf = json.loads((path / "config.json").read_text())
        model, tied = model_config_from_hf(hf, str(path / "config.json"))
    except (ValueError, TypeError) as exc:
        raise HFFormatError(f"{path / 'config.json'} is unreadable: {exc}") from None
    except KeyError as exc:
        raise HFFormatError(f"{path / 'config.json'} lacks key {exc}") from None
    tensors, notes = from_hf(model, _read_weights(path), tied)
    return HFModel(path, model, tensors, _import_tokenizer(path, notes), notes)


def _read_weights(path: Path) -> dict:
    if (path / WEIGHTS_INDEX).is_file():  # a sharded save: the index names the files
        files = sorted(set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise HFFormatError(f"{path} holds no *.safetensors weights (a pytorch_model.bin folder: load it in "
                            f"transformers and save_pretrained it again, which writes safetensors)")
    weights = {}
    for name in files:
        weights.update(_safetensors().load_file(str(path / name)))
    return weights


def _import_tokenizer(path: Path, notes: list) -> dict | None:
    """tokenizer.json (the `tokenizers` library's file, any model) becomes the checkpoint's tokenizer."""
    if not (path / "tokenizer.json").is_file():
        notes.append("tokenizer: none in the folder (give data tokenized with the model's own tokenizer)")
        return None
    try:
        return BPETokenizer.from_json((path / "tokenizer.json").read_text()).description()
    except MpitrainError as exc:
        notes.append(f"tokenizer.json not kept: {exc}")
    except Exception as exc:  # noqa: BLE001 -- the tokenizers library raises plain Exception on a bad file
        notes.append(f"tokenizer.json not kept: unreadable by the tokenizers library ({exc})")
    return None


def import_hf(folder, out: Path) -> tuple[Path, list[str]]:
    """Write the folder's model as a committed one-rank checkpoint at step 0 in the checkpoint directory `out`
    (train.init_from, generate and ckpt export read it); returns its path and the notes."""
    hf = read_hf_folder(folder)
    if committed_checkpoints(out):
        raise CheckpointError(f"{out} already holds checkpoints: give a new directory")
    final = out / step_dir_name(0)
    partial = out / (final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    pieces = []
    for name, value in sorted(hf.tensors.items()):
        shape = tuple(value.shape)
        pieces.append((Piece("param", name, shape, (0,) * len(shape), shape, (0, int(np.prod(shape)))), value))
    record = write_rank_file(partial / rank_file_name(0), pieces)
    commit(partial, final, _index(hf, record))
    return final, hf.notes


def _index(hf: HFModel, record: dict) -> dict:
    cfg = Config(model=hf.model)
    tensors = {piece["tensor"]: {"global_shape": piece["global_shape"], "dtype": piece["dtype"]}
               for piece in record["pieces"]}
    return {"format": FORMAT_VERSION, "step": 0, "imported_from": str(hf.path.resolve()),
            "layout": {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0},
            "config": to_toml(cfg), "tokenizer": hf.tokenizer,
            "train_state": {"next_step": 0, "optimizer_steps": 0}, "extra_state": {},
            "tensors": dict(sorted(tensors.items())), "files": [record]}


# ----------------------------------------------------------------------------- train.init_from = HF_DIR
class HFWeights(Checkpoint):
    """A Hugging Face folder that reads like a checkpoint (params only, step 0), so that load_weights puts it into
    any layout. A gpt2 run with a shorter model.seq_len than the folder's n_positions takes the first rows of wpe."""

    @classmethod
    def open_folder(cls, path, run_model: ModelConfig) -> HFWeights:
        hf = read_hf_folder(path)
        model, tensors = hf.model, hf.tensors
        if model.arch == "gpt2" == run_model.arch and run_model.seq_len < model.seq_len:
            hf.notes.append(f"wpe: the first {run_model.seq_len} of {model.seq_len} positions (model.seq_len)")
            tensors = {**tensors, "embed.wpe": tensors["embed.wpe"][:run_model.seq_len]}
            model = replace(model, seq_len=run_model.seq_len)
        infos = {name: {"global_shape": list(value.shape), "dtype": str(value.dtype)}
                 for name, value in tensors.items()}
        weights = cls(Path(path), {"step": 0, "config": to_toml(Config(model=model)), "tensors": infos, "files": []})
        weights.full, weights.notes = tensors, hf.notes
        return weights

    def read_box(self, kind: str, tensor: str, box_offset, box_shape, dtype) -> np.ndarray:
        if kind != "param" or tensor not in self.full:
            raise CheckpointError(f"{self.path} has no {kind} for tensor {tensor}")
        full = self.full[tensor]
        out = np.zeros(box_shape, dtype=dtype)  # parts outside the tensor (vocabulary padding) stay zero
        inside = tuple(slice(o, min(o + n, g)) for o, n, g in zip(box_offset, box_shape, full.shape))
        out[tuple(slice(0, s.stop - s.start) for s in inside)] = full[inside]
        return out
