"""Random tokens as a pure function of (seed, step, row): data for benchmarks and layout tests, no file needed."""
from __future__ import annotations

import numpy as np

from mpitrain.data.documents import SYNTHETIC_EOD, starts_after_eod


class SyntheticSampler:
    eod_id = SYNTHETIC_EOD  # data.document_mask: a document ends at every drawn SYNTHETIC_EOD

    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int):
        self.vocab_size, self.seq_len, self.global_batch, self.seed = vocab_size, seq_len, global_batch, seed

    def epoch_of(self, step: int) -> int:
        return 0

    def global_batch_rows(self, step: int, rows):
        if isinstance(rows, slice):
            rows = range(*rows.indices(self.global_batch))
        samples = np.stack([np.random.default_rng([self.seed, step, row]).integers(0, self.vocab_size, self.seq_len + 1)
                            for row in rows])
        return np.ascontiguousarray(samples[:, :-1]), np.ascontiguousarray(samples[:, 1:])

    def document_starts(self, step: int, rows):
        """(len(rows), seq_len) bool: the input tokens that start a document, those after a SYNTHETIC_EOD."""
        return starts_after_eod(self.global_batch_rows(step, rows)[0], SYNTHETIC_EOD)
