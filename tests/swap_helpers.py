"""What the swap tests (Hugging Face and megatron-core) share: capturing ``swap``'s log and
warnings, gathering a swapped layer's gradients, and the relative error."""
import logging
import warnings

import torch


def full(t):
    """``t`` as a plain tensor: a DTensor's ``full_tensor()`` (a collective), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(got, want):
    got, want = full(got), full(want)
    return ((got.double() - want.double()).norm() / max(want.double().norm().item(), 1e-30)).item()


def grads_to_dense(layer):
    """``to_dense()`` of the layer's gradients (a collective): weights swapped for grads, gathered,
    restored."""
    params = list(layer.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        out = layer.to_dense()
        for p, s in zip(params, saved):
            p.copy_(s)
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def swap_logged(model, logger_name: str, ours_only: bool = False, **kw):
    """``overlap_layers.swap(model, **kw)`` with the log lines of ``logger_name`` and the
    UserWarnings raised (only overlap_layers' own with ``ours_only``)."""
    from overlap_layers import swap
    logger = logging.getLogger(logger_name)
    h, old = _Records(), logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            swap(model, **kw)
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)
    return h.lines, [str(w.message) for w in ws if issubclass(w.category, UserWarning)
                     and (not ours_only or "overlap_layers" in str(w.message))]
