"""Communication: process groups with byte counters, the parallel mesh, abort-on-error and the hang watchdog.
The only MPI users."""

from mpitrain.comm.counters import COUNTER_KINDS, merge_counters, ring_bytes
from mpitrain.comm.failure import abort_on_error, run_or_abort
from mpitrain.comm.group import Group, GroupBase
from mpitrain.comm.mesh import (
    GROUP_KINDS,
    Coordinates,
    Degrees,
    Mesh,
    group_members,
    mesh_coordinates,
    pipeline_neighbours,
    validate_degrees,
)
from mpitrain.comm.operations import Handle, Operation, ProgressRecord, progress

__all__ = [
    "COUNTER_KINDS",
    "GROUP_KINDS",
    "Coordinates",
    "Degrees",
    "Group",
    "GroupBase",
    "Handle",
    "Mesh",
    "Operation",
    "ProgressRecord",
    "abort_on_error",
    "group_members",
    "merge_counters",
    "mesh_coordinates",
    "pipeline_neighbours",
    "progress",
    "ring_bytes",
    "run_or_abort",
    "validate_degrees",
]
