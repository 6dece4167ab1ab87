"""Reading a prepared dataset file and cutting its token streams into reproducible batches."""

import json
import os

import h5py
import numpy as np

from mpitrain.data.tokenizer import tokenizer_from_description
from mpitrain.errors import DataError

SPLITS = ("train", "val")
# The val sampler's seed differs from train's so that the two never walk their windows in the same order.
VAL_SEED_OFFSET = 1


class TokenDataset:
    """A file written by `prepare_dataset`; each split is read into memory on first use (corpora here are small)."""

    def __init__(self, path):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise DataError(f"dataset file not found: {self.path} "
                            f"(create it with: mpitrain data prepare --source python-stdlib --out {self.path})")
        try:
            with h5py.File(self.path, "r") as f:
                missing = [name for name in SPLITS if name not in f]
                if missing:
                    raise DataError(f"dataset file {self.path} has no {' or '.join(missing)} split; "
                                    "re-create it with: mpitrain data prepare")
                self._lengths = {name: len(f[name]) for name in SPLITS}
                self._attrs = dict(f.attrs)
        except OSError as err:
            raise DataError(f"cannot read dataset file {self.path}: {err}") from None
        self._tokens = {}

    def _attr(self, key):
        if key not in self._attrs:
            raise DataError(f"dataset file {self.path} lacks the attribute {key!r}; re-create it")
        return self._attrs[key]

    @property
    def vocab_size(self):
        return int(self._attr("vocab_size"))

    @property
    def tokenizer(self):
        return tokenizer_from_description(json.loads(self._attr("tokenizer")))

    def _check_split(self, split):
        if split not in SPLITS:
            raise DataError(f"no split {split!r} in {self.path} (has: {', '.join(SPLITS)})")

    def n_tokens(self, split):
        self._check_split(split)
        return self._lengths[split]

    def tokens(self, split):
        """The whole split as a 1-D numpy array, loaded once."""
        self._check_split(split)
        if split not in self._tokens:
            with h5py.File(self.path, "r") as f:
                self._tokens[split] = f[split][()]
        return self._tokens[split]


class BatchSampler:
    """The global batch of step s is a pure function of (seed, s), so any rank can compute its own rows alone.

    The split is cut into windows of seq_len + 1 tokens starting every seq_len tokens (inputs = window[:-1],
    targets = window[1:]). Global sample g = s * global_batch + row belongs to epoch g // n_windows, which visits
    the windows in the order of a permutation seeded by (seed, epoch).
    """

    def __init__(self, dataset, split, seq_len, global_batch, seed):
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        n_tokens = dataset.n_tokens(split)
        if n_tokens < seq_len + 1:
            raise DataError(f"the {split} split of {dataset.path} has {n_tokens} tokens, fewer than "
                            f"seq_len + 1 = {seq_len + 1}; lower seq_len or prepare more data")
        self.tokens = dataset.tokens(split)
        self.n_windows = (n_tokens - 1) // seq_len
        self._permutations = {}

    def _permutation(self, epoch):
        # A batch touches at most a couple of epochs, and steps come in order: keep only the latest few.
        if epoch not in self._permutations:
            if len(self._permutations) >= 4:
                self._permutations.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.n_windows)
        return self._permutations[epoch]

    def epoch_of(self, step):
        """The epoch that the first row of `step` belongs to."""
        return step * self.global_batch // self.n_windows

    def global_batch_rows(self, step, rows):
        """(inputs, targets), int64 of shape (len(rows), seq_len): only `rows` of step `step`'s global batch."""
        if isinstance(rows, slice):
            rows = range(*rows.indices(self.global_batch))
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.global_batch):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the global batch of {self.global_batch}")
        epochs, positions = np.divmod(step * self.global_batch + rows, self.n_windows)
        windows = np.array([self._permutation(e)[p] for e, p in zip(epochs.tolist(), positions.tolist())],
                           dtype=np.int64)
        token_index = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        samples = self.tokens[token_index].astype(np.int64)
        return np.ascontiguousarray(samples[:, :-1]), np.ascontiguousarray(samples[:, 1:])


def train_and_val_samplers(dataset, seq_len, global_batch, seed):
    """The trainer's two samplers; val uses seed + VAL_SEED_OFFSET and is read as steps 0..eval_batches-1."""
    return (BatchSampler(dataset, "train", seq_len, global_batch, seed),
            BatchSampler(dataset, "val", seq_len, global_batch, seed + VAL_SEED_OFFSET))
