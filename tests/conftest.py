"""Session set-up shared by every test module.

The suite starts several hundred MPI jobs, and every rank of each imports mpitrain. Where PYTHONDONTWRITEBYTECODE is
set (as on our CI machines), no rank ever writes a .pyc, so each one compiled every mpitrain module from source again:
about 0.35 s of CPU per rank and launch, several minutes over the suite on two cores. Compiling once here (py_compile
writes the cache whatever that variable says; ranks still read it) removes that cost and changes nothing else.
"""
from __future__ import annotations

import compileall
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

for package in ("mpitrain", "tests", "benchmarks"):
    compileall.compile_dir(REPO_ROOT / package, quiet=1, workers=1)
