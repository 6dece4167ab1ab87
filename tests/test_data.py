"""Tests of mpitrain.data: tokenizers, dataset preparation and the reproducible batch sampler."""

import json
import os

import h5py
import numpy as np
import pytest

from mpitrain.data import (
    BatchSampler,
    ByteTokenizer,
    TokenDataset,
    prepare_dataset,
    tokenizer_from_description,
    train_and_val_samplers,
)
from mpitrain.errors import DataError

# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld, 日本語 🚀\n\tdef f(): pass"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_decodes_invalid_utf8_as_replacement():
    assert ByteTokenizer().decode([104, 0xFF, 105]) == "h\ufffdi"


def test_byte_tokenizer_description_rebuilds_it():
    desc = json.loads(json.dumps(ByteTokenizer().description()))
    tok = tokenizer_from_description(desc)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256


def test_unknown_tokenizer_kind_is_a_data_error():
    with pytest.raises(DataError, match="unknown tokenizer kind"):
        tokenizer_from_description({"kind": "sentencepiece"})


# ---------------------------------------------------------------- prepare


def _write_corpus(folder, n_docs=20):
    """Text files with one unique marker each, one binary file and one nested folder."""
    (folder / "nested").mkdir(parents=True)
    for i in range(n_docs):
        sub = folder / "nested" if i % 2 else folder
        (sub / f"doc{i:02d}.txt").write_text(f"<doc{i:02d}> some text about topic {i}, café\n" * 3)
    (folder / "image.bin").write_bytes(bytes(range(256)))
    return [f"<doc{i:02d}>" for i in range(n_docs)]


def test_prepare_folder_splits_documents_and_writes_attrs(tmp_path):
    markers = _write_corpus(tmp_path / "corpus")
    out = tmp_path / "out" / "data.h5"
    summary = prepare_dataset([str(tmp_path / "corpus")], out, val_fraction=0.2)

    assert summary["documents"] == 20 and summary["val_documents"] == 4  # the binary file is skipped
    with h5py.File(out, "r") as f:
        assert f["train"].dtype == np.uint16 and f["train"].ndim == 1
        assert f.attrs["vocab_size"] == 256 and f.attrs["n_documents"] == 20
        assert json.loads(f.attrs["tokenizer"])["kind"] == "byte"
        assert "corpus" in f.attrs["source"]
        assert len(f["train"]) == summary["train_tokens"] and len(f["val"]) == summary["val_tokens"]
    dataset = TokenDataset(out)
    train_text, val_text = (dataset.tokenizer.decode(dataset.tokens(s)) for s in ("train", "val"))
    in_train = {m for m in markers if m in train_text}
    in_val = {m for m in markers if m in val_text}
    assert in_train.isdisjoint(in_val) and in_train | in_val == set(markers) and len(in_val) == 4
    assert "\n\n<doc" in train_text  # documents are joined by the separator


def test_prepare_leaves_no_temp_files(tmp_path):
    _write_corpus(tmp_path / "corpus")
    out = tmp_path / "out" / "data.h5"
    prepare_dataset([str(tmp_path / "corpus")], out)
    assert os.listdir(out.parent) == ["data.h5"]


def test_prepare_failure_leaves_neither_temp_nor_half_file(tmp_path, monkeypatch):
    _write_corpus(tmp_path / "corpus")
    out = tmp_path / "out" / "data.h5"

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        prepare_dataset([str(tmp_path / "corpus")], out)
    assert os.listdir(out.parent) == []


@pytest.mark.parametrize("option, message", [({"val_fraction": float("nan")}, "val_fraction must be between 0 and 1"),
                                             ({"val_fraction": 1.0}, "val_fraction must be between 0 and 1"),
                                             ({"max_bytes": -5}, "max_bytes must be > 0, got -5"),
                                             ({"max_bytes": 0}, "max_bytes must be > 0, got 0")])
def test_prepare_refuses_bad_options(tmp_path, option, message):
    _write_corpus(tmp_path / "corpus")
    with pytest.raises(DataError, match=message):
        prepare_dataset([str(tmp_path / "corpus")], tmp_path / "d.h5", **option)


def test_prepare_missing_source_names_it(tmp_path):
    with pytest.raises(DataError, match="no_such_dir"):
        prepare_dataset([str(tmp_path / "no_such_dir")], tmp_path / "d.h5")


def test_prepare_python_stdlib_with_max_bytes(tmp_path):
    summary = prepare_dataset(["python-stdlib"], tmp_path / "std.h5", max_bytes=30_000)
    assert summary["bytes"] <= 30_000 and summary["documents"] >= 2
    dataset = TokenDataset(tmp_path / "std.h5")
    assert dataset.n_tokens("train") == summary["train_tokens"] > 0 and dataset.n_tokens("val") > 0
    with h5py.File(tmp_path / "std.h5", "r") as f:
        assert f.attrs["source"].startswith("python-stdlib")
    # Deterministic: a second run gives the same tokens.
    prepare_dataset("python-stdlib", tmp_path / "again.h5", max_bytes=30_000)
    assert np.array_equal(TokenDataset(tmp_path / "again.h5").tokens("train"), dataset.tokens("train"))


def test_bpe_without_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    import sys
    _write_corpus(tmp_path / "corpus")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match=r"pip install 'mpitrain\[bpe\]'"):
        prepare_dataset([str(tmp_path / "corpus")], tmp_path / "d.h5", tokenizer="bpe", vocab_size=300)


def test_bpe_prepare_and_rebuild_from_file(tmp_path):
    pytest.importorskip("tokenizers", reason="BPE needs tokenizers: pip install -e '.[bpe]'")
    _write_corpus(tmp_path / "corpus")
    out = tmp_path / "bpe.h5"
    summary = prepare_dataset([str(tmp_path / "corpus")], out, tokenizer="bpe", vocab_size=300)
    assert 256 < summary["vocab_size"] <= 300
    dataset = TokenDataset(out)
    tok = dataset.tokenizer  # rebuilt from the file's attribute alone
    text = "<doc03> some text about topic 3, café\n\n日本"
    assert tok.decode(tok.encode(text)) == text
    assert dataset.tokens("train").max() < dataset.vocab_size
    assert summary["train_tokens"] < summary["bytes"]  # merges compress the text


# ---------------------------------------------------------------- dataset and sampler

SEQ_LEN, N_TOKENS = 10, 1001  # 100 windows of 11 tokens, each starting 10 tokens after the previous


def _write_counting_dataset(path, n_train=N_TOKENS, n_val=201):
    """Token i is i, so a window's first token tells which window it is."""
    with h5py.File(path, "w") as f:
        f["train"] = np.arange(n_train, dtype=np.uint16)
        f["val"] = np.arange(n_val, dtype=np.uint16)
        f.attrs.update(tokenizer=json.dumps(ByteTokenizer().description()), vocab_size=65535, source="test",
                       n_documents=2)
    return path


@pytest.fixture
def counting(tmp_path):
    return TokenDataset(_write_counting_dataset(tmp_path / "count.h5"))


def test_same_seed_and_step_give_the_same_batch(counting):
    a = BatchSampler(counting, "train", SEQ_LEN, 8, seed=3).global_batch_rows(5, slice(None))
    b = BatchSampler(counting, "train", SEQ_LEN, 8, seed=3).global_batch_rows(5, slice(None))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    other_step = BatchSampler(counting, "train", SEQ_LEN, 8, seed=3).global_batch_rows(6, slice(None))
    other_seed = BatchSampler(counting, "train", SEQ_LEN, 8, seed=4).global_batch_rows(5, slice(None))
    assert not np.array_equal(a[0], other_step[0]) and not np.array_equal(a[0], other_seed[0])


def test_rows_requested_in_halves_equal_the_whole_batch(counting):
    sampler = BatchSampler(counting, "train", SEQ_LEN, 8, seed=0)
    whole_inputs, whole_targets = sampler.global_batch_rows(12, range(8))  # step 12 straddles epochs 0 and 1
    first, second = sampler.global_batch_rows(12, slice(0, 4)), sampler.global_batch_rows(12, range(4, 8))
    assert np.array_equal(np.concatenate([first[0], second[0]]), whole_inputs)
    assert np.array_equal(np.concatenate([first[1], second[1]]), whole_targets)
    assert whole_inputs.shape == (8, SEQ_LEN) and whole_inputs.dtype == np.int64


def test_targets_are_inputs_shifted_by_one(counting):
    inputs, targets = BatchSampler(counting, "train", SEQ_LEN, 8, seed=0).global_batch_rows(0, slice(None))
    assert np.array_equal(targets[:, :-1], inputs[:, 1:])
    assert np.array_equal(targets, inputs + 1)  # with counting tokens the last target is the next token too
    assert np.all(inputs[:, 0] % SEQ_LEN == 0)  # windows start on multiples of seq_len


def test_every_window_is_visited_once_per_epoch(counting):
    global_batch = 7  # does not divide the 100 windows: epochs change in the middle of a batch
    sampler = BatchSampler(counting, "train", SEQ_LEN, global_batch, seed=1)
    assert sampler.n_windows == 100
    starts = np.concatenate([sampler.global_batch_rows(step, slice(None))[0][:, 0] for step in range(30)])
    epoch0, epoch1 = starts[:100] // SEQ_LEN, starts[100:200] // SEQ_LEN
    assert sorted(epoch0) == list(range(100)) and sorted(epoch1) == list(range(100))
    assert not np.array_equal(epoch0, epoch1)  # each epoch has its own order
    assert sampler.epoch_of(14) == 0 and sampler.epoch_of(15) == 1  # sample 105 is the first of step 15


def test_val_sampler_uses_its_own_split_and_seed(counting):
    train, val = train_and_val_samplers(counting, SEQ_LEN, 4, seed=0)
    assert val.n_windows == 20 and val.seed == train.seed + 1
    inputs, _ = val.global_batch_rows(0, slice(None))
    assert inputs.max() < 201


def test_split_shorter_than_a_window_is_a_data_error(tmp_path):
    dataset = TokenDataset(_write_counting_dataset(tmp_path / "short.h5", n_val=5))
    with pytest.raises(DataError, match=r"val split of .*short\.h5 has 5 tokens.*seq_len \+ 1 = 11"):
        BatchSampler(dataset, "val", SEQ_LEN, 4, seed=0)


def test_missing_dataset_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "data.h5"
    with pytest.raises(DataError, match=f"dataset file not found: {path}.*mpitrain data prepare"):
        TokenDataset(path)


def test_file_without_splits_is_a_data_error(tmp_path):
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f["train"] = np.arange(10, dtype=np.uint16)
    with pytest.raises(DataError, match=r"empty\.h5 has no val split"):
        TokenDataset(path)


# ---------------------------------------------------------------- bad files are refused when opened, in one line

def _write_tokens(path, train, val=None, **attrs):
    """A dataset file with the given token arrays and attributes (defaults: byte tokenizer, vocabulary 256)."""
    with h5py.File(path, "w") as f:
        f["train"] = train
        f["val"] = np.arange(50, dtype=np.uint16) if val is None else val
        f.attrs.update({"tokenizer": json.dumps(ByteTokenizer().description()), "vocab_size": 256, **attrs})
    return path


def _open_error(path) -> str:
    with pytest.raises(DataError) as info:
        TokenDataset(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("train, split, problem", [
    (np.array([1, 2, 300, 4], dtype=np.uint16), "train", "max id 300 >= vocabulary 256"),
    (np.array([1, -1, 3], dtype=np.int32), "train", "min id -1 < 0"),
    (np.arange(40, dtype=np.float32), "train", "token ids must be integers, got dtype float32"),
    (np.arange(40, dtype=np.float64), "train", "token ids must be integers, got dtype float64"),
    (np.ones(40, dtype=bool), "train", "token ids must be integers, got dtype bool"),
    (np.zeros((4, 10), dtype=np.uint16), "train", "token ids must be 1-D, got shape (4, 10)"),
    (np.zeros(0, dtype=np.uint16), "train", "is empty (no tokens)"),
])
def test_bad_token_arrays_are_refused_naming_file_split_and_problem(tmp_path, train, split, problem):
    message = _open_error(_write_tokens(tmp_path / "bad.h5", train))
    assert f"split {split!r}: {problem}" in message, message


def test_bad_ids_in_the_val_split_are_named_as_val(tmp_path):
    path = _write_tokens(tmp_path / "bad.h5", np.arange(100, dtype=np.uint16), val=np.array([7, 256], np.uint16))
    assert "split 'val': max id 256 >= vocabulary 256" in _open_error(path)


def test_the_id_check_reads_in_chunks_and_finds_an_id_in_the_last_one(tmp_path, monkeypatch):
    import mpitrain.data.dataset as dataset_module
    tokens = np.arange(1000, dtype=np.uint16) % 256
    tokens[-1] = 999  # the one bad id sits in the last, partial chunk
    path = _write_tokens(tmp_path / "bad.h5", tokens)
    monkeypatch.setattr(dataset_module, "CHECK_CHUNK_TOKENS", 64)
    assert "max id 999 >= vocabulary 256" in _open_error(path)

    class RecordingReads:  # an HDF5 dataset stand-in that remembers which slices were read
        shape = tokens.shape

        def __init__(self):
            self.reads = []

        def __getitem__(self, index):
            self.reads.append((index.start, index.stop))
            return tokens[index]

    for chunk in (1, 7, 64, 999, 1000, 5000):
        monkeypatch.setattr(dataset_module, "CHECK_CHUNK_TOKENS", chunk)
        data, copy = RecordingReads(), np.zeros_like(tokens)
        assert dataset_module._id_range(data, into=copy) == (0, 999)
        np.testing.assert_array_equal(copy, tokens)  # the split is loaded by the same pass that checks it
        assert all(stop - start <= chunk for start, stop in data.reads), (chunk, data.reads)  # bounded memory
        assert [start for start, _ in data.reads] == list(range(0, 1000, chunk))  # every token read once


def test_missing_or_bad_attributes_and_splits_are_refused(tmp_path):
    ok = np.arange(100, dtype=np.uint16)
    path = tmp_path / "no_train.h5"
    with h5py.File(path, "w") as f:
        f["val"] = ok
    assert "has no train split" in _open_error(path)
    path = _write_tokens(tmp_path / "vocab.h5", ok, vocab_size=0)
    assert "attribute vocab_size = 0 is not a positive integer" in _open_error(path)
    path = tmp_path / "no_vocab.h5"
    with h5py.File(path, "w") as f:
        f["train"], f["val"] = ok, ok
    assert "lacks the attribute 'vocab_size'" in _open_error(path)
    path = tmp_path / "group.h5"
    with h5py.File(path, "w") as f:
        f.create_group("train")
        f["val"] = ok
        f.attrs["vocab_size"] = 256
    assert "split 'train': is not an array of token ids" in _open_error(path)
    dataset = TokenDataset(_write_tokens(tmp_path / "tok.h5", ok, tokenizer="{not json"))
    with pytest.raises(DataError, match="attribute 'tokenizer' is not a JSON description"):
        _ = dataset.tokenizer


def test_a_good_file_opens_with_the_largest_id_allowed(tmp_path):
    dataset = TokenDataset(_write_tokens(tmp_path / "ok.h5", np.array([0, 255, 3], dtype=np.int64)))
    assert dataset.n_tokens("train") == 3 and dataset.tokens("train").max() == 255


def test_training_on_out_of_vocabulary_ids_stops_at_start_in_one_line(tmp_path):
    from tests.mpi_helpers import describe, run_mpi
    tokens = np.arange(5000, dtype=np.uint16) % 256
    tokens[4321] = 300
    path = _write_tokens(tmp_path / "bad.h5", tokens)
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run"),
                         "--set", f"data.path={path}", "--set", "logging.peak_flops=1e9"], timeout=300)
    assert result.returncode != 0, describe(result)
    assert f"dataset file {path}, split 'train': max id 300 >= vocabulary 256" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr and "step" not in result.stdout, describe(result)
