"""Config loading: defaults, overrides, errors that name the key and where it came from, round trip."""
from __future__ import annotations

import tomllib

import pytest

from mpitrain.config import config_from_dict, load_config, resolve_layout, to_toml
from mpitrain.errors import ConfigError


def test_overrides_of_one_section_all_apply_and_values_are_toml_literals():
    cfg = load_config("configs/tiny.toml", ["train.steps=3", "train.log_every=2", "model.arch=llama",
                                            "optim.lr=1", "checkpoint.async=true", 'train.sample_prompt="x = "'])
    assert (cfg.train.steps, cfg.train.log_every, cfg.model.arch) == (3, 2, "llama")
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # an int where a float is expected
    assert cfg.checkpoint.async_ is True  # the TOML key is `async`, a Python keyword
    assert cfg.train.sample_prompt == "x = "
    assert cfg.model.n_layer == 2  # from the file


@pytest.mark.parametrize("overrides, message", [
    (["model.colour=3"], "unknown config key model.colour in --set"),
    (["modle.arch=gpt2"], "unknown config section [modle] in --set"),
    (["train.steps=ten"], "config key train.steps must be int, got str 'ten'"),
    (["train.steps=true"], "config key train.steps must be int, got bool"),
    (["model.arch=bert"], "model.arch = 'bert' is not allowed; allowed: 'gpt2', 'llama'"),
    (["model.n_head=3"], "model.d_model = 32 must be divisible by model.n_head = 3"),
    (["parallel.cp=3"], "context parallelism cuts each sequence into 2 cp chunks"),
    (["optim.lr=-1"], "config key optim.lr must be >= 0"),
    (["train.steps"], "expected section.key=value"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        load_config("configs/tiny.toml", overrides)


def test_a_bad_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=f"unknown config key train.stepz in {path}"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)


def test_layout_resolution_and_batch_divisibility():
    cfg = load_config("configs/tiny.toml", ["parallel.tp=2"])
    resolve_layout(cfg, 4)
    assert cfg.parallel.dp == 2
    cfg = load_config("configs/tiny.toml", ["train.global_batch=6"])
    with pytest.raises(ConfigError, match="train.global_batch = 6 is not divisible"):
        resolve_layout(cfg, 2)


def test_the_resolved_config_round_trips_through_toml():
    cfg = load_config("configs/quickstart.toml", ["checkpoint.async=true", "parallel.stage_layers=[1, 3]",
                                                  "parallel.pp=2"])
    again = config_from_dict(tomllib.loads(to_toml(cfg)))
    assert again == cfg


def _numeric_keys(kind):
    """Every config key whose default is of type `kind` (bool is not an int here)."""
    from dataclasses import fields

    from mpitrain.config import Config, _key
    cfg = Config()
    return [f"{section.name}.{_key(f.name)}" for section in fields(cfg) for f in fields(getattr(cfg, section.name))
            if type(getattr(getattr(cfg, section.name), f.name)) is kind]


@pytest.mark.parametrize("key", _numeric_keys(float))
@pytest.mark.parametrize("literal", ["inf", "-inf", "nan"])
def test_every_float_key_must_be_finite(key, literal):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", [f"{key}={literal}"])
    assert str(info.value) == f"config key {key} = {float(literal)} must be a finite number"


@pytest.mark.parametrize("key", _numeric_keys(float) + _numeric_keys(int))
def test_every_numeric_key_refuses_a_negative_value(key):
    """No key means anything below zero: a new key without a range check fails here."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        load_config("configs/tiny.toml", [f"{key}=-1"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=inf"], "config key optim.lr = inf must be a finite number"),
    (["optim.lr=1e999"], "config key optim.lr = inf must be a finite number"),  # TOML reads it as inf
    (["optim.lr=1" + "0" * 400], "config key optim.lr = 1000"),  # an int too large for a float
    (["optim.eps=0"], "config key optim.eps must be > 0, got 0.0"),
    (["model.norm_eps=0"], "config key model.norm_eps must be > 0, got 0.0"),
    (["model.rope_theta=0"], "config key model.rope_theta must be > 0, got 0.0"),
    (["train.seed=-3"], "config key train.seed must be >= 0, got -3"),
    (["fault.straggler_factor=0.5"], "config key fault.straggler_factor = 0.5 must be > 1"),
    (['data.path=""'], "config key data.path is empty"),
])
def test_values_that_used_to_slip_through_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_edge_values_that_mean_off_are_still_accepted():
    cfg = load_config("configs/tiny.toml", ["fault.straggler_factor=0", "optim.lr=0", "optim.clip=0",
                                            "model.init_std=0", 'data.path=""', "data.synthetic=true"])
    assert cfg.fault.straggler_factor == 0 and cfg.optim.lr == 0


@pytest.mark.parametrize("overrides, hint", [
    (["train.stpes=3"], "unknown config key train.stpes in --set; did you mean train.steps? allowed in [train]:"),
    (["modle.arch=gpt2"], "unknown config section [modle] in --set; did you mean [model]? allowed:"),
    (["model.moe={experts = 4, topk = 2}"],
     "unknown config key model.moe.topk; did you mean model.moe.top_k? allowed:"),
])
def test_a_typo_gets_the_key_it_was_probably_meant_to_be(overrides, hint):
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", overrides)
    assert hint in str(info.value)


def test_a_key_like_no_other_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny.toml", ["train.zzzzqq=1"])
    assert "did you mean" not in str(info.value) and "allowed in [train]:" in str(info.value)
