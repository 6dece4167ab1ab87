"""The parts of a training run around the steps (mpitrain/train_loop.py's loop calls them): the run log, checkpointing
and resilience. Each owns its state; none reaches into the trainer."""
