"""The composability table's covering subset (benchmarks/composability.py --pairwise): every feature, every parallel
layout of the table's first rows and columns and each named pair at least once, and the riskiest cells of the rows
and columns added last, each cell either at parity with one process (float64, 1e-10: step losses and final whole
tensors; 1e-6 for FP8 recipes) or refused with a reason. A cell that trains and differs, crashes, or is refused with
"not (yet) supported" instead of a reason fails here, naming the command that reproduces it."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from tests.mpi_helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "composability.py"
_spec = importlib.util.spec_from_file_location("composability", SCRIPT)
composability = sys.modules["composability"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(composability)


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    measured = composability.run_cells(composability.PAIRWISE, jobs=2, scratch=tmp_path_factory.mktemp("cells"))
    return {(cell.feature, cell.layout): cell for cell in measured}


@pytest.mark.parametrize("feature, layout", composability.PAIRWISE, ids=[f"{f} x {lay}".replace(" ", "-")
                                                                          for f, lay in composability.PAIRWISE])
def test_cell_is_parity_or_a_reasoned_refusal(cells, feature, layout):
    cell = cells[feature, layout]
    where = f"{cell.status}: {cell.detail}\nreproduce: {cell.command}"
    assert cell.status in ("parity", "refused"), where
    if cell.status == "parity":
        assert cell.max_rel_diff <= composability.RTOL, where
    else:
        assert not cell.refused_without_reason, f"a refusal must say why the combination cannot work; {where}"


def test_the_subsets_cover_every_feature_layout_and_named_pair():
    """The CI subset and the --new subset together measure every row and column; each cell they name applies."""
    both = composability.PAIRWISE + composability.NEW_CELLS
    assert {f for f, _ in both} == {f.name for f in composability.FEATURES}
    assert {lay for _, lay in both} == {lay.name for lay in composability.LAYOUTS}
    assert set(composability.NEW_LAYOUTS) <= {lay for _, lay in composability.NEW_CELLS}
    for pair in [("MoE + LoRA", "ep 2"), ("MoE + recompute selective", "ep 2"), ("MoE", "cp 2"),
                 ("adafactor + offload host", "ZeRO-1"), ("dense llama", "pp 2 dualpipev x tp 2"),
                 ("dense llama", "cp 4 hybrid ZeRO-3 (2 nodes)"), ("MoE", "dp 2 x pp 2 x tp 2 + SP overlap ZeRO-1"),
                 ("fp8 tensor", "cp 2")]:
        assert pair in composability.PAIRWISE
    for f, lay in both:
        assert composability.applies(composability.find_feature(f), composability.find_layout(lay))


def test_each_feature_changes_the_one_process_run(cells):
    """A row whose keys changed nothing would be at parity trivially: every feature but those that are the dense
    row's math by design must change the one-process losses."""
    dense = next(c.reference_losses for c in cells.values() if c.feature == "dense gpt2")
    assert dense
    for cell in cells.values():
        quantized = composability.find_feature(cell.feature).quantized  # ZeRO++ acts on collectives only
        if cell.feature not in composability.SAME_MATH_AS_DENSE and not quantized and cell.reference_losses:
            assert cell.reference_losses != dense, f"{cell.feature}: the one-process run is the dense run"


def _outcome(losses, params, returncode=0, stderr=""):
    return composability.Outcome("cmd", returncode, stderr, list(losses), dict(params))


def test_the_judge_tells_parity_from_mismatch_refusal_and_crash():
    """The checks that the table rests on can fail: one tensor off by 1e-8, a loss off by 1e-9, a refusal
    without a reason, a traceback."""
    feature, layout = composability.FEATURES[0], composability.LAYOUTS[0]
    params = {"w": np.linspace(1, 2, 12).reshape(3, 4), "b": np.zeros(3)}
    reference = _outcome([(1, 5.0), (2, 4.0)], params)
    same = composability.judge(feature, layout, reference, _outcome([(1, 5.0), (2, 4.0)], params), 0)
    assert same.status == "parity" and same.max_rel_diff == 0
    off = {**params, "w": params["w"] * (1 + 1e-8)}
    assert composability.judge(feature, layout, reference, _outcome(reference.losses, off), 0).status == "MISMATCH"
    late = _outcome([(1, 5.0), (2, 4.0 * (1 + 1e-9))], params)
    assert composability.judge(feature, layout, reference, late, 0).status == "MISMATCH"
    missing = _outcome(reference.losses, {"w": params["w"]})
    assert "tensor names differ" in composability.judge(feature, layout, reference, missing, 0).detail
    refused = composability.judge(feature, layout, reference, _outcome([], {}, 1, "ERROR: x is not supported yet\n"), 0)
    assert refused.status == "refused" and refused.refused_without_reason
    later = _outcome([], {}, 1, "ERROR: the adapters are not split over tp ranks yet; use tp = 1\n")
    assert composability.judge(feature, layout, reference, later, 0).refused_without_reason
    reasoned = _outcome([], {}, 1, "ERROR: cp splits the sequence the loss needs whole\n")
    assert not composability.judge(feature, layout, reference, reasoned, 0).refused_without_reason
    crash = _outcome([], {}, 1, "Traceback (most recent call last):\nERROR: boom\n")
    assert composability.judge(feature, layout, reference, crash, 0).status == "ERROR"


def test_fp8_rows_hold_to_their_tolerance_and_zero_quantized_rows_to_their_bounds():
    """An FP8 row passes at 1e-8 and fails at 1e-5; a ZeRO++ row is `bounded` inside the codec's loss bound and
    Adam's weight bound, a MISMATCH outside either."""
    layout = composability.find_layout("ZeRO-3")
    params = {"w": np.linspace(1, 2, 12).reshape(3, 4)}
    reference = _outcome([(1, 5.0), (2, 4.0)], params)
    fp8 = composability.find_feature("fp8 block")
    for factor, status in ((1 + 1e-8, "parity"), (1 + 1e-5, "MISMATCH")):
        run = _outcome([(1, 5.0), (2, 4.0 * factor)], params)
        assert composability.judge(fp8, layout, reference, run, 0).status == status
    int8 = composability.find_feature("ZeRO int8 gather")
    loss_bound, weight_bound = composability.quantized_bounds(int8)
    assert loss_bound == 1 / 254 and 0 < weight_bound < 1
    near = _outcome([(1, 5.0), (2, 4.0 * (1 + loss_bound / 2))], {"w": params["w"] + weight_bound / 2})
    assert composability.judge(int8, layout, reference, near, 0).status == "bounded"
    far_loss = _outcome([(1, 5.0), (2, 4.0 * (1 + 2 * loss_bound))], params)
    far_weights = _outcome(reference.losses, {"w": params["w"] + 2 * weight_bound})
    for run in (far_loss, far_weights):
        assert composability.judge(int8, layout, reference, run, 0).status == "MISMATCH"
    assert not composability.applies(int8, composability.find_layout("ZeRO-2"))


def test_the_table_has_every_feature_and_layout(cells):
    text = composability.render(list(cells.values()), "pairwise", 60.0, 2)
    header = next(line for line in text.splitlines() if line.startswith("| feature |"))
    assert all(f" {lay.name} |" in header for lay in composability.LAYOUTS)
    assert all(f"| {f.name} |" in text for f in composability.FEATURES)
