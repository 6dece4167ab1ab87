"""numpy references of the fused kernels that have no twin in layers/ops.py (row softmax, fused cross-entropy,
AdamW over a flat buffer): the same arithmetic, in the order the kernels do it."""

from __future__ import annotations

import math

import numpy as np


def softmax_forward(x):
    shifted = x - x.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward(y, dy):
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))


def cross_entropy_with_grad(logits, targets, scale: float):
    """Per-row loss lse - logit[target], and dlogits = (softmax - onehot) * scale, in one pass (as llm.c)."""
    rows = logits.reshape(-1, logits.shape[-1])
    top = rows.max(axis=-1, keepdims=True)
    e = np.exp(rows - top)
    total = e.sum(axis=-1, keepdims=True)
    lse = np.log(total) + top
    picked = rows[np.arange(rows.shape[0]), targets.reshape(-1)]
    grad = e / total
    grad[np.arange(rows.shape[0]), targets.reshape(-1)] -= 1.0
    return (lse[:, 0] - picked).reshape(targets.shape), (grad * scale).reshape(logits.shape)


def adamw_update(p, g, m, v, *, lr, beta1, beta2, eps, step, shrink=1.0, grad_scale=1.0):
    """optim/adamw.py's update of one flat buffer (decoupled decay `shrink` = 1 - lr wd where it applies)."""
    g = g * grad_scale
    p *= shrink
    m *= beta1
    m += (1.0 - beta1) * g
    v *= beta2
    v += (1.0 - beta2) * (g * g)
    denom = np.sqrt(v)
    denom /= math.sqrt(1.0 - beta2 ** step)
    denom += eps
    update = m / denom
    update *= lr / (1.0 - beta1 ** step)
    p -= update
