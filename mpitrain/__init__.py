"""mpitrain: train transformer language models across many MPI ranks, one readable piece at a time."""

__version__ = "0.1.0"
