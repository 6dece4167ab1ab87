"""Weights & Biases logging (logging.wandb, mpitrain/profile/wandb_sink.py): against a stand-in `wandb` module that
records its calls (in this process, and on the PYTHONPATH of a 2-rank run: only rank 0 logs, every logged step), the
offline default without an API key, the error naming the extra without the package, and once with the real package
offline (skipped without it: the extra [wandb] is not in [test])."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import struct
import sys
import tomllib
import types

import pytest

from mpitrain.config import load_config
from mpitrain.errors import ConfigError
from mpitrain.profile.wandb_sink import WandbSink, has_credentials, require_wandb, wandb_scalars
from mpitrain.run.log import RunLog
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi

STAND_IN = '''
import json, os

CALLS = []


def _record(call):
    CALLS.append(call)
    if os.environ.get("FAKE_WANDB_LOG"):
        with open(os.environ["FAKE_WANDB_LOG"], "a") as out:
            out.write(json.dumps(call) + "\\n")


class Run:
    def log(self, data, step=None):
        _record({"call": "log", "data": data, "step": step})

    def finish(self):
        _record({"call": "finish"})


def init(**kwargs):
    _record({"call": "init", "rank": os.environ.get("PMI_RANK"), **kwargs})
    return Run()
'''


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No API key anywhere: none in the environment, an empty netrc file, W&B's own files under tmp_path."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    exec(STAND_IN, module.__dict__)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def a_record(step, **extra):
    return {"step": step, "loss": 5.5 - step / 100, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 1e4, "mfu": 0.3,
            "hardware_mfu": 0.35, "step_time_s": 0.02, "global_batch": 8, "batch_tokens": 256, "eta_s": 1.0,
            "comm_bytes": {"all_reduce": 1000, "send": 0}, "time": 1.7e9, "skipped": False,
            "breakdown": [{"forward": 0.01, "optimizer": 0.002, "step_s": 0.02},
                          {"forward": 0.012, "optimizer": 0.001, "step_s": 0.021}], **extra}


def test_run_log_sends_each_record_at_its_step(tmp_path, no_credentials, stand_in):
    cfg = load_config("configs/tiny.toml", ["logging.wandb=true", "logging.wandb_project='proj-x'"])
    lines = []
    run_dir = tmp_path / "my-run"
    with RunLog(cfg, run_dir, 0, lines.append) as log:
        log.write(a_record(1))
        log.write(a_record(2, val_loss=5.4, loss_scale=float("inf")))
    init, *logs, finish = stand_in.CALLS
    assert init["project"] == "proj-x" and init["name"] == "my-run" and init["dir"] == str(run_dir)
    assert init["config"] == tomllib.loads((run_dir / "config.toml").read_text())  # the resolved config, whole
    assert init["config"]["logging"]["wandb"] is True and init["mode"] == "offline"
    offline_line = (f"wandb: no API key (WANDB_API_KEY or `wandb login`): logging offline to {run_dir / 'wandb'}; "
                    f"upload later with `wandb sync {run_dir / 'wandb'}/offline-run-*`")
    assert [line for line in lines if line.startswith("wandb:")] == [offline_line]
    assert [(call["call"], call["step"]) for call in logs] == [("log", 1), ("log", 2)] and finish == {"call": "finish"}
    first, second = logs[0]["data"], logs[1]["data"]
    assert first == {"train/loss": 5.49, "train/lr": 1e-3, "train/grad_norm": 0.7, "train/global_batch": 8,
                     "train/batch_tokens": 256, "perf/tokens_per_s": 1e4, "perf/mfu": 0.3, "perf/hardware_mfu": 0.35,
                     "perf/step_time_s": 0.02, "time/forward": 0.012, "time/optimizer": 0.002, "time/step_s": 0.021,
                     "comm/all_reduce_bytes": 1000, "comm/send_bytes": 0}
    assert second["val/loss"] == 5.4 and "train/loss_scale" not in second  # not finite: left out


def test_scalars_skip_what_is_not_a_finite_number():
    assert wandb_scalars({"step": 3, "loss": float("nan"), "lr": 2e-4, "skipped": True, "breakdown": None}) == \
        {"train/lr": 2e-4}


@pytest.mark.parametrize("setting, mode", [(None, "offline"), ("key", None), ("netrc", None), ("mode", None)])
def test_offline_only_without_a_key_or_a_chosen_mode(tmp_path, no_credentials, stand_in, monkeypatch, setting, mode):
    if setting == "key":
        monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    elif setting == "netrc":  # what `wandb login` leaves
        (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    elif setting == "mode":
        monkeypatch.setenv("WANDB_MODE", "disabled")
    lines = []
    WandbSink("p", tmp_path / "run", {}, lines.append)
    assert stand_in.CALLS[0]["mode"] == mode
    assert len(lines) == (1 if mode == "offline" else 0)
    assert has_credentials() == (setting in ("key", "netrc"))


def test_without_the_package_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError; find_spec finds nothing
    message = r"config key logging\.wandb = true needs the 'wandb' package: pip install 'mpitrain\[wandb\]'"
    with pytest.raises(ConfigError, match=message):
        require_wandb(True)
    with pytest.raises(ConfigError, match=message):
        WandbSink("p", tmp_path, {})
    require_wandb(False)  # off: nothing is looked for


def test_empty_project_is_refused():
    with pytest.raises(ConfigError, match="config key logging.wandb_project is empty"):
        load_config("configs/tiny.toml", ["logging.wandb_project=''"])


def train(n, run_dir, *settings, env=None):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in ["data.synthetic=true", "logging.peak_flops=1e9", "logging.wandb=true", *settings]:
        args += ["--set", setting]
    result = run_mpi(n, args, timeout=180, env=env)
    assert result.returncode == 0, describe(result)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_a_two_rank_run_logs_every_logged_step_from_rank_zero(tmp_path, no_credentials):
    package = tmp_path / "stand-in" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    calls_file = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(package.parent), str(REPO_ROOT)]), "FAKE_WANDB_LOG": str(calls_file)}
    result, rows = train(2, tmp_path / "run", "train.log_every=3", env=env)
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    init, *logs, finish = calls
    assert init["call"] == "init" and init["rank"] == "0" and finish == {"call": "finish"}  # rank 0, once
    assert init["name"] == "run" and init["project"] == "mpitrain" and init["mode"] == "offline"
    assert [row["step"] for row in rows] == [1, 3, 6, 9, 10]  # the first step, every 3rd, the last
    assert [call["step"] for call in logs] == [row["step"] for row in rows]
    assert [call["data"]["train/loss"] for call in logs] == [row["loss"] for row in rows]
    assert logs[-1]["data"]["val/loss"] == rows[-1]["val_loss"]
    assert {"time/forward", "comm/all_reduce_bytes", "perf/mfu"} <= set(logs[0]["data"])
    assert result.stdout.count("wandb: no API key") == 1


def read_wandb_records(path):
    """The protobuf records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB's log format (32 KiB
    blocks of chunks, each: crc32, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2
    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed: pip install 'mpitrain[wandb]' (not in the test extra)")
def test_the_real_package_logs_offline(tmp_path, no_credentials):
    result, rows = train(1, tmp_path / "real-run", "train.log_every=2")
    assert "wandb: no API key" in result.stdout
    logs = list((tmp_path / "real-run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    history, runs = [], []
    for record in read_wandb_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append((record.history.step.num, items["train/loss"]))
        elif kind == "run":
            runs.append(record.run)
    assert history == [(row["step"], row["loss"]) for row in rows]
    assert runs[0].display_name == "real-run" and runs[0].project == "mpitrain"
    assert {"model", "optim", "train", "logging"} <= {item.key for item in runs[0].config.update}
