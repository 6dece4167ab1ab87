"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained locally on the corpus.

Each tokenizer describes itself as a JSON-serialisable dict that is stored in the dataset file, so the file alone is
enough to decode its tokens again.
"""

import numpy as np

from mpitrain.errors import DataError

# The names tokenizers give the token that ends a document (GPT-2, Llama 3, Llama 2 / Mistral, Gemma), first match.
END_OF_DOCUMENT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def token_dtype(vocab_size):
    """Smallest unsigned dtype holding every id: halves the file and memory for vocabularies up to 65535."""
    return np.uint16 if vocab_size <= 65535 else np.uint32


class ByteTokenizer:
    """One token per UTF-8 byte: no training, no unknown tokens, any text round-trips."""

    vocab_size = 256
    eod_id = None  # every id is a byte: none is free to mark a document's end

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids):
        # A model may emit a byte sequence that is not valid UTF-8; show it as U+FFFD rather than fail.
        return bytes(np.asarray(ids, dtype=np.int64).tolist()).decode("utf-8", errors="replace")

    def description(self):
        return {"kind": "byte", "vocab_size": self.vocab_size}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("BPE tokenizer needs the 'tokenizers' package: pip install 'mpitrain[bpe]'") from None
    return tokenizers


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` library: starts from all 256 bytes, so it never meets an unknown token."""

    def __init__(self, hf_tokenizer):
        self._tokenizer = hf_tokenizer

    @classmethod
    def train(cls, texts, vocab_size):
        """Learns merges from an iterable of strings until the vocabulary has `vocab_size` entries."""
        tokenizers = _import_tokenizers()
        byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
        tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(  # id 0 ends each document (prepare.py appends it)
            vocab_size=vocab_size, initial_alphabet=byte_level.alphabet(), show_progress=False,
            special_tokens=[END_OF_DOCUMENT_NAMES[0]])
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, json_text):
        return cls(_import_tokenizers().Tokenizer.from_str(json_text))

    @property
    def vocab_size(self):
        return self._tokenizer.get_vocab_size()

    @property
    def eod_id(self):
        """The id of the end-of-document token, or None when the vocabulary has none."""
        ids = (self._tokenizer.token_to_id(name) for name in END_OF_DOCUMENT_NAMES)
        return next((i for i in ids if i is not None), None)

    def encode(self, text):
        return np.asarray(self._tokenizer.encode(text).ids, dtype=token_dtype(self.vocab_size))

    def decode(self, ids):
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist())

    def description(self):
        return {"kind": "bpe", "vocab_size": self.vocab_size, "json": self._tokenizer.to_str()}


def tokenizer_from_description(desc):
    """Rebuilds the tokenizer whose `description()` was `desc`."""
    kind = desc.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if not isinstance(desc.get("json"), str):
            raise DataError("BPE tokenizer description has no 'json' entry with the trained tokenizer")
        return BPETokenizer.from_json(desc["json"])
    raise DataError(f"unknown tokenizer kind {kind!r} in tokenizer description (expected 'byte' or 'bpe')")
