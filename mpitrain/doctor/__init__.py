"""`mpitrain doctor`: what went wrong at scale. `hang` reads the ranks' flight records (hang.py); `parity` runs one
step of a layout beside a one-process float64 reference and names the first tensor that differs (parity.py)."""
