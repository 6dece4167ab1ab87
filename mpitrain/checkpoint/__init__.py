"""Sharded HDF5 checkpoints: each rank writes its pieces, one index and a commit marker make them visible."""
