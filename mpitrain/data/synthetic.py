"""Random tokens as a pure function of (seed, step, row): data for benchmarks and layout tests, no file needed."""
from __future__ import annotations

import numpy as np


class SyntheticSampler:
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
