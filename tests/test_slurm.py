"""SLURM: slurm/train.sbatch stops on a signal, is requeued, resumes from its checkpoints and ends exactly where an
uninterrupted run ends (float64, bitwise).

Needs a SLURM cluster that this machine can submit to: skipped when `sbatch` is missing or `sinfo` does not answer.
CI starts a private two-node cluster first (as root: `bash .ci/slurm/start.sh`; stop: `bash .ci/slurm/stop.sh`) and sets
MPITRAIN_SLURM_TEST=1, which turns a missing cluster into a failure instead of a skip. SLURM_CONF is taken from the
environment, else from the cluster that .ci/slurm/start.sh started (SLURM_CI_DIR, default /tmp/mpitrain-slurm).

Each test submits a 2-task job and interrupts it once it is under way:
- the harness alone, with a stand-in program (MPITRAIN_COMMAND): USR1 to the batch script (what `--signal=B:USR1@120`
  sends before the time limit) must reach every rank, and the script must requeue the job, which then continues;
- the real trainer, interrupted right after its first committed checkpoint, either by `scontrol requeue` (SLURM sends
  TERM to every process and restarts the job itself) through srun, or by USR1 to the batch script (the script
  requeues) through mpiexec: every logged loss, the final one included, must equal the uninterrupted run's;
- the real trainer with an injected fault (MPITRAIN_FAULT): a killed rank (the script restarts the attempt inside the
  allocation), and a stopped rank of a job on two nodes (the watchdog names its node in faults.jsonl, the restart
  runs on the other node only);
- two nodes: docs/clusters.md's two-node example (dp 2 x tp 2, 2 tasks per node) at float64 parity with one
  process, the refusal of a tp group spanning nodes, and a node lost mid-run (its slurmd and ranks SIGKILLed; the
  script finds it gone, restarts on the other node with dp 1, and the losses equal the uninterrupted run's), and
  hierarchical data parallelism (dp 4, 2 ranks per node: the two-level all-reduce and hybrid-sharded ZeRO-3) at
  parity with one process, its bytes across nodes the formulas'.
Two srun tasks on one node used to fail now and then in MPICH's MPI_Init ("Out of memory" in
MPIDI_POSIX_comm_bootstrap, "Message truncated"): MPICH names its shared-memory segment after the PMI kvs name, under
srun "JOBID.STEPID", and a step whose ranks were killed leaves /dev/shm/mpich_shm_* behind for the next job of that id
(each fresh CI cluster numbered jobs from 1; a requeued job reuses its id). train.sbatch removes its job's segments
before each step, and .ci/slurm/start.sh draws its first job id at random (slurm/README.md has the measurements).
A requeued job is held ~10 s on the CI cluster before it restarts; the module takes about ten minutes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpitrain.data.prepare import prepare_dataset
from mpitrain.resilience.heartbeat import read_heartbeats
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi
from tests.test_hierarchical_dp import PARITY_JOB as HIERARCHICAL_JOB
from tests.test_hierarchical_dp import SLURM_MODES as HIERARCHICAL_MODES
from tests.test_hierarchical_dp import check_parity_and_bytes
from tests.test_hybrid_cp import tiny_bytes_per_step

SBATCH_SCRIPT = REPO_ROOT / "slurm" / "train.sbatch"
CI_CLUSTER_DIR = Path(os.environ.get("SLURM_CI_DIR", "/tmp/mpitrain-slurm"))
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
STEPS = 40
# float64 and wide enough (d_model 128: ~0.1 s a step on 2 cores) that an interruption after the first checkpoint
# (step 5) lands well before the end of the run
TRAIN_SETTINGS = ["precision.compute=float64", f"train.steps={STEPS}", "checkpoint.every=5", "logging.peak_flops=1e9",
                  "model.d_model=128", "model.seq_len=64", "train.log_every=1"]


# ----------------------------------------------------------------------------- the cluster
def _slurm_environment() -> dict:
    """This process's environment for SLURM commands: the CI cluster's SLURM_CONF unless one is set, no SLURM_*/SBATCH_*
    variables of an enclosing job, and this Python (with its mpiexec) first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF")}
    ci_conf = CI_CLUSTER_DIR / "etc" / "slurm.conf"
    if "SLURM_CONF" not in env and (CI_CLUSTER_DIR / "pids").is_file():  # started and not yet stopped
        env["SLURM_CONF"] = str(ci_conf)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def slurm_env():
    required = os.environ.get("MPITRAIN_SLURM_TEST") == "1"
    env = _slurm_environment()
    reason = None
    if shutil.which("sbatch", path=env["PATH"]) is None:
        reason = "no `sbatch` on PATH"
    else:
        try:
            answer = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=15)
            states = answer.stdout.split()
            if answer.returncode != 0 or not states:
                reason = f"`sinfo` does not answer: {answer.stderr.strip() or 'no nodes'}"
            elif not any(s.rstrip("*~#") in ("idle", "mix", "alloc", "comp") for s in states):
                reason = f"no usable SLURM node (states: {' '.join(states)})"
        except subprocess.TimeoutExpired:
            reason = "`sinfo` did not answer within 15 s"
    if reason:
        message = f"{reason}; as root, `bash .ci/slurm/start.sh` starts a test cluster"
        if required:
            pytest.fail(f"MPITRAIN_SLURM_TEST=1 but {message}")
        pytest.skip(f"no SLURM cluster: {message}")
    return env


class Job:
    """A batch job of slurm/train.sbatch: submit, watch, interrupt, and always cancelled if a test leaves it."""

    def __init__(self, env: dict, directory: Path, script_args: list[str], job_env: dict,
                 shape: tuple[str, ...] = ("--nodes=1", "--ntasks=2")):
        self.env = {**env, **job_env}
        command = ["sbatch", "--parsable", "--job-name=mpitrain-test", *shape, "--cpus-per-task=1",
                   "--time=10", f"--output={directory}/slurm-%j.out", str(SBATCH_SCRIPT), *script_args]
        submitted = subprocess.run(command, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
        self.id = submitted.stdout.strip().split(";")[0]
        self.output = directory / f"slurm-{self.id}.out"
        self.state = "PENDING"

    def slurm(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)

    def poll(self) -> str:
        shown = self.slurm("scontrol", "show", "job", "-o", self.id)
        match = re.search(r"JobState=([A-Z_]+)", shown.stdout)
        if match:
            self.state = match.group(1)
        else:  # the record is gone (MinJobAge after the end): the job-completion log has the final state
            ended = self.slurm("sacct", "-c", "-n", "-j", self.id, "-o", "State").stdout.split()
            self.state = ended[-1] if ended else "UNKNOWN"
        return self.state

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else "(no output file yet)"

    def fail(self, why: str):
        pytest.fail(f"job {self.id} ({self.state}): {why}\n--- job output ---\n{self.log()}")

    def wait_for(self, condition, what: str, timeout: float, interval: float = 0.05):
        deadline = time.monotonic() + timeout
        next_poll = 0.0
        while not condition():
            now = time.monotonic()
            if now > deadline:
                self.fail(f"no {what} within {timeout:.0f} s")
            if now >= next_poll:  # watch the job less often than the condition
                if self.poll() in FINISHED:
                    if condition():
                        return
                    self.fail(f"the job ended before {what}")
                next_poll = now + 1.0
            time.sleep(interval)

    def wait_until_finished(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while self.poll() not in FINISHED and self.state != "UNKNOWN":
            if time.monotonic() > deadline:
                self.fail(f"not finished within {timeout:.0f} s")
            time.sleep(0.5)
        return self.state

    def wait_until_completed(self, timeout: float):
        if self.wait_until_finished(timeout) != "COMPLETED":
            self.fail("did not complete")

    def cancel(self):
        if self.poll() not in FINISHED:
            self.slurm("scancel", self.id)


@pytest.fixture
def jobs():
    submitted: list[Job] = []
    yield submitted
    for job in submitted:
        job.cancel()


# ----------------------------------------------------------------------------- the harness, with a stand-in program
STAND_IN = '''
"""Stand-in for the trainer: STEPS steps of 0.2 s; progress in DIR/progress; on USR1/TERM stop, save, exit 75."""
import os, signal, sys, time
from pathlib import Path
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
state, steps = Path(sys.argv[1]), int(sys.argv[2])
received = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: received.append(signal.Signals(s).name))
progress = state / "progress"
start = int(progress.read_text()) if progress.exists() else 0
if rank == 0:
    print(f"stand-in: {size} ranks, restart {os.environ.get('SLURM_RESTART_COUNT', 0)}, from step {start}", flush=True)
for step in range(start, steps):
    time.sleep(0.2)
    if rank == 0:
        (state / "progress.tmp").write_text(str(step + 1))
        (state / "progress.tmp").replace(progress)
    if comm.allreduce(len(received), op=MPI.MAX):
        deadline = time.time() + 5  # the launcher may reach this rank a little later than another
        while not received and time.time() < deadline:
            time.sleep(0.05)
        print(f"stand-in: rank {rank} received {received} and stops after step {step + 1}", flush=True)
        sys.exit(75)
if rank == 0:
    print("stand-in: done", flush=True)
'''


def test_usr1_reaches_every_rank_and_the_job_requeues_itself(slurm_env, jobs, tmp_path):
    program = tmp_path / "stand_in.py"
    program.write_text(textwrap.dedent(STAND_IN))
    progress = tmp_path / "progress"
    job = Job(slurm_env, tmp_path, [],
              {"MPITRAIN_COMMAND": f"{sys.executable} {program} {tmp_path} 30", "MPITRAIN_LAUNCHER": "srun"})
    jobs.append(job)
    job.wait_for(lambda: progress.exists() and int(progress.read_text() or 0) >= 3, "progress to step 3", 60)
    signalled = job.slurm("scancel", "--signal=USR1", "--batch", job.id)
    assert signalled.returncode == 0, signalled.stderr
    job.wait_until_completed(120)
    log = job.log()
    assert "SIGUSR1 received; forwarding it to the training ranks" in log, log
    for rank in (0, 1):
        assert re.search(rf"stand-in: rank {rank} received \['SIGUSR1'\] and stops", log), log
    assert "training exited with status 75" in log and "requeueing" in log, log
    assert re.search(r"restart 1, from step [1-9]", log), log  # SLURM_RESTART_COUNT=1, continued mid-way
    assert "stand-in: done" in log and int(progress.read_text()) == 30, log


# ----------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.h5"
    prepare_dataset("python-stdlib", path, max_bytes=300_000)
    return path


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each logged step's loss; a step logged again after a resume keeps its last record (metrics.jsonl is appended)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {record["step"]: record["loss"] for record in records}


def train_settings(dataset) -> list[str]:
    args = []
    for setting in [f"data.path={dataset}", *TRAIN_SETTINGS]:
        args += ["--set", setting]
    return args


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, dataset):
    """The uninterrupted run: plain mpiexec, 2 ranks."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_mpi(2, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir),
                         *train_settings(dataset)], timeout=180)
    assert result.returncode == 0, describe(result)
    losses = losses_by_step(run_dir)
    assert len(losses) == STEPS, f"logged steps {sorted(losses)}"
    return losses


@pytest.mark.parametrize("interruption, launcher", [("scontrol-requeue", "srun"), ("usr1-to-batch", "mpiexec")])
def test_interrupted_job_resumes_exactly(slurm_env, jobs, tmp_path, dataset, reference_losses, interruption,
                                         launcher):
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *train_settings(dataset)],
              {"MPITRAIN_LAUNCHER": launcher, "MPITRAIN_PYTHON": sys.executable})
    jobs.append(job)

    # interrupt as soon as the first checkpoint is committed: the run is then well short of its end
    job.wait_for(lambda: any(run_dir.glob("checkpoints/step_*/COMMITTED")), "committed checkpoint", 120)
    if interruption == "scontrol-requeue":
        stopped = job.slurm("scontrol", "requeue", job.id)
    else:
        stopped = job.slurm("scancel", "--signal=USR1", "--batch", job.id)
    assert stopped.returncode == 0, stopped.stderr
    job.wait_until_completed(150)

    log = job.log()
    assert re.search(r"train\.sbatch: .* restart 1: on ", log), f"the job did not restart:\n{log}"
    resumed = re.search(r"checkpoint: resumed from \S+ at step (\d+)", log)
    assert resumed, f"the restarted run did not resume from a checkpoint:\n{log}"
    assert 0 < int(resumed.group(1)) < STEPS, f"resumed at step {resumed.group(1)}: not mid-run\n{log}"
    if interruption == "usr1-to-batch":
        assert "SIGUSR1 received; forwarding it" in log and "requeueing" in log, log

    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference_losses), f"logged steps differ:\n{log}"
    for step, loss in reference_losses.items():
        assert losses[step] == loss, f"step {step}: loss {losses[step]!r} != uninterrupted {loss!r}\n{log}"
    last = max(reference_losses)
    assert losses[last] == reference_losses[last]  # the final loss, bitwise


def test_killed_rank_restarts_inside_the_allocation(slurm_env, jobs, tmp_path, dataset, reference_losses):
    """MPITRAIN_FAULT kills rank 1 at step 12 (after the checkpoint of step 10): srun ends the attempt, the script
    starts the next one in the same allocation (no requeue), it resumes from step 10 and ends as the uninterrupted
    run does, bitwise."""
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *train_settings(dataset)],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable, "MPITRAIN_FAULT": "kill:rank=1:step=12"})
    jobs.append(job)
    job.wait_until_completed(300)
    log = job.log()
    assert "fault injection: rank 1 kills itself (SIGKILL) at the start of step 12" in log, log
    assert re.search(r"attempt 0 failed with exit status \d+; the restart resumes from the checkpoint of step 10 "
                     r"saved at \S+; \d+ logged steps done since are redone; restart 1 of 2 in this allocation",
                     log), log
    assert re.search(r"restart 0: on \S+, 2 tasks, 1 threads each, attempt 1:", log), log  # same job, no requeue
    assert "checkpoint: resumed from" in log and "step_00000010 at step 10" in log, log
    assert re.search(r"restart 1 \(attempt 1\) after exit status \d+[^:]*: time lost [0-9.]+ s, "
                     r"from the save of step 10", log), log
    assert log.count("fault injection") == 1, log
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference_losses), f"logged steps differ:\n{log}"
    for step, loss in reference_losses.items():
        assert losses[step] == loss, f"step {step}: loss {losses[step]!r} != uninterrupted {loss!r}\n{log}"


def test_restart_excludes_the_node_the_watchdog_named(slurm_env, jobs, tmp_path, dataset, reference_losses):
    """One rank on each of two nodes; rank 1 stops at step 12 (`kill -STOP`). The watchdog ends the attempt and names
    rank 1's node in RUN_DIR/faults.jsonl; the script restarts on the other node only (srun --exclude, 1 task), which
    resumes from step 10 with dp = 1 and ends where the 2-rank uninterrupted run ends (float64, to 1e-9: another
    layout sums in another order). CI's cluster has two nodes (.ci/slurm/start.sh, SLURM_CI_NODES)."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=slurm_env, capture_output=True, text=True,
                           timeout=30).stdout.split()
    if len(set(nodes)) < 2:
        message = (f"needs a cluster of 2 nodes, this one has {sorted(set(nodes))} "
                   f"(SLURM_CI_NODES=2 bash .ci/slurm/start.sh)")
        if os.environ.get("MPITRAIN_SLURM_TEST") == "1":
            pytest.fail(message)
        pytest.skip(message)
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *train_settings(dataset),
                                    "--set", "fault.timeout_s=10"],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable, "MPITRAIN_FAULT": "hang:rank=1:step=12"},
              shape=("--nodes=2", "--ntasks-per-node=1"))
    jobs.append(job)
    job.wait_until_completed(300)
    log = job.log()
    assert "HANG at step 12" in log, log
    records = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    named = {record["host"] for record in records if record.get("rank") == 1}
    assert len(named) == 1, records
    host = named.pop()
    assert re.search(rf"restart 1 of 2 in this allocation, excluding {host}\b", log), log
    assert re.search(rf"1 tasks, 1 threads each, attempt 1: srun .*--exclude={host} -N 1 -n 1 ", log), log
    assert "step_00000010 at step 10" in log and "on 1 ranks" in log, log
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference_losses), log
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-9, abs=0), f"step {step}\n{log}"


def test_no_restart_without_time_for_the_next_checkpoint(slurm_env, jobs, tmp_path, dataset):
    """An attempt that could not reach its next checkpoint before the time limit is not started: with
    MPITRAIN_MIN_ATTEMPT_S far above the job's 10 minutes, the killed attempt is the last and the job fails."""
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *train_settings(dataset)],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable, "MPITRAIN_FAULT": "kill:rank=1:step=7",
               "MPITRAIN_MIN_ATTEMPT_S": "100000"})
    jobs.append(job)
    job.wait_until_finished(240)
    log = job.log()
    assert job.state == "FAILED", f"{job.state}\n{log}"
    left = re.search(r"attempt 0 failed; (\d+)s left in the allocation, an attempt needs ~100000s to reach its next "
                     r"checkpoint: not restarting", log)
    assert left and 0 < int(left.group(1)) <= 600, log  # squeue's time left of a 10-minute job
    assert "attempt 1" not in log, log


# ----------------------------------------------------------------------------- two nodes
# The CI cluster runs node1 and node2 as two slurmds on this one machine (.ci/slurm/start.sh, SLURM_CI_NODES=2)
TWO_NODE_SETTINGS = ["precision.compute=float64", "train.steps=6", "train.log_every=1", "logging.peak_flops=1e9"]


def two_node_cluster(slurm_env) -> tuple[str, str]:
    """The cluster's first two nodes; skips (fails under MPITRAIN_SLURM_TEST=1) with fewer."""
    nodes = sorted(set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=slurm_env, capture_output=True,
                                      text=True, timeout=30).stdout.split()))
    if len(nodes) < 2:
        message = f"needs a cluster of 2 nodes, this one has {nodes} (SLURM_CI_NODES=2 bash .ci/slurm/start.sh)"
        if os.environ.get("MPITRAIN_SLURM_TEST") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return nodes[0], nodes[1]


def readme_two_node_example() -> tuple[list[str], list[str]]:
    """docs/clusters.md's two-node example (the code line after `<!-- two-node-example -->`): sbatch options, and
    the arguments of slurm/train.sbatch."""
    readme = (REPO_ROOT / "docs" / "clusters.md").read_text()
    found = re.search(r"<!-- two-node-example -->\s*```bash\n([^\n]+)\n", readme)
    assert found, "docs/clusters.md has no two-node example after <!-- two-node-example -->"
    words = shlex.split(found.group(1).split("#")[0])
    assert words[0] == "sbatch" and "slurm/train.sbatch" in words, words
    at = words.index("slurm/train.sbatch")
    return words[1:at], words[at + 1:]


def with_run_dir(args: list[str], run_dir: Path) -> list[str]:
    """`args` with the value of --out replaced by run_dir."""
    args = list(args)
    args[args.index("--out") + 1] = str(run_dir)
    return args


def test_readme_two_node_example_matches_one_process(slurm_env, jobs, tmp_path, dataset):
    """4 ranks on two nodes (dp 2 x tp 2, each tp pair inside a node) train as one process does (float64, 1e-10);
    the start-up placement line names both nodes and their ranks."""
    first, second = two_node_cluster(slurm_env)
    shape, script_args = readme_two_node_example()
    settings = [word for setting in [f"data.path={dataset}", *TWO_NODE_SETTINGS] for word in ("--set", setting)]
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, [*with_run_dir(script_args, run_dir), *settings],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable}, shape=tuple(shape))
    jobs.append(job)

    one_dir = tmp_path / "one"
    alone = run_mpi(1, ["-m", "mpitrain", "train", *with_run_dir(script_args, one_dir), *settings,
                        "--set", "parallel.tp=1"], timeout=300)
    assert alone.returncode == 0, describe(alone)
    job.wait_until_completed(300)
    log = job.log()
    assert (f"placement: 2 nodes: {first} ranks 0-1, {second} ranks 2-3; groups crossing nodes: dp; "
            f"inside one node: tp") in log, log
    assert "mesh dp=2 tp=2 pp=1" in log, log
    expected, losses = losses_by_step(one_dir), losses_by_step(run_dir)
    assert sorted(losses) == sorted(expected) == list(range(1, 7)), log
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-10, abs=0), f"step {step}\n{log}"


def test_tensor_parallel_across_nodes_is_refused(slurm_env, jobs, tmp_path, dataset):
    """tp = 2 with one rank on each node: one line names the group, the nodes and the key that allows it; the batch
    script does not retry (MPITRAIN_FAILURE_RESTARTS=0) and the job fails."""
    first, second = two_node_cluster(slurm_env)
    settings = [word for setting in [f"data.path={dataset}", *TWO_NODE_SETTINGS, "parallel.tp=2"]
                for word in ("--set", setting)]
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(tmp_path / "run"), *settings],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable, "MPITRAIN_FAILURE_RESTARTS": "0"},
              shape=("--nodes=2", "--ntasks-per-node=1"))
    jobs.append(job)
    job.wait_until_finished(180)
    log = job.log()
    assert job.state == "FAILED", f"{job.state}\n{log}"
    assert (f"parallel.tp = 2 puts tp group [0, 1] on several nodes ({first}, {second}): tp exchanges activations "
            f"inside every layer and needs the fast links inside a node;") in log, log
    assert "parallel.allow_cross_node_tp = true" in log and "Traceback" not in log, log
    assert not re.search(r"step +1/", log), log  # refused before the first step


class SlurmdOf:
    """One node's slurmd of the CI cluster: kill it (the node is lost), start it again (recorded in CI's pids file,
    so that .ci/slurm/stop.sh stops the new one)."""

    def __init__(self, node: str, env: dict):
        self.node, self.env = node, env
        self.pid_file = CI_CLUSTER_DIR / "spool" / f"slurmd-{node}.pid"
        self.killed_pid = None

    def kill(self):
        self.killed_pid = int(self.pid_file.read_text())
        os.kill(self.killed_pid, signal.SIGKILL)

    def restore(self):
        if self.killed_pid is None:
            return
        subprocess.run(["slurmd", "-f", str(CI_CLUSTER_DIR / "etc" / "slurm.conf"), "-N", self.node],
                       env=self.env, check=True, timeout=60)
        deadline = time.monotonic() + 30
        while (pid := self._written_pid()) in (None, self.killed_pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"slurmd of {self.node} did not write {self.pid_file}")
            time.sleep(0.2)
        pids = CI_CLUSTER_DIR / "pids"
        lines = [f"slurmd {pid}" if line.split() == ["slurmd", str(self.killed_pid)] else line
                 for line in pids.read_text().splitlines()]
        pids.write_text("".join(f"{line}\n" for line in lines))
        self.killed_pid = None

    def _written_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):  # not there yet, or being written
            return None


def test_lost_node_run_continues_on_the_other(slurm_env, jobs, tmp_path, dataset, reference_losses):
    """dp 2 x tp 2 on two nodes; after the first committed checkpoint the second node is lost (its slurmd and its
    ranks SIGKILLed). The batch script finds the node gone, restarts inside the allocation on the first node only
    (parallel.dp = 0 becomes 1: the same global batch through twice the accumulation), the restarted trainer's first
    line says which node it left out, from which checkpoint, under which layout and the time lost, and every loss
    equals the uninterrupted run's (float64, 1e-10: accumulation sums in another order)."""
    first, second = two_node_cluster(slurm_env)
    if os.geteuid() != 0 or not (CI_CLUSTER_DIR / "pids").is_file():
        pytest.skip("killing a node's slurmd needs root and the CI cluster of .ci/slurm/start.sh")
    run_dir = tmp_path / "run"
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *train_settings(dataset),
                                    "--set", "parallel.tp=2"],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable, "MPITRAIN_PROBE_S": "20"},
              shape=("--nodes=2", "--ntasks-per-node=2"))
    jobs.append(job)
    slurmd = SlurmdOf(second, slurm_env)

    def ranks_on_second() -> list[int]:
        beats = read_heartbeats(run_dir / "heartbeat").values()
        return [beat["pid"] for beat in beats if beat.get("host") == second and beat.get("state") == "running"]

    try:
        job.wait_for(lambda: any(run_dir.glob("checkpoints/step_*/COMMITTED")) and len(ranks_on_second()) == 2,
                     "committed checkpoint", 180)
        victims = ranks_on_second()
        slurmd.kill()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        job.wait_for(lambda: job.log().count("training exited with status") >= 2, "end of the restarted attempt", 300,
                     interval=0.5)
    finally:
        slurmd.restore()  # the job completes (its cleanup on the lost node) once its slurmd is back
    job.wait_until_completed(180)
    log = job.log()
    assert f"node(s) lost: {second}" in log and f"excluding {second}" in log, log
    assert re.search(rf"attempt 1: srun .*--exclude={second} -N 1 -n 2 ", log), log
    restarted = log[log.index("attempt 1: srun"):]
    banner = re.search(rf"restart \(attempt 1\): left out node {second}; resuming from \S+step_(\d+) \(step (\d+)\) "
                       rf"on dp=1 tp=2 pp=1 cp=1 ep=1 on 1 node: {first} ranks 0-1; time lost so far [0-9.]+ s "
                       rf"\(from the save of step \d+ at [0-9:.]+\)", restarted)
    assert banner, log
    assert banner.start() < restarted.index("checkpoint: resumed from") < restarted.index("mpitrain: "), log
    assert re.search(r"restart 1 \(attempt 1\) after exit status \d+[^:]*: time lost [0-9.]+ s", log), log
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference_losses), log
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-10, abs=0), f"step {step}\n{log}"


def test_hierarchical_data_parallelism_on_two_nodes(slurm_env, jobs, tmp_path):
    """dp 4 on two nodes (2 ranks each), float64: the two-level all-reduce (plain DP) and hybrid-sharded ZeRO-3
    (parallel.zero_shard = 'node') train as one process does, step by step (1e-10), and the bytes on the across-node
    groups are state/hierarchical.py's formulas (tests/test_hierarchical_dp.py runs the same job on fake nodes)."""
    first, second = two_node_cluster(slurm_env)
    modes = HIERARCHICAL_MODES  # zero 0 two_level, zero 3 node
    script = tmp_path / "hierarchical.py"
    script.write_text(textwrap.dedent(HIERARCHICAL_JOB))
    layouts = json.dumps([overrides for overrides, _, _ in modes], separators=(",", ":"))  # no spaces: one word
    job = Job(slurm_env, tmp_path, [], {"MPITRAIN_COMMAND": f"{sys.executable} {script} 2 {layouts} -",
                                        "MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable},
              shape=("--nodes=2", "--ntasks-per-node=2"))
    jobs.append(job)
    job.wait_until_completed(240)
    lines = [line for line in job.log().splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, job.log()
    results = json.loads(lines[0][len("RESULTS "):])
    assert all(result["nodes"] == f"2 nodes: {first} ranks 0-1, {second} ranks 2-3" for result in results), results
    check_parity_and_bytes(results, modes)


HYBRID_CP_SETTINGS = ["data.synthetic=true", "precision.compute=float64", "train.steps=4", "train.log_every=1",
                      "model.arch=llama", "model.n_kv_head=2", "logging.peak_flops=1e9"]


def test_hybrid_context_parallelism_on_two_nodes(slurm_env, jobs, tmp_path):
    """cp 4 as 2 nodes x 2 ranks (parallel.cp_kind = 'hybrid': Ulysses' all-to-all inside each node, the ring across
    them), llama with grouped-query attention in float64: the losses of every step at 1e-10 against one process, and
    each level's bytes per step equal to cp_bytes_per_step (tests/test_hybrid_cp.py runs the same on fake nodes)."""
    first, second = two_node_cluster(slurm_env)
    settings = [word for setting in HYBRID_CP_SETTINGS for word in ("--set", setting)]
    run_dir = tmp_path / "run"
    hybrid = ["--set", "parallel.cp=4", "--set", "parallel.cp_kind=hybrid"]
    job = Job(slurm_env, tmp_path, ["configs/tiny.toml", "--out", str(run_dir), *settings, *hybrid],
              {"MPITRAIN_LAUNCHER": "srun", "MPITRAIN_PYTHON": sys.executable},
              shape=("--nodes=2", "--ntasks-per-node=2"))
    jobs.append(job)
    one_dir = tmp_path / "one"
    alone = run_mpi(1, ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(one_dir), *settings], timeout=300)
    assert alone.returncode == 0, describe(alone)
    job.wait_until_completed(300)
    log = job.log()
    assert f"placement: 2 nodes: {first} ranks 0-1, {second} ranks 2-3" in log, log
    expected, losses = losses_by_step(one_dir), losses_by_step(run_dir)
    assert sorted(losses) == sorted(expected) == list(range(1, 5)), log
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-10, abs=0), f"step {step}\n{log}"
    sent = tiny_bytes_per_step("hybrid", inside=2, tp=1, blocks=2, recompute="none")
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert {kind: record["comm_bytes"][kind] for kind in sent} == sent, record
