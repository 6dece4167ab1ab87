"""Turns documents (text, JSON lines, Parquet files or folders of them, or the Python standard library) into one HDF5
file of train and val token streams, with where each document starts.

The file holds, per split ("train", "val"): SPLIT, the 1-D token ids (uint16, or uint32 past 65535 ids), and
SPLIT_doc_starts, int64 offsets into SPLIT of each document's first token, ascending, the first 0. Each document ends
with the tokenizer's end-of-document token where it has one (attribute eod_id; -1 when not: documents are then joined
by a blank line that belongs to the document before it). Tokenizing runs in worker processes, and the file is
byte-identical whatever their number.
"""

import json
import multiprocessing
import os
import platform
import sysconfig
from pathlib import Path

import h5py
import numpy as np

from mpitrain.data.sources import TEXT_FIELD, read_documents
from mpitrain.data.tokenizer import BPETokenizer, ByteTokenizer, token_dtype, tokenizer_from_description
from mpitrain.errors import DataError
from mpitrain.profile.progress import BIG_BYTES, progress

STDLIB = "python-stdlib"
SEPARATOR = "\n\n"
DEFAULT_BPE_VOCAB = 4096
NO_EOD = -1  # the eod_id attribute of a file whose tokenizer has no end-of-document token
# Documents go to the workers in chunks of about this many characters: big enough that pickling them costs little
# beside tokenizing, small enough that a few chunks keep every worker busy.
CHUNK_CHARS = 1 << 20
# Tests, bundled tools and vendored wheels are either huge, repetitive or not the stdlib proper; without them the
# corpus is ~12 MB of ordinary library code.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo",
                "__pycache__"}


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


def prepare_dataset(sources, out_path, tokenizer="byte", vocab_size=None, val_fraction=0.05, max_bytes=None,
                    tokenizer_file=None, text_field=TEXT_FIELD, workers=1):
    """Reads, tokenizes and splits the documents of `sources`; writes `out_path`; returns a summary dict.
    `tokenizer_file`: a tokenizer.json (e.g. a Hugging Face model's) to tokenize with instead of `tokenizer`;
    `text_field`: the JSON lines field / Parquet column holding the text; `workers`: tokenizing processes, started
    by spawning (the command defaults to default_workers()): a script that asks for more than one must call this
    under `if __name__ == "__main__":`, as Python's multiprocessing requires."""
    _check_options(val_fraction, max_bytes, text_field, workers)
    paths, source_label = _document_paths(sources)
    documents = _read_documents(paths, max_bytes, text_field)
    if not documents:
        raise DataError(f"found no text (UTF-8) document in {source_label}")
    if len(documents) < 2:  # one text file: cut it at line breaks into pieces so that val can be held out
        documents = _cut_at_lines(documents[0], pieces=max(2, round(2 / val_fraction)))
    train_docs, val_docs = split_documents(documents, val_fraction)
    if tokenizer_file:  # fine-tuning a pretrained model: its own tokenizer, not a new one
        tok, tokenizer = _tokenizer_from_file(tokenizer_file), str(tokenizer_file)
    else:
        tok = _build_tokenizer(tokenizer, vocab_size, train_docs)
    splits, used_workers = _encode_splits(tok, {"train": train_docs, "val": val_docs}, workers)
    eod_id = NO_EOD if tok.eod_id is None else tok.eod_id
    attrs = {"tokenizer": json.dumps(tok.description()), "vocab_size": tok.vocab_size,
             "source": source_label, "n_documents": len(documents), "eod_id": eod_id}
    _write_atomically(out_path, splits, attrs)
    return {"out": str(out_path), "source": source_label, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
            "documents": len(documents), "train_documents": len(train_docs), "val_documents": len(val_docs),
            "bytes": sum(len(d.encode("utf-8")) for d in documents), "workers": used_workers,
            "train_tokens": len(splits["train"][0]), "val_tokens": len(splits["val"][0])}


def _check_options(val_fraction, max_bytes, text_field, workers):
    if not 0 < val_fraction < 1:  # written so that NaN fails it too
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_bytes is not None and not max_bytes > 0:
        raise DataError(f"max_bytes must be > 0, got {max_bytes}")
    if not text_field:
        raise DataError("text_field must name the field that holds each document's text, got an empty name")
    if not (isinstance(workers, int) and workers >= 1):
        raise DataError(f"workers must be an integer >= 1, got {workers!r}")


def _cut_at_lines(text, pieces):
    """`text` in about `pieces` consecutive parts, each ending at a line break where there is one."""
    parts, start, target = [], 0, max(1, len(text) // pieces)
    while start < len(text):
        end = text.find("\n", start + target)
        end = len(text) if end < 0 or len(text) - end < target // 2 else end + 1
        parts.append(text[start:end])
        start = end
    return parts if len(parts) >= 2 else [text[:len(text) // 2], text[len(text) // 2:]]


def _document_paths(sources):
    """Returns (every file to read in a fixed order, a label for the `source` attribute)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if [str(s) for s in sources] == [STDLIB]:  # a CLI's repeatable --source gives a list even for one value
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return _walk(stdlib, _STDLIB_SKIP, ".py"), f"{STDLIB} (Python {platform.python_version()}, {stdlib})"
    paths = []
    for source in map(Path, sources):
        if not source.exists():
            raise DataError(f"data source not found: {source}")
        paths += _walk(source) if source.is_dir() else [source]
    return paths, ", ".join(str(s) for s in sources)


def _walk(folder, skip_dirs=(), suffix=""):
    """Files under `folder` in sorted order, skipping hidden entries (.git, editor swap files) and `skip_dirs`."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
        found += [Path(root, f) for f in files if not f.startswith(".") and f.endswith(suffix)]
    return sorted(found)


def _read_documents(paths, max_bytes, text_field):
    """Every document of the files in order, stopping (and cutting the last one) once `max_bytes` of text are read."""
    documents, total = [], 0
    size = sum(path.stat().st_size for path in paths)
    bar = progress(total=size, desc="reading", unit="B", unit_scale=True, show=size >= BIG_BYTES)
    for path in paths:
        for text in read_documents(path, text_field):
            if max_bytes is not None and total + len(text.encode("utf-8")) > max_bytes:
                # a cut may split a character: its leftover bytes are dropped
                text = text.encode("utf-8")[:max_bytes - total].decode("utf-8", errors="ignore")
            documents.append(text)
            total += len(text.encode("utf-8"))
            if max_bytes is not None and total >= max_bytes:
                bar.close()
                return [d for d in documents if d]
        bar.update(path.stat().st_size)
    bar.close()
    return [d for d in documents if d]


def split_documents(documents, val_fraction):
    """Every (1/val_fraction)-th document goes to val, so val is spread over the corpus rather than its tail."""
    is_val = [int((i + 1) * val_fraction) > int(i * val_fraction) for i in range(len(documents))]
    if not any(is_val):
        is_val[-1] = True
    train = [d for d, v in zip(documents, is_val) if not v]
    val = [d for d, v in zip(documents, is_val) if v]
    return train, val


def _build_tokenizer(kind, vocab_size, train_docs):
    if kind == "byte":
        if vocab_size not in (None, ByteTokenizer.vocab_size):
            raise DataError(f"the byte tokenizer has vocab_size 256, not {vocab_size}; use tokenizer 'bpe' for others")
        return ByteTokenizer()
    if kind == "bpe":
        vocab_size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        if vocab_size <= 256:
            raise DataError(f"BPE vocab_size must exceed the 256 byte tokens, got {vocab_size}")
        return BPETokenizer.train(train_docs, vocab_size)  # trained on train only: val stays unseen
    raise DataError(f"unknown tokenizer {kind!r} (expected 'byte' or 'bpe')")


def _tokenizer_from_file(path):
    if not Path(path).is_file():
        raise DataError(f"tokenizer file not found: {path}")
    text = Path(path).read_text()
    try:
        return BPETokenizer.from_json(text)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the tokenizers library raises plain Exception on a bad file
        raise DataError(f"{path} is not a tokenizer.json the tokenizers library reads: {exc}") from None


def _encode_splits(tok, splits, workers):
    """({split: (tokens, doc_starts)}, the number of worker processes used). The documents go out in chunks and come
    back in order (imap), so the tokens are the same for any number of workers; a corpus of one chunk is encoded
    in-process."""
    chunks = {name: _chunks(documents) for name, documents in splits.items()}
    every_chunk = [chunk for name in splits for chunk in chunks[name]]
    characters = sum(len(doc) for chunk in every_chunk for doc in chunk)
    workers = min(workers, -(-characters // CHUNK_CHARS))  # a small corpus is not worth starting processes for
    bar = progress(total=characters, desc="tokenizing", unit="char", unit_scale=True, show=characters >= BIG_BYTES)
    if workers == 1:
        encoded = (_encode_with(tok, chunk) for chunk in every_chunk)
        pool = None
    else:  # spawned, not forked: a fork after the tokenizers library has started its threads may deadlock
        pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tok.description(),))
        encoded = pool.imap(_encode_chunk, every_chunk)
    try:
        results = {}
        for name in splits:
            pieces = []
            for chunk in chunks[name]:
                pieces += next(encoded)
                bar.update(sum(len(doc) for doc in chunk))
            results[name] = _join_documents(tok, pieces)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()  # every result is in; a failed worker's error has come back through imap
    return results, workers


def _chunks(documents):
    """Consecutive runs of documents of about CHUNK_CHARS characters each (a longer document alone)."""
    chunks, current, size = [], [], 0
    for doc in documents:
        current.append(doc)
        size += len(doc)
        if size >= CHUNK_CHARS:
            chunks.append(current)
            current, size = [], 0
    return chunks + [current] if current else chunks


_WORKER = {}  # in a worker process: its tokenizer, rebuilt from the description at the worker's start


def _start_worker(description):
    _WORKER["tokenizer"] = tokenizer_from_description(description)


def _encode_chunk(documents):
    return _encode_with(_WORKER["tokenizer"], documents)


def _encode_with(tok, documents):
    return [tok.encode(doc) for doc in documents]


def _join_documents(tok, pieces):
    """(one token stream, int64 start of each document in it): each document followed by the end-of-document token,
    or, for a tokenizer without one, by the separator before the next document."""
    dtype = token_dtype(tok.vocab_size)
    if tok.eod_id is not None:
        ending = np.array([tok.eod_id], dtype=dtype)
        pieces = [np.concatenate([piece.astype(dtype), ending]) for piece in pieces]
    else:
        separator = tok.encode(SEPARATOR).astype(dtype)
        pieces = [np.concatenate([piece.astype(dtype), separator]) for piece in pieces[:-1]] + pieces[-1:]
    lengths = np.array([len(piece) for piece in pieces], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.concatenate(pieces).astype(dtype), starts


def _write_atomically(out_path, splits, attrs):
    """Writes a temp file beside `out_path` and renames it, so a crash never leaves a half-written dataset."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder, so os.replace is an atomic rename; pid in the name keeps concurrent writers apart.
    tmp_path = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp_path, "w") as f:
            for name, (tokens, doc_starts) in splits.items():
                f.create_dataset(name, data=tokens)
                f.create_dataset(f"{name}_doc_starts", data=doc_starts)
            f.attrs.update(attrs)
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)  # h5py may have failed before creating it
        raise
