"""Documents packed into a row: which document each token is in and its position inside it (`data.document_mask`).

A batch row is a window of the token stream, so it holds the end of one document, whole ones, the start of another.
Where a document starts is known from the row alone (after each end-of-document (EOD) token, for a tokenizer that has
one, and for data.synthetic's SYNTHETIC_EOD) or from the starts the token file stores (`SPLIT_doc_starts`, written by
`mpitrain data prepare`: the byte tokenizer has no id free for an EOD). Either way the arrays below are a pure
function of the row, so every layout (tp, pp, cp, dp, ZeRO, thread replicas) computes the same ones from the same rows:

    ids        how many documents start after the row's first token, up to this one: 0, 0, 0, 1, 1, 2, ...
    positions  the index inside the document: 0 at the row's first token and at each document start

With EOD tokens a document starts right after each EOD, so an EOD belongs to the document it ends. Attention lets
query i see key j only when ids[i] == ids[j] and positions[j] <= positions[i] (layers/attention_core.document_bias);
learned positions and RoPE use `positions` instead of the index in the row.

The loss is unchanged: every token's target is the next token of the stream, so a document's last token (its EOD)
has the next document's first token as target (predicted from nothing of that document, as a row's first token is),
the same in every layout.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mpitrain.errors import DataError

SYNTHETIC_EOD = 0  # data.synthetic's end-of-document id: random tokens end a document where they draw 0


class Documents(NamedTuple):
    """Per row of a batch: (B, T) int64 arrays (module docstring)."""
    ids: np.ndarray
    positions: np.ndarray

    def take(self, index) -> Documents:
        """The documents of the tokens at `index` along time (a cp rank's zig-zag chunks)."""
        return Documents(self.ids[:, index], self.positions[:, index])

    def rows(self, index) -> Documents:
        """The documents of the batch rows at `index` (a thread replica's rows)."""
        return Documents(self.ids[index], self.positions[index])


def starts_after_eod(inputs: np.ndarray, eod: int) -> np.ndarray:
    """(B, T) bool: the tokens of `inputs` (B, T) that start a document, those right after an `eod` token."""
    inputs = np.asarray(inputs)
    starts = np.zeros(inputs.shape, dtype=bool)
    starts[:, 1:] = inputs[:, :-1] == eod
    return starts


def stored_starts(token_index: np.ndarray, doc_starts: np.ndarray) -> np.ndarray:
    """(B, T) bool: the stream positions `token_index` (B, T) that are in the sorted `doc_starts` of the file."""
    found = np.minimum(np.searchsorted(doc_starts, token_index), len(doc_starts) - 1)
    return doc_starts[found] == token_index


def documents_from_starts(starts: np.ndarray) -> Documents:
    """The documents of rows whose tokens are flagged where a document starts, (B, T) bool (the first column, which
    starts the row's first document whatever it holds, is not read)."""
    starts = np.asarray(starts, dtype=bool).copy()
    starts[:, 0] = True
    ids = np.cumsum(starts, axis=1, dtype=np.int64) - 1
    index = np.broadcast_to(np.arange(starts.shape[1], dtype=np.int64), starts.shape)
    first_of_document = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return Documents(ids, index - first_of_document)


def documents_of(inputs: np.ndarray, eod: int) -> Documents:
    """The documents of the rows of `inputs` (B, T): a new one starts after every `eod` token."""
    return documents_from_starts(starts_after_eod(inputs, eod))


def no_boundaries_error(path: str) -> DataError:
    """data.document_mask on a token file whose rows cannot say where their documents end."""
    return DataError(f"data.document_mask = true needs document boundaries, and dataset file {path} has neither an "
                     "end-of-document token (attribute eod_id) nor document starts (train_doc_starts); re-create it "
                     "with a current `mpitrain data prepare` or set data.document_mask = false")


def check_document_boundaries(*samplers) -> None:
    """data.document_mask's check at start: every token file read (a mix's each) says where documents start."""
    for sampler in samplers:
        for each in getattr(sampler, "samplers", [sampler]):  # a data.mix sampler draws from several files
            if each.eod_id is None and each.doc_starts is None:
                raise no_boundaries_error(each.path)
