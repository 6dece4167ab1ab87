"""Data: tokenizers, turning text into an HDF5 token file, and reproducible batches from it."""

from mpitrain.data.dataset import BatchSampler, TokenDataset, train_and_val_samplers
from mpitrain.data.prepare import prepare_dataset
from mpitrain.data.tokenizer import BPETokenizer, ByteTokenizer, tokenizer_from_description

__all__ = ["BPETokenizer", "BatchSampler", "ByteTokenizer", "TokenDataset", "prepare_dataset",
           "tokenizer_from_description", "train_and_val_samplers"]
