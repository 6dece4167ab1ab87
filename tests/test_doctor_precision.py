"""`mpitrain doctor precision`: each layer replayed in float64 on the low-precision run's own inputs. bf16 and fp16
errors are nonzero and within the recipe's bounds; a planted defect (one linear's output cast to float8 with no
scale) is flagged at that layer and nowhere else."""
from __future__ import annotations

import pytest
from mpi4py import MPI
from mpi_helpers import REPO_ROOT

from mpitrain.doctor.plant import PLANT_ENV
from mpitrain.doctor.precision import QUANTITIES, UNIT_ROUNDOFF, bounds_for, load_doctor_config, measure, run_precision
from mpitrain.errors import ConfigError

TINY = str(REPO_ROOT / "configs" / "tiny.toml")


def settings(compute: str, *more: str) -> list[str]:
    return ["data.synthetic=true", f"precision.compute={compute}", *more]


@pytest.mark.parametrize("compute,more", [("bfloat16", ()), ("float16", ()),
                                          ("bfloat16", ("model.arch=llama", "model.moe={experts=4,top_k=2}"))])
def test_low_precision_errors_are_nonzero_and_within_their_bounds(compute, more):
    budget, planted = measure(load_doctor_config(TINY, settings(compute, *more)), MPI.COMM_WORLD, 2)
    assert planted is None
    rows = budget.rows
    expected = {"embed", "blocks.0.norm1", "blocks.0.attention", "blocks.0.attention.qkv", "blocks.0.attention.out",
                "blocks.1.norm2", "blocks.1.mlp", "head", "head.norm", "head.projection"}
    assert expected <= set(rows)
    assert ("blocks.1.mlp.down" in rows) == ("model.moe={experts=4,top_k=2}" not in more)  # an MoE has no down
    for row in rows.values():
        assert row.errors, row.layer
        assert not row.over(), (row.layer, row.errors, row.bounds)
        for quantity, (error, _) in row.errors.items():
            assert error > 0, (row.layer, quantity)
            if (row.layer, quantity) != ("head", "output"):  # the loss sum is fp32: its rounding averages out
                assert error > UNIT_ROUNDOFF[compute] / 100, (row.layer, quantity, error)  # really rounded
    assert "input gradient" in rows["blocks.0.attention"].errors and "weight gradient" in rows["embed"].errors


@pytest.mark.parametrize("recipe,steps", [("tensor", 1), ("delayed", 2), ("block", 1), ("mxfp8", 1)])
def test_fp8_recipes_are_within_their_bounds_and_coarser_than_bf16(recipe, steps):
    budget, _ = measure(load_doctor_config(TINY, settings("bfloat16", f"precision.fp8={recipe}")), MPI.COMM_WORLD,
                        steps)
    for row in budget.rows.values():
        assert not row.over(), (row.layer, row.errors, row.bounds)
    for layer in ("blocks.0.attention.qkv", "blocks.1.mlp.down"):  # fp8 GEMMs: well past bf16's ~2.5e-3
        assert 2.0**-6 < budget.rows[layer].errors["output"][0] < 2.0**-3
    assert budget.rows["head.projection"].errors["output"][0] < 2.0**-7  # the head stays bf16


def test_an_unscaled_float8_cast_is_flagged_at_its_layer(monkeypatch):
    monkeypatch.setenv(PLANT_ENV, "fp8_unscaled:layer=1")
    lines = []
    status = run_precision(TINY, settings("bfloat16"), 1, MPI.COMM_WORLD, lines.append)
    text = "\n".join(lines)
    assert status == 1
    assert "planted defect: fp8_unscaled in blocks.1.mlp.down" in text
    assert text.splitlines()[-1] == "over the bound: blocks.1.mlp (output), blocks.1.mlp.down (output)"


def test_bounds_are_roundings_times_the_roundoff():
    u = 2.0**-8
    assert bounds_for("linear out", "bfloat16", "none", True) == (2 * u, 0.0, 7 * u)
    fp8 = bounds_for("linear up", "bfloat16", "block", True)  # e4m3 input and weight; e5m2 output gradient
    upstream = 2.0**-4 + 2.0**-3  # the down linear's input gradient (e4m3 weight, e5m2 dy) is up's dy
    assert fp8[0] == pytest.approx(2 * u + 2 * 2.0**-4)
    assert fp8[2] == pytest.approx(5 * u + 2.0**-4 + 2.0**-3 + upstream)
    assert bounds_for("linear projection", "bfloat16", "block", False)[0] == 2 * u  # the head stays bf16
    assert len(QUANTITIES) == 3


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="precision.compute = 'float32' has no low-precision error"):
        load_doctor_config(TINY, settings("float32"))
    with pytest.raises(ConfigError, match="--steps must be >= 1"):
        run_precision(TINY, settings("bfloat16"), 0, MPI.COMM_WORLD, print)
