"""Reading a prepared dataset file and cutting its token streams into reproducible batches."""

import json
import os

import h5py
import numpy as np

from mpitrain.data.documents import no_boundaries_error, starts_after_eod, stored_starts
from mpitrain.data.tokenizer import tokenizer_from_description
from mpitrain.errors import DataError

SPLITS = ("train", "val")
# The val sampler's seed differs from train's so that the two never walk their windows in the same order.
VAL_SEED_OFFSET = 1


# Token ids are checked this many at a time: a bounded buffer (32 MiB of uint64 at most) however large the file.
CHECK_CHUNK_TOKENS = 1 << 22


class TokenDataset:
    """A file written by `prepare_dataset`, read into memory when opened (corpora here are small).

    Opening checks the whole file, so that bad data is refused with one line before any step trains on it: both
    splits present, 1-D, of an integer dtype, not empty, and every id in [0, vocab_size). The ids are checked chunk by
    chunk as each split is read into memory, so the check adds no pass over the file and no temporary larger than a
    chunk. (A maximum stored at prepare time would still have to be read to be trusted.)
    """

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
                self._attrs = dict(f.attrs)
                vocab_size = self.vocab_size
                self._tokens = {name: self._read_split(name, f[name], vocab_size) for name in SPLITS}
                # where documents start (data.document_mask), when the file stores it
                self._doc_starts = {name: np.asarray(f[f"{name}_doc_starts"][()], dtype=np.int64)
                                    if f"{name}_doc_starts" in f else None for name in SPLITS}
        except OSError as err:
            raise DataError(f"cannot read dataset file {self.path}: {err}") from None

    def _read_split(self, name, data, vocab_size) -> np.ndarray:
        """The split's tokens, after checking its shape, dtype and that every id is a valid token."""
        where = f"dataset file {self.path}, split {name!r}"
        if not isinstance(data, h5py.Dataset):
            raise DataError(f"{where}: is not an array of token ids; re-create it with: mpitrain data prepare")
        if data.ndim != 1:
            raise DataError(f"{where}: token ids must be 1-D, got shape {data.shape}")
        if data.dtype.kind not in "iu":
            raise DataError(f"{where}: token ids must be integers, got dtype {data.dtype}")
        if data.shape[0] == 0:
            raise DataError(f"{where}: is empty (no tokens)")
        tokens = np.empty(data.shape, dtype=data.dtype)
        low, high = _id_range(data, into=tokens)
        if low < 0:
            raise DataError(f"{where}: min id {low} < 0")
        if high >= vocab_size:
            raise DataError(f"{where}: max id {high} >= vocabulary {vocab_size} (the file's vocab_size attribute)")
        return tokens

    def _attr(self, key):
        if key not in self._attrs:
            raise DataError(f"dataset file {self.path} lacks the attribute {key!r}; re-create it")
        return self._attrs[key]

    @property
    def vocab_size(self):
        value = self._attr("vocab_size")
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise DataError(f"dataset file {self.path}: attribute vocab_size = {value} is not a positive integer")
        return int(value)

    @property
    def tokenizer(self):
        try:
            description = json.loads(self._attr("tokenizer"))
        except (TypeError, ValueError):
            raise DataError(f"dataset file {self.path}: attribute 'tokenizer' is not a JSON description") from None
        if not isinstance(description, dict):
            raise DataError(f"dataset file {self.path}: attribute 'tokenizer' is not a JSON description")
        return tokenizer_from_description(description)

    @property
    def eod_id(self):
        """The end-of-document token id, or None (no eod_id attribute, or -1: a tokenizer without one)."""
        value = self._attrs.get("eod_id")
        return None if value is None or int(value) < 0 else int(value)

    def doc_starts(self, split):
        """The sorted stream offsets of the split's documents' first tokens, or None when the file has none."""
        self._check_split(split)
        return self._doc_starts[split]

    def _check_split(self, split):
        if split not in SPLITS:
            raise DataError(f"no split {split!r} in {self.path} (has: {', '.join(SPLITS)})")

    def n_tokens(self, split):
        self._check_split(split)
        return len(self._tokens[split])

    def tokens(self, split):
        """The whole split as a 1-D numpy array (its file dtype)."""
        self._check_split(split)
        return self._tokens[split]


class BatchSampler:
    """The global batch of step s is a pure function of (seed, s), so any rank can compute its own rows alone.

    The split is cut into windows of seq_len + 1 tokens starting every seq_len tokens (inputs = window[:-1],
    targets = window[1:]). Global sample g = s * global_batch + row belongs to epoch g // n_windows, which visits
    the windows in the order of a permutation seeded by (seed, epoch). With a batch ramp (train.batch_rampup: an
    object with batch_size(s) and samples_before(s), optim/schedule.BatchRamp) step s has its own batch size and
    g = samples_before(s) + row: still a pure function of the step.
    """

    def __init__(self, dataset, split, seq_len, global_batch, seed, ramp=None):
        self.seq_len, self.global_batch, self.seed, self.ramp = seq_len, global_batch, seed, ramp
        n_tokens = dataset.n_tokens(split)
        if n_tokens < seq_len + 1:
            raise DataError(f"the {split} split of {dataset.path} has {n_tokens} tokens, fewer than "
                            f"seq_len + 1 = {seq_len + 1}; lower seq_len or prepare more data")
        self.tokens = dataset.tokens(split)
        self.n_windows = (n_tokens - 1) // seq_len
        self._permutations = {}
        self.eod_id, self.doc_starts, self.path = dataset.eod_id, dataset.doc_starts(split), dataset.path

    def _permutation(self, epoch):
        # A batch touches at most a couple of epochs, and steps come in order: keep only the latest few.
        if epoch not in self._permutations:
            if len(self._permutations) >= 4:
                self._permutations.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.n_windows)
        return self._permutations[epoch]

    def _first_sample(self, step):
        return self.ramp.samples_before(step) if self.ramp is not None else step * self.global_batch

    def batch_size(self, step):
        """Sequences in the global batch of `step`."""
        return self.ramp.batch_size(step) if self.ramp is not None else self.global_batch

    def epoch_of(self, step):
        """The epoch that the first row of `step` belongs to."""
        return self._first_sample(step) // self.n_windows

    def global_batch_rows(self, step, rows):
        """(inputs, targets), int64 of shape (len(rows), seq_len): only `rows` of step `step`'s global batch."""
        size = self.batch_size(step)
        if isinstance(rows, slice):
            rows = range(*rows.indices(size))
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= size):
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the global batch of {size}")
        samples = self.tokens[self._token_index(step, rows)].astype(np.int64)
        return np.ascontiguousarray(samples[:, :-1]), np.ascontiguousarray(samples[:, 1:])

    def _token_index(self, step, rows):
        """(len(rows), seq_len + 1): the stream positions of the windows of `rows` of step `step`."""
        epochs, positions = np.divmod(self._first_sample(step) + rows, self.n_windows)
        windows = np.array([self._permutation(e)[p] for e, p in zip(epochs.tolist(), positions.tolist())],
                           dtype=np.int64)
        return windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)

    def document_starts(self, step, rows):
        """(len(rows), seq_len) bool: the input tokens of `rows` of step `step` that start a document (after the
        file's end-of-document token, else at its stored starts): data.document_mask, mpitrain/data/documents.py."""
        if self.eod_id is not None:
            return starts_after_eod(self.global_batch_rows(step, rows)[0], self.eod_id)
        if self.doc_starts is None:
            raise no_boundaries_error(self.path)
        return stored_starts(self._token_index(step, np.asarray(rows, dtype=np.int64))[:, :-1], self.doc_starts)


def _id_range(data, into=None) -> tuple[int, int]:
    """(min, max) token id of an HDF5 integer dataset, read CHECK_CHUNK_TOKENS at a time (and copied `into` an
    array of its shape, when given)."""
    low, high = None, None
    for start in range(0, data.shape[0], CHECK_CHUNK_TOKENS):
        chunk = data[start:start + CHECK_CHUNK_TOKENS]
        if into is not None:
            into[start:start + len(chunk)] = chunk
        low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
        high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    return low, high


def train_and_val_samplers(dataset, seq_len, global_batch, seed, ramp=None):
    """The trainer's two samplers; val uses seed + VAL_SEED_OFFSET and is read as steps 0..eval_batches-1, always in
    whole global batches (a batch ramp, `ramp`, is the training batches' only)."""
    return (BatchSampler(dataset, "train", seq_len, global_batch, seed, ramp),
            BatchSampler(dataset, "val", seq_len, global_batch, seed + VAL_SEED_OFFSET))
