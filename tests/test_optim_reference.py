"""The optimizer against outside references: every parity test compares layouts with this code's own single process,
so a bug in AdamW, the schedule or clipping would pass them all. Here: torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_, and a schedule computed by hand. float64, 20 steps, 1e-12."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mpitrain.optim.adamw import AdamW, AdamWHyper, clip_scale
from mpitrain.optim.schedule import lr_at
from mpitrain.state.params import FlatBuffer, ParamSpec, UnitLayout
from mpitrain.state.strategy import Segment

STEPS = 20


def test_schedule_by_hand():
    """lr 1e-3, min 1e-4, 5 warm-up steps of 20: linear to the peak, then cosine down to min_lr at the end."""
    expected = {0: 2e-4, 1: 4e-4, 4: 1e-3, 5: 1e-3, 10: 1e-4 + 0.75 * 9e-4, 20: 1e-4,
                15: 1e-4 + 0.5 * 9e-4 * (1 + math.cos(2 * math.pi / 3))}  # 10/15 of the decay: cos(2pi/3) = -1/2
    for step, lr in expected.items():
        assert lr_at(step, 1e-3, 1e-4, 5, 20) == pytest.approx(lr, rel=1e-12, abs=0), step
    assert lr_at(15, 1e-3, 1e-4, 5, 20) == pytest.approx(3.25e-4, rel=1e-12)
    assert lr_at(0, 1e-3, 1e-4, 0, 20) == pytest.approx(1e-3, rel=1e-12)  # no warm-up: start at the peak


def _layout():
    """Two matrices (decayed), a bias and a norm gain (not decayed), as the model declares them."""
    return UnitLayout("u", [ParamSpec("b", (7,), "zeros"), ParamSpec("w1", (5, 7), "normal", 0.1),
                            ParamSpec("g", (5,), "ones"), ParamSpec("w2", (7, 3), "normal", 0.1)])


def test_adamw_with_clipping_and_schedule_matches_torch():
    torch = pytest.importorskip("torch", reason="torch is the reference here: pip install -e '.[test]'")
    rng = np.random.default_rng(0)
    layout = _layout()
    params = FlatBuffer.allocate([layout], np, np.float64)
    grads = FlatBuffer.allocate([layout], np, np.float64)
    for spec in layout.specs:
        params.views[0][spec.name][...] = rng.normal(size=spec.shape)
    hyper = AdamWHyper(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ours = AdamW([Segment(params.data, grads.data, params.ranges(lambda spec: spec.decay))], hyper)
    reference = {spec.name: torch.tensor(params.views[0][spec.name].copy(), requires_grad=True)
                 for spec in layout.specs}
    decayed = [reference[s.name] for s in layout.specs if s.decay]
    plain = [reference[s.name] for s in layout.specs if not s.decay]
    assert len(decayed) == 2 and len(plain) == 2
    torch_adamw = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                                    lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    max_norm, clipped = 1.0, 0
    for step in range(STEPS):
        scale_of_step = 3.0 if step % 3 else 0.05  # some steps clip, some do not
        for spec in layout.specs:
            grads.views[0][spec.name][...] = scale_of_step * rng.normal(size=spec.shape)
            reference[spec.name].grad = torch.tensor(grads.views[0][spec.name].copy())
        lr = lr_at(step, 1e-2, 1e-3, 4, STEPS)
        norm = float(np.sqrt(grads.data @ grads.data))
        scale = clip_scale(norm, max_norm)
        clipped += scale != 1.0
        grads.data *= scale
        ours.step(lr)
        torch_norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), max_norm)
        assert float(torch_norm) == pytest.approx(norm, rel=1e-12)
        for group in torch_adamw.param_groups:
            group["lr"] = lr
        torch_adamw.step()
        for spec in layout.specs:
            expected = reference[spec.name].detach().numpy()
            np.testing.assert_allclose(params.views[0][spec.name], expected, rtol=1e-12, atol=1e-14,
                                       err_msg=f"{spec.name} after step {step}")
    assert 0 < clipped < STEPS  # both branches of clipping were exercised
    state = torch_adamw.state[decayed[0]]
    np.testing.assert_allclose(ours.exp_avg[params.ranges(lambda s: s.name == "w1")[0][0]:][:35],
                               state["exp_avg"].numpy().reshape(-1), rtol=1e-12)
