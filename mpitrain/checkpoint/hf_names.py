"""How mpitrain's tensors and model keys are named and laid out in Hugging Face `transformers` (GPT2LMHeadModel and
LlamaForCausalLM). Pure functions over numpy arrays and dicts; the files are read and written in hf.py.

Conventions, and why each mapping is exact:
- Orientation. mpitrain stores a linear's weight (in, out) and computes x @ w. GPT-2's Conv1D stores (in, out) as
  well, so its weights copy as they are; Llama's nn.Linear stores (out, in), so its weights are transposed.
- GPT-2's c_attn fuses the query, key and value projections along the output axis: [wq | wk | wv], [bq | bk | bv].
- Key bias. mpitrain has none: b_k shifts every score of a query row by the same q.b_k, and softmax ignores a
  constant added to a row. Export writes zeros; import drops whatever it holds, and the logits do not change.
- RoPE. ops.rope_forward rotates the two halves of each head (frequency i turns columns i and i + D/2), which is
  HF Llama's `rotate_half`, with the same frequencies theta^(-2i/D): q/k weights copy without a permutation (the
  permutation from Meta's interleaved pairs happened once, when a checkpoint was converted to the HF layout).
- Heads. gpt2's head is the token embedding (tied, as in HF); llama's head is its own `lm_head`. A Llama folder
  with tied embeddings is imported with the head as a copy of the embedding (they train apart from then on).
"""
from __future__ import annotations

import numpy as np

from mpitrain.config import ModelConfig
from mpitrain.errors import ConfigError

GPT2_BLOCK = [("norm1_w", "ln_1.weight"), ("norm1_b", "ln_1.bias"), ("wo", "attn.c_proj.weight"),
              ("bo", "attn.c_proj.bias"), ("norm2_w", "ln_2.weight"), ("norm2_b", "ln_2.bias"),
              ("w_fc", "mlp.c_fc.weight"), ("b_fc", "mlp.c_fc.bias"), ("w_proj", "mlp.c_proj.weight"),
              ("b_proj", "mlp.c_proj.bias")]
LLAMA_BLOCK = [("norm1_w", "input_layernorm.weight"), ("wq", "self_attn.q_proj.weight"),
               ("wk", "self_attn.k_proj.weight"), ("wv", "self_attn.v_proj.weight"),
               ("wo", "self_attn.o_proj.weight"), ("norm2_w", "post_attention_layernorm.weight"),
               ("w_gate", "mlp.gate_proj.weight"), ("w_up", "mlp.up_proj.weight"), ("w_down", "mlp.down_proj.weight")]
# Buffers some transformers versions saved with the weights (causal masks, rotary frequencies): not parameters.
IGNORED_SUFFIXES = (".attn.masked_bias", "rotary_emb.inv_freq")


class HFFormatError(ConfigError):
    """A Hugging Face folder mpitrain cannot represent, or an mpitrain model HF cannot."""


def one_to_one(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(mpitrain name, HF name, transposed) of every tensor that maps to exactly one tensor."""
    if cfg.arch == "gpt2":
        names = [("embed.wte", "transformer.wte.weight", False), ("embed.wpe", "transformer.wpe.weight", False),
                 ("head.norm_w", "transformer.ln_f.weight", False), ("head.norm_b", "transformer.ln_f.bias", False)]
        block, prefix = GPT2_BLOCK, "transformer.h"
    else:
        names = [("embed.wte", "model.embed_tokens.weight", False), ("head.norm_w", "model.norm.weight", False),
                 ("head.w_lm", "lm_head.weight", True)]
        block, prefix = LLAMA_BLOCK, "model.layers"
    for i in range(cfg.n_layer):
        for ours, theirs in block:  # llama's matrices (w*) are transposed, its norm gains are not
            names.append((f"blocks.{i}.{ours}", f"{prefix}.{i}.{theirs}", cfg.arch == "llama" and ours[0] == "w"))
    return names


def _contiguous(array: np.ndarray, transposed: bool) -> np.ndarray:
    return np.ascontiguousarray(array.T if transposed else array)


def to_hf(cfg: ModelConfig, tensors: dict) -> dict:
    """Full mpitrain tensors by global name -> HF's state dict (numpy arrays, same dtype)."""
    out = {theirs: _contiguous(tensors[ours], transposed) for ours, theirs, transposed in one_to_one(cfg)}
    if cfg.arch == "gpt2":
        for i in range(cfg.n_layer):
            b = f"blocks.{i}."
            out[f"transformer.h.{i}.attn.c_attn.weight"] = np.concatenate(
                [tensors[b + "wq"], tensors[b + "wk"], tensors[b + "wv"]], axis=1)
            out[f"transformer.h.{i}.attn.c_attn.bias"] = np.concatenate(
                [tensors[b + "bq"], np.zeros_like(tensors[b + "bq"]), tensors[b + "bv"]])
    return out


def from_hf(cfg: ModelConfig, hf: dict, tied: bool) -> tuple[dict, list[str]]:
    """HF's state dict -> full mpitrain tensors by global name, and one-line notes on what was adapted.
    `tied`: the HF config ties the output projection to the embedding. Raises naming missing or unknown tensors."""
    notes = []
    hf = {name: value for name, value in hf.items() if not name.endswith(IGNORED_SUFFIXES)
          and not (cfg.arch == "gpt2" and name.endswith(".attn.bias") and value.ndim == 4)}  # GPT-2's causal mask
    if cfg.arch == "gpt2" and not any(name.startswith("transformer.") for name in hf):  # a GPT2Model's save
        hf = {(name if name.startswith("lm_head.") else f"transformer.{name}"): v for name, v in hf.items()}
    used = set()

    def take(name: str) -> np.ndarray:
        if name not in hf:
            raise HFFormatError(f"the Hugging Face weights lack tensor {name} (a {cfg.arch} model with "
                                f"{cfg.n_layer} layers needs it)")
        used.add(name)
        return hf[name]

    if cfg.arch == "llama" and "lm_head.weight" not in hf and tied:
        hf["lm_head.weight"] = hf.get("model.embed_tokens.weight")
        notes.append("tie_word_embeddings: mpitrain's llama has its own head; it starts as a copy of the embedding")
    out = {ours: _contiguous(take(theirs), transposed) for ours, theirs, transposed in one_to_one(cfg)}
    if cfg.arch == "gpt2":
        width = cfg.n_head * cfg.head_dim
        dropped = 0.0
        for i in range(cfg.n_layer):
            weight = take(f"transformer.h.{i}.attn.c_attn.weight")
            bias = take(f"transformer.h.{i}.attn.c_attn.bias")
            for k, name in enumerate(("wq", "wk", "wv")):
                out[f"blocks.{i}.{name}"] = np.ascontiguousarray(weight[:, k * width:(k + 1) * width])
            out[f"blocks.{i}.bq"], out[f"blocks.{i}.bv"] = bias[:width].copy(), bias[2 * width:].copy()
            dropped = max(dropped, float(np.abs(bias[width:2 * width].astype(np.float64)).max()))
        if dropped:
            notes.append(f"c_attn key bias dropped (largest |b_k| {dropped:.3g}): exact, softmax ignores a constant "
                         f"added to a row of scores")
        if "lm_head.weight" in hf:
            head = take("lm_head.weight")
            if not np.array_equal(head, out["embed.wte"]):
                raise HFFormatError("lm_head.weight differs from transformer.wte.weight: mpitrain's gpt2 ties its "
                                    "head to the token embedding and cannot hold an untied GPT-2 head")
    unknown = sorted(set(hf) - used)
    if unknown:
        raise HFFormatError(f"the Hugging Face weights hold tensors a mpitrain {cfg.arch} model has no place for: "
                            f"{', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''}")
    return out, notes


# ----------------------------------------------------------------------------- config.json
def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """The config.json that makes transformers build the same model (dropout off: mpitrain has none)."""
    common = {"vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std, "dtype": dtype, "torch_dtype": dtype,
              "bos_token_id": None, "eos_token_id": None, "use_cache": True}
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common, "n_positions": cfg.seq_len,
                "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.ff_dim,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ff_dim, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False}


def _refuse_unless(ok: bool, source: str, key: str, value, why: str) -> None:
    if not ok:
        raise HFFormatError(f"{source}: {key} = {value!r} cannot be represented in mpitrain ({why})")


def model_config_from_hf(hf: dict, source: str) -> tuple[ModelConfig, bool]:
    """(ModelConfig, tied) from a config.json dict; refuses, naming the key, what mpitrain's layers cannot compute."""
    kind = hf.get("model_type")
    _refuse_unless(kind in ("gpt2", "llama"), source, "model_type", kind, "GPT-2 and Llama are supported")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        _refuse_unless(act in ("gelu_new", "gelu_pytorch_tanh"), source, "activation_function", act,
                       "mpitrain's GPT-2 MLP is the tanh GELU")
        for key, default in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
            _refuse_unless(hf.get(key, default) is False, source, key, hf.get(key), "not in mpitrain's attention")
        _refuse_unless(hf.get("scale_attn_weights", True) is True, source, "scale_attn_weights",
                       hf.get("scale_attn_weights"), "mpitrain scales scores by 1/sqrt(head_dim)")
        d_model = hf["n_embd"]
        cfg = ModelConfig(arch="gpt2", n_layer=hf["n_layer"], d_model=d_model, n_head=hf["n_head"],
                          vocab_size=hf["vocab_size"], seq_len=hf["n_positions"], d_ff=hf.get("n_inner") or 4 * d_model,
                          norm_eps=hf.get("layer_norm_epsilon", 1e-5), init_std=hf.get("initializer_range", 0.02))
        _refuse_unless(hf.get("tie_word_embeddings", True) is True, source, "tie_word_embeddings", False,
                       "mpitrain's gpt2 head is the token embedding")
        return cfg, True
    act = hf.get("hidden_act", "silu")
    _refuse_unless(act == "silu", source, "hidden_act", act, "mpitrain's Llama MLP is SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        _refuse_unless(not hf.get(key, False), source, key, hf.get(key), "mpitrain's llama has no biases")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _refuse_unless(rope_type == "default", source, "rope_type", rope_type, "only plain RoPE, no scaling")
    d_model, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // heads
    _refuse_unless(head_dim * heads == d_model, source, "head_dim", head_dim, "mpitrain's head_dim is hidden_size / "
                   "num_attention_heads")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    cfg = ModelConfig(arch="llama", n_layer=hf["num_hidden_layers"], d_model=d_model, n_head=heads,
                      n_kv_head=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
                      seq_len=hf.get("max_position_embeddings", 2048), d_ff=hf["intermediate_size"],
                      rope_theta=float(theta), norm_eps=hf.get("rms_norm_eps", 1e-6),
                      init_std=hf.get("initializer_range", 0.02))
    return cfg, bool(hf.get("tie_word_embeddings", False))
