"""Blending several prepared token files by weight (`data.mix`), reproducibly and resumably.

Row r of step s comes from file i with probability weight_i / sum(weights): the row draws u in [0, 1) from a random
stream seeded by (seed, s) (the stream's r-th number, so the draw does not depend on the batch size) and takes the
file whose share of [0, 1) holds u. Inside file i the row reads what that file's own `BatchSampler` gives for
(s, r): the window at its global sample position (s * global_batch + r without a batch ramp) in its shuffled epochs.
Everything is a pure function of (seed, s, r), like `BatchSampler`: a resumed run and any data-parallel layout see
the same global batch, with no state to save. A file thus reads the positions where it was drawn, a weight-sized
share of each of its epochs at random (some windows twice before others once, as sampling with replacement would).

Validation reads the mix too: the files' val splits drawn by the same weights with the val seed, so val_loss is the
loss on the blend the run trains on.
"""
from __future__ import annotations

import os

import numpy as np

from mpitrain.data.dataset import VAL_SEED_OFFSET, BatchSampler, TokenDataset
from mpitrain.errors import ConfigError, DataError, shown_path

MIX_STREAM = 0x6D6978  # "mix": keeps the file draws' random stream apart from the samplers' window permutations


class MixSampler:
    """The global batch of step s drawn from several samplers by weight; the same interface as `BatchSampler`."""

    def __init__(self, samplers, weights, seed):
        if len(samplers) != len(weights) or not samplers:
            raise ValueError("a mix needs one weight per sampler, and at least one sampler")
        self.samplers, self.seed = samplers, seed
        self.seq_len, self.global_batch = samplers[0].seq_len, samplers[0].global_batch
        shares = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.shares = shares
        self._bounds = np.cumsum(shares)[:-1]  # file i takes u in [bounds[i-1], bounds[i]); the last one, up to 1

    def batch_size(self, step):
        """Sequences in the global batch of `step` (the samplers' own: a batch ramp reaches them all alike)."""
        return self.samplers[0].batch_size(step)

    def sources_of(self, step, rows) -> np.ndarray:
        """The index of the file each of `rows` of step `step` comes from."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        # numbers are drawn in order, so the r-th of (max row + 1) draws is the same for any batch size
        draws = np.random.default_rng([self.seed, MIX_STREAM, step]).random(int(rows.max()) + 1)[rows]
        return np.searchsorted(self._bounds, draws, side="right")

    def global_batch_rows(self, step, rows):
        """(inputs, targets), int64 of shape (len(rows), seq_len): only `rows` of step `step`'s global batch."""
        return self._from_files(step, rows, lambda sampler, its_rows: sampler.global_batch_rows(step, its_rows))

    def document_starts(self, step, rows):
        """Where documents start in `rows` of step `step` (data.document_mask), each row's from its own file."""
        return self._from_files(step, rows, lambda sampler, its_rows: (sampler.document_starts(step, its_rows),))[0]

    def _from_files(self, step, rows, read):
        """read(sampler, rows) of each file for the rows drawn from it, put back in the order of `rows`: a tuple of
        arrays with one row per row asked for."""
        if isinstance(rows, slice):
            rows = range(*rows.indices(self.batch_size(step)))
        rows = np.asarray(rows, dtype=np.int64)
        sources = self.sources_of(step, rows)
        gathered = None
        for index, sampler in enumerate(self.samplers):
            mine = np.flatnonzero(sources == index)
            if mine.size:
                parts = read(sampler, rows[mine])
                if gathered is None:
                    gathered = tuple(np.empty((len(rows), *part.shape[1:]), dtype=part.dtype) for part in parts)
                for whole, part in zip(gathered, parts):
                    whole[mine] = part
        return gathered if gathered is not None else read(self.samplers[0], rows)  # no rows: empty arrays


def open_mix(sources) -> list[TokenDataset]:
    """The token files of data.mix ([(path, weight)], config.DataConfig.mix_sources), each opened and checked, after
    checking that they share one tokenizer: a token id must mean the same text in every file."""
    datasets = []
    for path, _ in sources:
        if not os.path.isfile(path):  # named as data.path's is: a relative path with where it was resolved from
            raise ConfigError(f"config key data.mix: data file {shown_path(path)} not found (create it with: "
                              f"mpitrain data prepare --source python-stdlib --out {path})")
        try:
            datasets.append(TokenDataset(path))
        except DataError as err:
            raise ConfigError(f"config key data.mix: {err}") from None
    first = datasets[0]
    for other in datasets[1:]:
        if other.tokenizer.description() != first.tokenizer.description():
            raise ConfigError(f"config key data.mix: {other.path} and {first.path} were tokenized differently "
                              f"(vocabularies {other.vocab_size} and {first.vocab_size}, or other tokenizers); a mix "
                              "needs one tokenizer: prepare them with the same --tokenizer / --tokenizer-file")
    return datasets


def mix_samplers(sources, seq_len, global_batch, seed, ramp=None):
    """(train MixSampler, val MixSampler, the first file's TokenDataset) for data.mix's [(path, weight)]. ramp:
    train.batch_rampup's, for the train split only (val is read in whole global batches, as without a mix)."""
    datasets = open_mix(sources)
    weights = [weight for _, weight in sources]
    val_seed = seed + VAL_SEED_OFFSET
    train = [BatchSampler(dataset, "train", seq_len, global_batch, seed, ramp) for dataset in datasets]
    val = [BatchSampler(dataset, "val", seq_len, global_batch, val_seed) for dataset in datasets]
    return MixSampler(train, weights, seed), MixSampler(val, weights, val_seed), datasets[0]
