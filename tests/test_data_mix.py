"""data.mix: several prepared files blended by weight, each row's file a pure function of (seed, step, row).

The sampler is checked on files whose token ids say which file and window they came from; the runs check what the
pure function promises: a resumed run and a dp = 2 run see the same batches as one straight single-process run.
"""
from __future__ import annotations

import json
import re
import tomllib

import h5py
import numpy as np
import pytest

from mpitrain.config import Config, config_from_dict, load_config, to_toml, validate
from mpitrain.data.dataset import TokenDataset, train_and_val_samplers
from mpitrain.data.mix import MixSampler, mix_samplers
from mpitrain.data.prepare import prepare_dataset
from mpitrain.data.tokenizer import ByteTokenizer
from mpitrain.errors import ConfigError
from mpitrain.optim.schedule import BatchRamp
from mpitrain.train import make_samplers
from tests.mpi_helpers import REPO_ROOT, describe, run_mpi
from tests.test_train_parity import PARITY_STEPS, assert_same_run, run_training

SEQ_LEN, BATCH, FILE_SPAN = 8, 16, 10_000  # file i holds ids i * FILE_SPAN + 0, 1, 2, ...


def _write_numbered_file(path, index, n_train=801, n_val=161):
    """Token j of file `index` is index * FILE_SPAN + j: a row's first token names its file and window."""
    with h5py.File(path, "w") as f:
        f["train"] = index * FILE_SPAN + np.arange(n_train, dtype=np.uint32)
        f["val"] = index * FILE_SPAN + np.arange(n_val, dtype=np.uint32)
        f.attrs.update(tokenizer=json.dumps(ByteTokenizer().description()), vocab_size=100_000, source="test",
                       n_documents=2)
    return str(path)


@pytest.fixture
def numbered(tmp_path):
    return [_write_numbered_file(tmp_path / f"f{i}.h5", i) for i in range(3)]


def _file_of(inputs):
    return inputs[:, 0] // FILE_SPAN


def test_rows_come_from_files_in_proportion_to_the_weights(numbered):
    weights = [1.0, 2.0, 5.0]
    train, val, _ = mix_samplers(list(zip(numbered, weights)), SEQ_LEN, BATCH, seed=7)
    steps = 600  # 9600 rows: one standard deviation of a share is at most 0.005
    files = np.concatenate([_file_of(train.global_batch_rows(s, slice(None))[0]) for s in range(steps)])
    shares = np.bincount(files, minlength=3) / files.size
    assert shares == pytest.approx(np.array(weights) / sum(weights), abs=0.02)
    assert np.array_equal(files[:BATCH], train.sources_of(0, range(BATCH)))  # the rows hold their file's tokens
    val_files = _file_of(val.global_batch_rows(0, slice(None))[0])
    assert set(val_files.tolist()) <= {0, 1, 2} and len(set(val_files.tolist())) > 1  # validation on the blend


def test_a_row_reads_its_file_at_its_own_sample_position(numbered):
    train, _, _ = mix_samplers([(numbered[0], 1.0), (numbered[1], 1.0)], SEQ_LEN, BATCH, seed=3)
    step = 5
    inputs, targets = train.global_batch_rows(step, slice(None))
    for row, source in enumerate(train.sources_of(step, range(BATCH))):
        own_inputs, own_targets = train.samplers[source].global_batch_rows(step, [row])
        assert np.array_equal(inputs[row], own_inputs[0]) and np.array_equal(targets[row], own_targets[0])
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])


def test_a_batch_ramp_reaches_every_file_and_the_draws_stay_put(numbered):
    """train.batch_rampup: step s's rows are the ramp's, each file reads its own sampler at the ramp's positions."""
    ramp = BatchRamp(start=4, increment=4, ramp_samples=64, global_batch=BATCH)
    train, val, _ = mix_samplers([(numbered[0], 1.0), (numbered[1], 2.0)], SEQ_LEN, BATCH, seed=9, ramp=ramp)
    plain, _, _ = mix_samplers([(numbered[0], 1.0), (numbered[1], 2.0)], SEQ_LEN, BATCH, seed=9)
    assert [train.batch_size(s) for s in (0, 6)] == [4, 8] and val.batch_size(0) == BATCH
    inputs, _ = train.global_batch_rows(6, slice(None))
    assert inputs.shape == (8, SEQ_LEN)
    assert np.array_equal(train.sources_of(6, range(8)), plain.sources_of(6, range(8)))  # the same file per row
    for row, source in enumerate(train.sources_of(6, range(8))):
        assert np.array_equal(inputs[row], train.samplers[source].global_batch_rows(6, [row])[0][0])
    assert not np.array_equal(inputs, plain.global_batch_rows(6, range(8))[0])  # other windows: the ramp's positions


def test_document_starts_are_each_rows_own_files(tmp_path):
    """data.document_mask: a row's document boundaries come from the file the row was drawn from."""
    files = []
    for index, eod in enumerate((7, 11)):  # two files whose end-of-document tokens fall at other places
        path = tmp_path / f"d{index}.h5"
        _write_numbered_file(path, 0)
        with h5py.File(path, "a") as f:
            f["train"][::eod] = 255
            f.attrs["eod_id"] = 255
        files.append(str(path))
    train, _, _ = mix_samplers([(files[0], 1.0), (files[1], 1.0)], SEQ_LEN, BATCH, seed=2)
    starts = train.document_starts(3, slice(None))
    sources = train.sources_of(3, range(BATCH))
    assert set(sources.tolist()) == {0, 1} and starts.shape == (BATCH, SEQ_LEN) and starts.dtype == bool
    for row, source in enumerate(sources):
        assert np.array_equal(starts[row], train.samplers[source].document_starts(3, [row])[0])


def test_a_mix_of_one_file_reads_what_data_path_reads(numbered):
    mixed, mixed_val, _ = mix_samplers([(numbered[2], 4.0)], SEQ_LEN, BATCH, seed=5)
    plain, plain_val = train_and_val_samplers(TokenDataset(numbered[2]), SEQ_LEN, BATCH, seed=5)
    for step in (0, 7, 300):
        every_row = slice(None)
        assert np.array_equal(mixed.global_batch_rows(step, every_row)[0], plain.global_batch_rows(step, every_row)[0])
    assert np.array_equal(mixed_val.global_batch_rows(1, range(4))[1], plain_val.global_batch_rows(1, range(4))[1])


def test_the_batch_is_a_pure_function_of_seed_step_and_row(numbered):
    sources = list(zip(numbered, [1.0, 1.0, 2.0]))
    first, _, _ = mix_samplers(sources, SEQ_LEN, BATCH, seed=11)
    for step in range(6):  # an earlier history of calls changes nothing
        first.global_batch_rows(step, slice(None))
    fresh, _, _ = mix_samplers(sources, SEQ_LEN, BATCH, seed=11)  # a resumed run: nothing read before step 40
    whole = first.global_batch_rows(40, slice(None))
    assert all(np.array_equal(a, b) for a, b in zip(whole, fresh.global_batch_rows(40, slice(None))))
    halves = [fresh.global_batch_rows(40, rows) for rows in (range(0, 8), range(8, 16))]  # two dp ranks
    assert np.array_equal(np.concatenate([h[0] for h in halves]), whole[0])
    other_seed, _, _ = mix_samplers(sources, SEQ_LEN, BATCH, seed=12)
    assert not np.array_equal(other_seed.sources_of(40, range(BATCH)), first.sources_of(40, range(BATCH)))


def test_a_row_draws_its_file_whatever_the_batch_size():
    sampler = MixSampler([_StubSampler(), _StubSampler()], [1.0, 3.0], seed=5)
    assert np.array_equal(sampler.sources_of(9, [3, 30]), sampler.sources_of(9, range(31))[[3, 30]])


class _StubSampler:
    seq_len, global_batch = SEQ_LEN, BATCH


# ---------------------------------------------------------------- config


def test_config_accepts_strings_and_tables_and_writes_them_back():
    strings = config_from_dict({"data": {"mix": ["a.h5:3", "dir:with:colons/b.h5:0.5"]}})
    tables = config_from_dict({"data": {"mix": [{"path": "a.h5", "weight": 3},
                                                {"path": "dir:with:colons/b.h5", "weight": 0.5}]}})
    assert strings.data.mix == tables.data.mix == ["a.h5:3.0", "dir:with:colons/b.h5:0.5"]
    assert strings.data.mix_sources() == [("a.h5", 3.0), ("dir:with:colons/b.h5", 0.5)]
    again = config_from_dict(tomllib.loads(to_toml(strings)))
    assert again.data.mix == strings.data.mix


@pytest.mark.parametrize("value, message", [
    ("a.h5:1", r"data\.mix must be a list"),
    (["a.h5"], r"data\.mix\[0\] = 'a\.h5': expected 'path:weight'"),
    (["a.h5:1", "b.h5:heavy"], r"data\.mix\[1\] = 'b\.h5:heavy': the weight after the last ':' is not a number"),
    (["a.h5:0"], r"data\.mix\[0\] = 'a\.h5:0': the weight must be a finite number > 0"),
    (["a.h5:-2"], r"the weight must be a finite number > 0"),
    (["a.h5:nan"], r"the weight must be a finite number > 0"),
    ([{"path": "a.h5", "weight": True}], r"data\.mix\[0\].*the weight must be a finite number > 0"),
    ([{"path": "a.h5"}], r"data\.mix\[0\].*expected 'path:weight' or \{path = \.\.\., weight = \.\.\.\}"),
    ([":2"], r"data\.mix\[0\] = ':2': the path must be a non-empty string"),
])
def test_bad_mix_entries_are_refused_naming_the_entry(value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"mix": value}})


def test_mix_and_synthetic_exclude_each_other_and_code_built_configs_are_checked():
    cfg = Config()
    cfg.data.mix, cfg.data.synthetic = ["a.h5:1"], True
    with pytest.raises(ConfigError, match="data.mix and data.synthetic"):
        validate(cfg)
    cfg.data.synthetic, cfg.data.mix = False, ["a.h5:-1"]
    with pytest.raises(ConfigError, match=r"data\.mix\[0\]"):
        validate(cfg)


def test_files_are_checked_at_train_time(tmp_path, numbered, monkeypatch):
    cfg = load_config("configs/tiny.toml", [f'data.mix=["{numbered[0]}:1", "{tmp_path}/missing.h5:1"]'])
    with pytest.raises(ConfigError, match=r"config key data\.mix: data file \S*missing\.h5 not found"):
        make_samplers(cfg)
    with monkeypatch.context() as here:  # a relative path is named with the directory it was resolved from
        here.chdir(tmp_path)
        cfg = load_config(f"{REPO_ROOT}/configs/tiny.toml", [f'data.mix=["{numbered[0]}:1", "missing.h5:1"]'])
        with pytest.raises(ConfigError, match=re.escape(f"data file missing.h5 (resolved from {tmp_path}) not found")):
            make_samplers(cfg)
    pytest.importorskip("tokenizers", reason="a BPE file needs the optional 'tokenizers' package")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to tokenize, some more text\n" * 200)
    byte_file, bpe_file = tmp_path / "byte.h5", tmp_path / "bpe.h5"
    prepare_dataset([str(corpus)], byte_file)
    prepare_dataset([str(corpus)], bpe_file, tokenizer="bpe", vocab_size=260)
    cfg = load_config("configs/tiny.toml", [f'data.mix=["{byte_file}:1", "{bpe_file}:1"]', "model.vocab_size=300"])
    with pytest.raises(ConfigError, match=r"data\.mix: \S*bpe\.h5 and \S*byte\.h5 were tokenized differently"):
        make_samplers(cfg)
    cfg = load_config("configs/tiny.toml", [f'data.mix=["{byte_file}:1", "{byte_file}:2"]', "model.vocab_size=255"])
    with pytest.raises(ConfigError, match="model.vocab_size = 255 is smaller than the vocabulary"):
        make_samplers(cfg)


# ---------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def two_files(tmp_path_factory):
    """Two byte-level files of different text: Python source and JSON lines of prose."""
    folder = tmp_path_factory.mktemp("mix")
    prepare_dataset("python-stdlib", folder / "code.h5", max_bytes=200_000)
    prose = folder / "prose.jsonl"
    prose.write_text("".join(json.dumps({"text": f"Story {i}: the cat sat on mat number {i}. " * 8}) + "\n"
                             for i in range(200)))
    prepare_dataset([str(prose)], folder / "prose.h5")
    assert TokenDataset(folder / "prose.h5").n_tokens("val") > 33
    return [f"{folder / 'code.h5'}:3", f"{folder / 'prose.h5'}:1"]


def _mix_setting(entries):
    return "data.mix=[" + ", ".join(f'"{e}"' for e in entries) + "]"


def _train(run_dir, settings, resume=None, expect=0):
    args = ["-m", "mpitrain", "train", "configs/tiny.toml", "--out", str(run_dir)]
    for setting in settings:
        args += ["--set", setting]
    result = run_mpi(1, args + (["--resume", resume] if resume else []), timeout=180)
    assert result.returncode == expect, describe(result)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_mix_run_stopped_halfway_and_resumed_is_bitwise_the_straight_run(tmp_path, two_files):
    steps = 8
    settings = [_mix_setting(two_files), f"train.steps={steps}", "train.eval_every=4", "logging.peak_flops=1e9"]
    straight = _train(tmp_path / "straight", settings)
    _train(tmp_path / "resumed", [*settings, f"train.stop_at={steps // 2}"], expect=75)
    resumed = _train(tmp_path / "resumed", settings, resume="auto")
    assert [m["step"] for m in straight] == list(range(1, steps + 1))
    assert {m["step"]: m["loss"] for m in resumed} == {m["step"]: m["loss"] for m in straight}
    assert {m["step"]: m["val_loss"] for m in resumed if "val_loss" in m} == \
        {m["step"]: m["val_loss"] for m in straight if "val_loss" in m} and "val_loss" in straight[-1]
    # the blend is not one of its files: the same run on the code file alone has other losses
    alone = _train(tmp_path / "alone", [f"data.path={two_files[0].rpartition(':')[0]}", *settings[1:]])
    assert all(a["loss"] != b["loss"] for a, b in zip(alone, straight))


@pytest.mark.parametrize("document_mask", [False, True], ids=["packed", "document-mask"])
def test_a_mix_run_on_two_data_parallel_ranks_matches_one_process(tmp_path, two_files, document_mask):
    settings = [_mix_setting(two_files), "precision.compute=float64", f"train.steps={PARITY_STEPS}",
                f"data.document_mask={str(document_mask).lower()}"]
    one = run_training(1, tmp_path / "one", settings)
    two = run_training(2, tmp_path / "two", [*settings, "train.micro_batch=2"])
    assert_same_run(one, two)
