"""Turns text files (or the Python standard library) into one HDF5 file of train and val token streams."""

import json
import os
import platform
import sysconfig
from pathlib import Path

import h5py
import numpy as np

from mpitrain.data.tokenizer import BPETokenizer, ByteTokenizer, token_dtype
from mpitrain.errors import DataError
from mpitrain.profile.progress import BIG_BYTES, progress

STDLIB = "python-stdlib"
SEPARATOR = "\n\n"
DEFAULT_BPE_VOCAB = 4096
# Tests, bundled tools and vendored wheels are either huge, repetitive or not the stdlib proper; without them the
# corpus is ~12 MB of ordinary library code.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo",
                "__pycache__"}


def prepare_dataset(sources, out_path, tokenizer="byte", vocab_size=None, val_fraction=0.05, max_bytes=None,
                    tokenizer_file=None):
    """Reads, tokenizes and splits the documents of `sources`; writes `out_path`; returns a summary dict.
    `tokenizer_file`: a tokenizer.json (e.g. a Hugging Face model's) to tokenize with instead of `tokenizer`."""
    if not 0 < val_fraction < 1:  # written so that NaN fails it too
        raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_bytes is not None and not max_bytes > 0:
        raise DataError(f"max_bytes must be > 0, got {max_bytes}")
    paths, source_label = _document_paths(sources)
    documents = _read_documents(paths, max_bytes)
    if not documents:
        raise DataError(f"found no text (UTF-8) document in {source_label}")
    if len(documents) < 2:  # one text file: cut it at line breaks into pieces so that val can be held out
        documents = _cut_at_lines(documents[0], pieces=max(2, round(2 / val_fraction)))
    train_docs, val_docs = split_documents(documents, val_fraction)
    if tokenizer_file:  # fine-tuning a pretrained model: its own tokenizer, not a new one
        tok, tokenizer = _tokenizer_from_file(tokenizer_file), str(tokenizer_file)
    else:
        tok = _build_tokenizer(tokenizer, vocab_size, train_docs)
    splits = {"train": _encode_documents(tok, train_docs), "val": _encode_documents(tok, val_docs)}
    attrs = {"tokenizer": json.dumps(tok.description()), "vocab_size": tok.vocab_size,
             "source": source_label, "n_documents": len(documents)}
    _write_atomically(out_path, splits, attrs)
    return {"out": str(out_path), "source": source_label, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
            "documents": len(documents), "train_documents": len(train_docs), "val_documents": len(val_docs),
            "bytes": sum(len(d.encode("utf-8")) for d in documents),
            "train_tokens": len(splits["train"]), "val_tokens": len(splits["val"])}


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


def _read_documents(paths, max_bytes):
    """Texts of the files that are UTF-8, stopping (and cutting the last one) once `max_bytes` have been read."""
    documents, total = [], 0
    size = sum(path.stat().st_size for path in paths)
    if max_bytes is not None:
        size = min(size, max_bytes)
    bar = progress(total=size, desc="reading", unit="B", unit_scale=True, show=size >= BIG_BYTES)
    for path in paths:
        data = path.read_bytes()
        bar.update(len(data))
        if max_bytes is not None:
            data = data[:max_bytes - total]
        text = _as_text(data)
        if text:
            documents.append(text)
            total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    bar.close()
    return documents


def _as_text(data):
    # NUL bytes are valid UTF-8 but mark binary files; a cut at max_bytes may split a character, so drop its tail.
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start >= len(data) - 3 and err.reason == "unexpected end of data":
            return data[:err.start].decode("utf-8")
        return None


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


def _encode_documents(tok, documents):
    separator = tok.encode(SEPARATOR)
    pieces = []
    big = sum(len(doc) for doc in documents) >= BIG_BYTES  # characters, near enough to bytes for the threshold
    for i, doc in enumerate(progress(documents, desc="tokenizing", unit="doc", show=big)):
        pieces += [separator, tok.encode(doc)] if i else [tok.encode(doc)]
    return np.concatenate(pieces).astype(token_dtype(tok.vocab_size))


def _write_atomically(out_path, splits, attrs):
    """Writes a temp file beside `out_path` and renames it, so a crash never leaves a half-written dataset."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder, so os.replace is an atomic rename; pid in the name keeps concurrent writers apart.
    tmp_path = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp_path, "w") as f:
            for name, tokens in splits.items():
                f.create_dataset(name, data=tokens)
            f.attrs.update(attrs)
        os.replace(tmp_path, out_path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)  # h5py may have failed before creating it
        raise
