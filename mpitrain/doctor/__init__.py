"""`mpitrain doctor`: what went wrong at scale. `hang` reads the ranks' flight records (hang.py); `parity` runs one
step of a layout beside a one-process float64 reference and names the first tensor that differs (parity.py);
`precision` replays each layer of a low-precision run in float64 on the run's own inputs and names the layers whose
error is over the recipe's bound (precision.py)."""
