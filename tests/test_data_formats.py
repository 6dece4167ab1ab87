"""`mpitrain data prepare` on data as people have it: JSON lines (plain and gzipped), Parquet, folders of them, several
sources; tokenizing in worker processes with the same file for any number; document starts and end-of-document
tokens stored for each split; errors that name the file and line."""
from __future__ import annotations

import gzip
import itertools
import json
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.data import TokenDataset, prepare_dataset
from mpitrain.data import prepare as prepare_module
from mpitrain.errors import DataError
from tests.mpi_helpers import describe, run_mpi

PARQUET_SKIP = "Parquet needs pyarrow, the optional 'parquet' extra: pip install 'mpitrain[parquet]'"


def _texts(prefix, n):
    return [f"<{prefix}{i:02d}> {prefix} document {i}: some words, café, and a line\n" * 3 for i in range(n)]


def _write_jsonl(path, texts, field="text", compress=False):
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines + "\n")  # a blank last line is skipped


def _write_parquet(path, texts, field="text"):
    pyarrow = pytest.importorskip("pyarrow", reason=PARQUET_SKIP)
    import pyarrow.parquet
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pyarrow.table({field: texts, "n": list(range(len(texts)))})
    pyarrow.parquet.write_table(table, path, row_group_size=7)  # several row groups


def _documents(path, split):
    """The documents of a prepared split, cut at its stored starts and decoded."""
    dataset = TokenDataset(path)
    with h5py.File(path, "r") as f:
        starts = f[f"{split}_doc_starts"][:]
    tokens = dataset.tokens(split)
    bounds = list(starts) + [len(tokens)]
    return [dataset.tokenizer.decode(tokens[a:b]) for a, b in itertools.pairwise(bounds)], starts


def test_jsonl_gz_and_text_in_nested_folders_and_several_sources(tmp_path):
    corpus = tmp_path / "corpus"
    _write_jsonl(corpus / "b" / "part.jsonl.gz", _texts("gz", 10), compress=True)
    _write_jsonl(corpus / "a.jsonl", _texts("js", 10))
    (corpus / "c.txt").write_text("<plain> a plain text file\n" * 4)
    (corpus / ".hidden.jsonl").write_text("not read\n")
    other = tmp_path / "other.jsonl"
    _write_jsonl(other, _texts("ot", 5))
    out = tmp_path / "mixed.h5"
    summary = prepare_dataset([str(corpus), str(other)], out, val_fraction=0.2, workers=1)

    assert summary["documents"] == 26 and summary["val_documents"] == 5
    train, starts = _documents(out, "train")
    val, _ = _documents(out, "val")
    # files in sorted path order (a.jsonl, b/part.jsonl.gz, c.txt), then the second source; every 5th held out
    expected = _texts("js", 10) + _texts("gz", 10) + ["<plain> a plain text file\n" * 4] + _texts("ot", 5)
    held_out = [expected[i] for i in range(4, 26, 5)]
    kept = [t for i, t in enumerate(expected) if (i + 1) % 5]
    # the byte tokenizer has no end-of-document token: a blank line ends every document but the last
    assert train == [t + "\n\n" for t in kept[:-1]] + kept[-1:]
    assert val == [t + "\n\n" for t in held_out[:-1]] + held_out[-1:]
    assert starts.dtype == np.int64 and starts[0] == 0
    with h5py.File(out, "r") as f:
        assert f.attrs["eod_id"] == -1 and f.attrs["n_documents"] == 26


def test_text_field_option_and_a_line_without_it_names_file_and_line(tmp_path):
    good = tmp_path / "body.jsonl"
    _write_jsonl(good, _texts("b", 6), field="body")
    summary = prepare_dataset([str(good)], tmp_path / "b.h5", text_field="body")
    assert summary["documents"] == 6
    with pytest.raises(DataError, match=r"body\.jsonl, line 1: no 'text' field"):
        prepare_dataset([str(good)], tmp_path / "x.h5")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 4: field 'text' is int, not a string"):
        prepare_dataset([str(bad)], tmp_path / "x.h5")
    bad.write_text('{"text": "one"}\n{"text": "tw\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: not valid JSON"):
        prepare_dataset([str(bad)], tmp_path / "x.h5")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"broken\.jsonl\.gz: not a readable gzip file"):
        prepare_dataset([str(broken)], tmp_path / "x.h5")


def test_parquet_documents_in_row_order(tmp_path):
    texts = _texts("pq", 20)
    _write_parquet(tmp_path / "data" / "t.parquet", texts, field="content")
    out = tmp_path / "pq.h5"
    summary = prepare_dataset([str(tmp_path / "data")], out, text_field="content", val_fraction=0.25)
    assert summary["documents"] == 20 and summary["val_documents"] == 5
    train, _ = _documents(out, "train")
    assert [t.removesuffix("\n\n") for t in train] == [t for i, t in enumerate(texts) if (i + 1) % 4]


def test_parquet_errors_name_the_file(tmp_path):
    _write_parquet(tmp_path / "t.parquet", _texts("pq", 3))
    with pytest.raises(DataError, match=r"t\.parquet: no column 'body' \(has: text, n"):
        prepare_dataset([str(tmp_path / "t.parquet")], tmp_path / "x.h5", text_field="body")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(DataError, match=r"cannot read Parquet file \S*broken\.parquet"):
        prepare_dataset([str(tmp_path / "broken.parquet")], tmp_path / "x.h5")


def test_a_parquet_null_is_refused_naming_file_and_row(tmp_path):
    _write_parquet(tmp_path / "t.parquet", ["one", "two", None, "four"])
    with pytest.raises(DataError, match=r"t\.parquet, row 2: column 'text' holds NoneType, not a string"):
        prepare_dataset([str(tmp_path / "t.parquet")], tmp_path / "x.h5")


def test_max_bytes_stops_inside_a_jsonl_file_and_cuts_the_last_document(tmp_path):
    texts = _texts("m", 10)
    _write_jsonl(tmp_path / "d.jsonl", texts)
    size = len(texts[0].encode("utf-8"))
    summary = prepare_dataset([str(tmp_path / "d.jsonl")], tmp_path / "m.h5", max_bytes=3 * size + 10,
                              val_fraction=0.5)
    assert summary["documents"] == 4 and summary["bytes"] == 3 * size + 10
    train, _ = _documents(tmp_path / "m.h5", "train")
    val, _ = _documents(tmp_path / "m.h5", "val")
    assert train[0].removesuffix("\n\n") == texts[0] and val[-1] == texts[3][:10]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow.parquet` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"t\.parquet\) needs pyarrow: pip install 'mpitrain\[parquet\]'"):
        prepare_dataset([str(tmp_path / "t.parquet")], tmp_path / "x.h5")


def test_bpe_documents_end_with_its_end_of_document_token(tmp_path):
    pytest.importorskip("tokenizers", reason="BPE needs the optional 'tokenizers' package: pip install 'mpitrain[bpe]'")
    _write_jsonl(tmp_path / "d.jsonl", _texts("d", 12))
    out = tmp_path / "bpe.h5"
    prepare_dataset([str(tmp_path / "d.jsonl")], out, tokenizer="bpe", vocab_size=300, val_fraction=0.25)
    dataset = TokenDataset(out)
    eod = dataset.tokenizer.eod_id
    with h5py.File(out, "r") as f:
        assert eod is not None and f.attrs["eod_id"] == eod
        for split in ("train", "val"):
            tokens, starts = f[split][:], f[f"{split}_doc_starts"][:]
            ends = np.append(starts[1:], len(tokens)) - 1
            assert np.array_equal(np.flatnonzero(tokens == eod), ends)  # exactly one EOD, at each document's end
    train, _ = _documents(out, "train")
    assert train == [t for i, t in enumerate(_texts("d", 12)) if (i + 1) % 4]  # decoding drops the EOD


def test_the_file_is_byte_identical_for_one_and_two_workers(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="BPE needs the optional 'tokenizers' package: pip install 'mpitrain[bpe]'")
    _write_jsonl(tmp_path / "a.jsonl", _texts("a", 30))
    _write_jsonl(tmp_path / "b.jsonl.gz", _texts("b", 30), compress=True)
    monkeypatch.setattr(prepare_module, "CHUNK_CHARS", 1000)  # many chunks, so both workers take some
    outputs = {}
    for workers in (1, 2):
        outputs[workers] = tmp_path / f"w{workers}.h5"
        summary = prepare_dataset([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")], outputs[workers],
                                  tokenizer="bpe", vocab_size=320, workers=workers)
        assert summary["workers"] == workers  # the pool really ran
    assert outputs[1].read_bytes() == outputs[2].read_bytes()


def test_cli_prepare_with_text_field_and_workers(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _texts("c", 8), field="body")
    out = tmp_path / "cli.h5"
    done = CliRunner().invoke(main, ["data", "prepare", "--source", str(tmp_path / "d.jsonl"), "--out", str(out),
                                     "--text-field", "body", "--workers", "2"])
    assert done.exit_code == 0, done.output
    assert "from 8 documents" in done.output and TokenDataset(out).n_tokens("train") > 0
    done = CliRunner().invoke(main, ["data", "prepare", "--source", str(tmp_path / "d.jsonl"), "--out", str(out)])
    assert done.exit_code == 1 and "d.jsonl, line 1: no 'text' field" in done.output


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_training_runs_on_prepared_jsonl_and_parquet(tmp_path, kind):
    texts = _texts(kind, 40)
    source = tmp_path / f"corpus.{kind}"
    _write_parquet(source, texts) if kind == "parquet" else _write_jsonl(source, texts)
    data = tmp_path / "data.h5"
    prepare_dataset([str(source)], data, val_fraction=0.1)
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(tmp_path / "run")]
    for setting in [f"data.path={data}", "train.steps=3", "logging.peak_flops=1e9"]:
        args += ["--set", setting]
    result = run_mpi(1, args, timeout=180)
    assert result.returncode == 0, describe(result)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(np.isfinite(m["loss"]) for m in metrics) and np.isfinite(metrics[-1]["val_loss"])
