"""Documents from the files people keep text in: plain text, JSON lines (optionally gzipped) and Parquet.

A file's format follows from its name: `.jsonl` / `.jsonl.gz` hold one JSON object per line, `.parquet` a table,
anything else is one plain-text document (skipped when it is not UTF-8 text). The JSON lines and Parquet readers
take each document's text from one field / column (`--text-field`, "text" by default).
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from mpitrain.errors import DataError

TEXT_FIELD = "text"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIX = ".parquet"
PARQUET_BATCH_ROWS = 4096  # rows read from a Parquet file at a time: memory bounded by a batch, not the file


def file_format(path: Path) -> str:
    """'jsonl', 'parquet' or 'text', from the file's name."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIX):
        return "parquet"
    return "text"


def read_documents(path: Path, text_field: str = TEXT_FIELD):
    """Yields the texts of the documents in `path`, in file order."""
    kind = file_format(path)
    if kind == "jsonl":
        yield from _jsonl_documents(path, text_field)
    elif kind == "parquet":
        yield from _parquet_documents(path, text_field)
    else:
        text = as_text(path.read_bytes())
        if text:
            yield text


def as_text(data: bytes) -> str | None:
    """The bytes as UTF-8 text, or None for a binary file (NUL bytes are valid UTF-8 but mark binaries)."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _jsonl_documents(path: Path, text_field: str):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    yield _jsonl_text(line, path, number, text_field)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"{path}: not a readable gzip file ({err})") from None


def _jsonl_text(line: bytes, path: Path, number: int, text_field: str) -> str:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise DataError(f"{where}: no {text_field!r} field (--text-field names the field that holds the text)")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text


def _import_parquet(path: Path):
    try:
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading Parquet ({path}) needs pyarrow: pip install 'mpitrain[parquet]'") from None
    return pyarrow.parquet


def _parquet_documents(path: Path, text_field: str):
    parquet = _import_parquet(path)
    try:
        table = parquet.ParquetFile(path)
        columns = table.schema_arrow.names
        if text_field not in columns:
            raise DataError(f"{path}: no column {text_field!r} (has: {', '.join(columns)}; --text-field names the "
                            "column that holds the text)")
        row = 0
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise DataError(f"{path}, row {row}: column {text_field!r} holds "
                                    f"{type(text).__name__}, not a string")
                yield text
                row += 1
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 -- pyarrow raises its own ArrowInvalid / OSError kinds on a bad file
        raise DataError(f"cannot read Parquet file {path}: {err}") from None
