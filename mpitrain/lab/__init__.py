"""`mpitrain lab`: each claim of the chapter reproduced on this machine, beside the formula it comes from.

A lab is a module with NAME, TITLE, `ranks(quick)` (how many MPI ranks it needs), `job(world, quick)` (run on every
rank, returns a JSON-able dict on rank 0, None elsewhere), `rows(result)` (the table) and `plot(result, axes)`.
runner.py launches the job with mpiexec; nothing here runs MPI in the calling process. A lab that drives
`mpitrain launch` itself (faults) defines `run_host(quick)` instead of `job`.

Every command imports this package (cli.py registers `mpitrain lab`), so a lab imports at its top only what keeps
`mpitrain --help` light: no numpy, no model, no MPI. Its `job` imports the model stack inside, in the worker ranks.
"""
from __future__ import annotations

from mpitrain.lab import faults, memory, mfu, pipeline, recompute, roofline, tensor, zero

LABS = {lab.NAME: lab for lab in (zero, pipeline, recompute, memory, tensor, mfu, roofline, faults)}
