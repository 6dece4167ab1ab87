"""Hugging Face export and import (mpitrain/checkpoint/hf.py, hf_names.py): transformers loads what we export and
computes our logits; what transformers saves we import with its logits; export then import is bitwise."""
from __future__ import annotations

import json

import numpy as np
import pytest

from mpitrain.checkpoint.resume import resolve_checkpoint
from mpitrain.checkpoint.store import Checkpoint
from mpitrain.generate import load_checkpoint_model
from tests.mpi_helpers import describe, run_mpi

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers: "
                                                          "pip install -e '.[test]'")
pytest.importorskip("safetensors", reason="the Hugging Face tests need safetensors: pip install -e '.[test]' "
                                          "(or '.[hf]')")
torch = pytest.importorskip("torch", reason="transformers' models run on torch: pip install -e '.[test]' "
                                            "(torch==2.13.0)")

MODELS = {"gpt2": ["model.arch=gpt2"], "llama": ["model.arch=llama", "model.n_kv_head=2"]}  # llama: GQA
SEQ = 32  # configs/tiny.toml: 2 layers, d_model 32, 4 heads, vocabulary 256, seq_len 32


def full_logits(model, state, tokens):
    """mpitrain's forward over every position of a whole (tp = 1) model: the units, then the head's logits."""
    ctx, x, head = model.context(tokens.shape[1]), tokens, len(model.units) - 1
    for i, unit in enumerate(model.units):
        p = model._params(state, i, "forward")
        x = unit.logits(p, x) if i == head else unit.forward(p, x, ctx)[0]
    return np.asarray(x, dtype=np.float64)


def hf_logits(folder_or_model, tokens):
    model = folder_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32)
    model.eval()  # a model built in the test is in training mode: dropout
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


def assert_close(got, want, rel=1e-4):
    err = np.abs(got - want).max()
    assert err <= rel * np.abs(want).max(), f"max difference {err:.3e}, largest logit {np.abs(want).max():.3e}"


def cli(*args, n=1):
    result = run_mpi(n, ["-m", "mpitrain", *args], timeout=300)
    assert result.returncode == 0, describe(result)
    return result.stdout


def checkpoint_tensors(path):
    checkpoint = Checkpoint.open(resolve_checkpoint(path))
    return {name: checkpoint.read_box("param", name, (0,) * len(info["global_shape"]), info["global_shape"],
                                      np.dtype(info["dtype"])) for name, info in checkpoint.tensors().items()}


# ------------------------------------------------------------------------------------------ export
@pytest.fixture(scope="module", params=list(MODELS))
def trained(request, tmp_path_factory):
    """A tiny model trained 3 steps in float32 under tp 2 x pp 2 (synthetic tokens): (arch, run directory)."""
    run_dir = tmp_path_factory.mktemp(f"run_{request.param}")
    settings = ["data.synthetic=true", "train.steps=3", "parallel.tp=2", "parallel.pp=2", *MODELS[request.param]]
    cli("train", "configs/tiny.toml", "--out", str(run_dir), *[a for s in settings for a in ("--set", s)], n=4)
    return request.param, run_dir


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trained run exported through the CLI: (arch, run directory, HF folder, what the export printed)."""
    arch, run_dir = trained
    out = tmp_path_factory.mktemp(f"exported_{arch}") / "hf"
    return arch, run_dir, out, cli("ckpt", "export", str(run_dir), str(out), "--format", "hf")


def test_export_from_tp2_pp2_gives_our_logits_in_transformers(exported):
    arch, run_dir, out, printed = exported
    assert ("key bias written as zeros" in printed) == (arch == "gpt2") and "synthetic" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]]
    model, state, _, _ = load_checkpoint_model(run_dir)
    tokens = np.random.default_rng(0).integers(0, 256, (2, SEQ))
    ours = full_logits(model, state, tokens)
    assert_close(hf_logits(out, tokens), ours)
    if arch == "llama":  # GQA reached transformers as such, and the head is untied
        assert config["num_key_value_heads"] == 2 and not config["tie_word_embeddings"]


def test_export_then_import_is_bitwise(exported, tmp_path):
    _, run_dir, out, _ = exported
    cli("ckpt", "import", str(out), str(tmp_path / "back"))
    before, after = checkpoint_tensors(run_dir), checkpoint_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and np.array_equal(after[name], value), name


def test_bfloat16_export_rounds_each_weight_once(trained, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file

    from mpitrain.checkpoint.hf import export_hf
    from mpitrain.checkpoint.hf_names import to_hf
    _, run_dir = trained
    checkpoint = Checkpoint.open(resolve_checkpoint(run_dir))
    export_hf(checkpoint, tmp_path / "bf16", "bfloat16")
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    cfg = load_checkpoint_model(run_dir)[3]
    expected = to_hf(cfg.model, checkpoint_tensors(run_dir))
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        assert saved[name].dtype == ml_dtypes.bfloat16, name
        assert np.array_equal(saved[name], value.astype(ml_dtypes.bfloat16)), name


def test_export_refuses_a_folder_in_use(trained, tmp_path):
    _, run_dir = trained
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    result = run_mpi(1, ["-m", "mpitrain", "ckpt", "export", str(run_dir), str(tmp_path / "busy"), "--format", "hf"])
    assert result.returncode == 1 and "not an empty folder" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr and (tmp_path / "busy" / "keep.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------ import
def random_hf_model(arch, **changes):
    """A randomly initialised transformers model of configs/tiny.toml's size, every tensor nonzero (gpt2's biases
    and key bias included, llama's norm gains off 1) so that no mapping hides behind a zero or a one."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=SEQ,
                                         bos_token_id=0, eos_token_id=0, **changes)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                                          max_position_embeddings=SEQ, rms_norm_eps=1e-5, **changes)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1:
                tensor.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def hf_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    model = random_hf_model(request.param)
    model.save_pretrained(folder)
    return request.param, folder, model


def test_import_gives_the_logits_of_transformers(hf_folder, tmp_path):
    arch, folder, model = hf_folder
    printed = cli("ckpt", "import", str(folder), str(tmp_path / "ckpt"))
    assert ("key bias dropped" in printed) == (arch == "gpt2")
    ours, state, _, cfg = load_checkpoint_model(tmp_path / "ckpt")
    assert cfg.model.arch == arch and cfg.model.kv_heads == (2 if arch == "llama" else 4)
    tokens = np.random.default_rng(1).integers(0, 256, (2, SEQ))
    assert_close(full_logits(ours, state, tokens), hf_logits(model, tokens))


def test_training_continues_from_a_transformers_folder_under_dp2(hf_folder, tmp_path):
    """train.init_from = the folder itself: step 1's loss is transformers' loss on step 1's batch, and it trains
    (llama as LoRA fine-tuning: the base stays bitwise the folder's, the adapters move)."""
    from mpitrain.data.synthetic import SyntheticSampler
    arch, folder, model = hf_folder
    run_dir = tmp_path / "run"
    lora = ["lora.rank=4"] if arch == "llama" else []
    settings = ["data.synthetic=true", "train.steps=2", "parallel.dp=2", f"train.init_from={folder}", *MODELS[arch],
                *lora]
    printed = cli("train", "configs/tiny.toml", "--out", str(run_dir), *[a for s in settings for a in ("--set", s)],
                  n=2)
    assert "(Hugging Face;" in printed
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [1, 2]
    tokens, targets = SyntheticSampler(256, SEQ, 8, 1234).global_batch_rows(0, range(8))  # tiny.toml's batch, seed
    logits = torch.tensor(hf_logits(model, tokens))
    want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.tensor(targets).reshape(-1)))
    assert metrics[0]["loss"] == pytest.approx(want, rel=1e-5)
    trained = checkpoint_tensors(run_dir)
    embedding = model.state_dict()["transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"]
    if lora:
        assert np.array_equal(trained["embed.wte"], embedding.numpy())
        assert any(np.abs(value).max() > 0 for name, value in trained.items() if name.endswith("_lora_b"))
    else:
        assert not np.array_equal(trained["embed.wte"], embedding.numpy())


def test_sharded_bfloat16_folders_import_exactly(tmp_path):
    """A save_pretrained split over several files (an index names them), in bfloat16: every value kept exactly."""
    from mpitrain.checkpoint.hf import read_hf_folder
    model = random_hf_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = read_hf_folder(tmp_path / "sharded").tensors
    theirs = {name: value.float().numpy() for name, value in model.state_dict().items()}
    assert np.array_equal(ours["blocks.1.wk"].astype(np.float32), theirs["model.layers.1.self_attn.k_proj.weight"].T)
    assert np.array_equal(ours["head.w_lm"].astype(np.float32), theirs["lm_head.weight"].T)
    assert len(ours) == len(theirs) and all(str(value.dtype) == "bfloat16" for value in ours.values())


def test_what_mpitrain_cannot_compute_is_refused_in_one_line(tmp_path):
    random_hf_model("llama", attention_bias=True).save_pretrained(tmp_path / "biased")
    result = run_mpi(1, ["-m", "mpitrain", "ckpt", "import", str(tmp_path / "biased"), str(tmp_path / "out")])
    assert result.returncode == 1 and "attention_bias = True cannot be represented" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    random_hf_model("llama").save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "model.safetensors").unlink()  # as in a folder of pytorch_model.bin only
    result = run_mpi(1, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run"), "--set",
                         "data.synthetic=true", "--set", "model.arch=llama", "--set",
                         f"train.init_from={tmp_path / 'plain'}"])
    assert result.returncode != 0 and "holds no *.safetensors weights" in result.stderr, describe(result)


def test_refusals_name_the_key():
    from mpitrain.checkpoint.hf_names import HFFormatError, model_config_from_hf
    llama = random_hf_model("llama").config.to_dict()
    for change, key in (({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
                        ({"hidden_act": "gelu"}, "hidden_act"), ({"head_dim": 16}, "head_dim"),
                        ({"model_type": "mistral"}, "model_type")):
        with pytest.raises(HFFormatError, match=key):
            model_config_from_hf({**llama, **change}, "config.json")
    with pytest.raises(HFFormatError, match="activation_function"):
        model_config_from_hf({**random_hf_model("gpt2").config.to_dict(), "activation_function": "relu"}, "c")


def test_a_bpe_tokenizer_goes_out_and_back(tmp_path):
    """A run's BPE tokenizer is exported as tokenizer.json that transformers' AutoTokenizer reads with the same ids,
    and imported back as the same tokenizer."""
    from mpitrain.checkpoint.hf import _export_tokenizer, _import_tokenizer
    from mpitrain.config import ModelConfig
    from mpitrain.data.tokenizer import BPETokenizer
    ours = BPETokenizer.train(["def f(x):\n    return x + 1\n"] * 20 + ["import os, sys\n"] * 20, 270)
    assert "tokenizer.json" in _export_tokenizer(ours.description(), ModelConfig(), tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def g(y):\n    return os.path(y)\n"
    assert theirs(text)["input_ids"] == ours.encode(text).tolist()
    notes = []
    assert _import_tokenizer(tmp_path, notes) == ours.description() and not notes


def test_data_prepare_tokenizes_with_a_models_tokenizer_file(tmp_path):
    """Fine-tuning data in the pretrained model's tokens: data prepare --tokenizer-file DIR/tokenizer.json."""
    import h5py

    from mpitrain.data.tokenizer import BPETokenizer
    ours = BPETokenizer.train(["def f(x):\n    return x + 1\n"] * 20, 270)
    (tmp_path / "tokenizer.json").write_text(ours.description()["json"])
    (tmp_path / "corpus.txt").write_text("def f(y):\n    return y + 1\n" * 40)
    out = tmp_path / "data.h5"
    cli("data", "prepare", "--source", str(tmp_path / "corpus.txt"), "--out", str(out), "--tokenizer-file",
        str(tmp_path / "tokenizer.json"))
    with h5py.File(out, "r") as f:
        assert json.loads(f.attrs["tokenizer"]) == ours.description() and f.attrs["vocab_size"] == 270
        assert f["train"][()].max() >= 256  # the file's merges, not bytes
    (tmp_path / "bad.json").write_text("{}")
    result = run_mpi(1, ["-m", "mpitrain", "data", "prepare", "--source", str(tmp_path / "corpus.txt"), "--out",
                         str(tmp_path / "bad.h5"), "--tokenizer-file", str(tmp_path / "bad.json")])
    assert result.returncode == 1 and "bad.json is not a tokenizer.json" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr


def test_a_llama_with_tied_embeddings_gets_a_copied_head(tmp_path):
    from mpitrain.checkpoint.hf import import_hf
    model = random_hf_model("llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied")
    final, notes = import_hf(tmp_path / "tied", tmp_path / "ckpt")
    assert any("tie_word_embeddings" in note for note in notes)
    ours, state, _, _ = load_checkpoint_model(final)
    tokens = np.random.default_rng(2).integers(0, 256, (2, SEQ))
    assert_close(full_logits(ours, state, tokens), hf_logits(model, tokens))


def test_a_lora_run_exports_with_its_adapters_merged(tmp_path):
    """transformers computes the logits of base + (alpha / r) a b, and the trained adapters do change them."""
    from mpitrain.backend import make_backend
    from mpitrain.config import ModelConfig
    from mpitrain.layers.lora import merge
    from mpitrain.model.gpt import GPT
    from mpitrain.state.replicated import ReplicatedState
    settings = ["data.synthetic=true", "train.steps=2", "lora.rank=4", "lora.alpha=8.0", *MODELS["llama"]]
    cli("train", "configs/tiny.toml", "--out", str(tmp_path / "run"), *[a for s in settings for a in ("--set", s)])
    printed = cli("ckpt", "export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf")
    assert "4 adapters merged" in printed  # wq and wv of 2 layers
    tensors = {name: value.astype(np.float64) for name, value in checkpoint_tensors(tmp_path / "run").items()}
    cfg = ModelConfig(arch="llama", n_layer=2, d_model=32, n_head=4, n_kv_head=2, vocab_size=256, seq_len=SEQ)
    tokens = np.random.default_rng(4).integers(0, 256, (2, SEQ))
    logits = []
    for weights in (merge(tensors, 4, 8.0), tensors):  # the second: the adapters left out
        model = GPT(cfg, make_backend("cpu", "float32"))
        state = ReplicatedState(model.layouts, model.backend, None)
        for name, view in state.params.named_views():
            view[...] = weights[name]
        logits.append(full_logits(model, state, tokens))
    theirs = hf_logits(tmp_path / "hf", tokens)
    assert_close(theirs, logits[0])
    assert np.abs(theirs - logits[1]).max() > 1e-3 * np.abs(theirs).max()


def test_an_old_style_gpt2_folder_imports_like_a_new_one(tmp_path):
    """The hub's original GPT-2 files: names without 'transformer.', causal-mask buffers saved beside the weights."""
    from safetensors.numpy import save_file

    from mpitrain.checkpoint.hf import read_hf_folder
    model, folder = random_hf_model("gpt2"), tmp_path / "new"
    model.save_pretrained(folder)
    weights = {name.removeprefix("transformer."): value.numpy() for name, value in model.state_dict().items()
               if name != "lm_head.weight"}
    for i in range(2):
        weights[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, SEQ, SEQ), np.float32))
        weights[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    (tmp_path / "old").mkdir()
    save_file(weights, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((folder / "config.json").read_text())
    old, new = read_hf_folder(tmp_path / "old").tensors, read_hf_folder(folder).tensors
    assert old.keys() == new.keys() and all(np.array_equal(old[name], new[name]) for name in new)
