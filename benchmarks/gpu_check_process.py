"""How gpu_check runs its stages: each in its own process and session, under a time limit, with the environment
every stage needs; and how it reads back what an inner part printed (one JSON object per line after a prefix).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "gpu_check.py"
WORK_ROOT = Path(tempfile.gettempdir()) / "mpitrain-gpu-check"
# Open MPI's mpiexec refuses to run as root without both; MPICH ignores them.
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
SUBPROCESS_DEFAULTS = {"OMP_NUM_THREADS": "4", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
                       "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
                       # one kernel cache for every stage, so each process reuses what the earlier ones compiled
                       "CUPY_CACHE_DIR": str(WORK_ROOT / "cupy-kernel-cache")}


def subprocess_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of every stage's process: the repository in front of PYTHONPATH (packages carried onto
    PYTHONPATH stay visible), Open MPI allowed to run as root, and the defaults above unless already set."""
    env = {**SUBPROCESS_DEFAULTS, **base, **OPEN_MPI_AS_ROOT}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    return env


def run(command: list[str], limit_s: float, env: dict | None = None) -> tuple[int, str]:
    """Run a command from the repository root in its own session; (exit status, output), 124 when it ran out of
    time. The session is killed at the end: mpiexec's ranks too, which would otherwise keep the GPU and the pipe."""
    process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env({**os.environ, **(env or {})}), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit_s)
        status = process.returncode
    except subprocess.TimeoutExpired:
        _kill_session(process)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a descendant left the session and holds the pipe: give up on the rest
            output = ""
        output, status = (output or "") + f"\n(timed out after {limit_s:.0f} s)", 124
    _kill_session(process)
    return status, output


def _kill_session(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing of it is left
        os.killpg(process.pid, signal.SIGKILL)


def inner(name: str, limit_s: float, env: dict | None = None) -> tuple[int, str]:
    """gpu_check.py again, in its own process, running one of its --inner parts."""
    return run([sys.executable, str(SCRIPT), "--inner", name], limit_s, env)


def json_lines(output: str, prefix: str) -> list[dict]:
    """The JSON objects an inner part printed, one per line after `prefix` (what came before a crash survives)."""
    return [json.loads(line[len(prefix):]) for line in output.splitlines() if line.startswith(prefix)]


def failed_output(status: int, output: str) -> dict:
    return {"output_tail": output[-3000:]} if status else {}


def find_mpiexec() -> str | None:
    """gpu_check.sh's choice (MPIEXEC: the carried MPICH's), else the one beside this Python, else PATH's."""
    beside = Path(sys.executable).parent / "mpiexec"
    return os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else shutil.which("mpiexec"))
