"""Run a few MPI ranks from a test: `run_mpi(4, ["-m", "mpitrain.cli", ...])` or `run_python_mpi(4, code)`.

Ranks run as a separate `mpiexec` job with MPICH's yield settings and one BLAS thread each, so many ranks share a
few cores without spinning (docs/architecture.md, Backends). A job that outlives its timeout is killed with all its
ranks and the test fails showing what the ranks printed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

OVERSUBSCRIBED_ENV = {
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def find_mpiexec() -> str | None:
    """mpiexec of the running venv first (the `mpich` wheel puts it beside python), then the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec")


def run_mpi(n: int, args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mpiexec -n n python *args` from the repository root; returns the finished process (output captured)."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside the Python interpreter or on PATH: pip install -e '.[mpich]'")
    full_env = dict(os.environ)
    full_env.update(OVERSUBSCRIBED_ENV)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    command = [mpiexec, "-n", str(n), sys.executable, *args]
    # A new session, so that on timeout we can kill mpiexec together with every rank it started.
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=full_env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"MPI job timed out after {timeout} s (hung?): {' '.join(command)}\n"
            f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_python_mpi(n: int, code: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Write `code` (dedented) to a temporary script and run it on n ranks."""
    with tempfile.TemporaryDirectory(prefix="mpitrain-test-") as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(textwrap.dedent(code))
        return run_mpi(n, [str(script)], timeout=timeout, env=env)


def run_python_mpi_results(n: int, code: str, timeout: float = 120, env: dict | None = None):
    """Run `code` on n ranks; it must exit 0 and print one line 'RESULTS <json>' (from one rank). Returns the json."""
    import json
    result = run_python_mpi(n, code, timeout=timeout, env=env)
    assert result.returncode == 0, describe(result)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, describe(result)
    return json.loads(lines[0][len("RESULTS "):])


def describe(result: subprocess.CompletedProcess) -> str:
    """The exit code and output of a job, for assertion messages."""
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
