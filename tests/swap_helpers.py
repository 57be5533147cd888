"""What the swap tests (Hugging Face and megatron-core) share: capturing ``swap``'s log and
warnings, gathering a swapped layer's gradients, the relative error, and comparing a swapped model
with the unswapped one by the unswapped model's state-dict keys."""
import logging
import warnings

import torch


def full(t):
    """``t`` as a plain tensor: a DTensor's ``full_tensor()`` (a collective), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(got, want):
    got, want = full(got), full(want)
    return ((got.double() - want.double()).norm() / max(want.double().norm().item(), 1e-30)).item()


@torch.no_grad()
def randomize_(model) -> None:
    """Every parameter of ``model`` drawn anew, the same under the same seed: matrices
    ``N(0, fan_in^-1)`` (routers' ``gate.weight`` twice that scale, so routing is decisive), vectors
    (norms, biases) ``1 + 0.1 N(0, 1)``."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5 * (2.0 if name.endswith("gate.weight") else 1.0))
        else:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))


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


# ------------------------------------------------------------------ comparing in the unswapped layout
def state(model) -> dict:
    """The model's state dict, every entry a whole plain tensor (a collective; plain parts gathered)."""
    from overlap_layers.integrations import full_state_dict
    return {k: v.clone() for k, v in full_state_dict(model).items()}


@torch.no_grad()
def grad_state(model) -> dict:
    """The model's state dict with every parameter's value replaced by its gradient (zero where
    None): for a swapped model each entry is the gradient of the unswapped model's tensor of that
    key, so the swapped layers' shards, fused entries and tied routers compare by key (a collective)."""
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    out = state(model)
    for p, s in zip(params, saved):
        p.copy_(s)
    return out


def compare(errs: dict, what: str, got: dict, want: dict) -> None:
    """``errs[f"{what} {key}"]``: the relative error of every entry; the keys must be the same, in order."""
    assert list(got) == list(want), (what, [k for k in got if k not in want], [k for k in want if k not in got])
    for k, w in want.items():
        errs[f"{what} {k}"] = rel(got[k], w) if w.abs().sum() > 0 or got[k].abs().sum() > 0 else 0.0


def check_against_dense(model, dense, run, errs: dict) -> None:
    """A swapped ``model`` against the unswapped ``dense`` (``run(m) -> (logits, loss)``), by the
    unswapped state-dict keys: state dict, logits, loss, every gradient, one AdamW step, and the
    unswapped state dict loaded. Relative errors into ``errs``."""
    compare(errs, "state", state(model), state(dense))
    (logits_d, loss_d), (logits_s, loss_s) = run(dense), run(model)
    loss_d.backward()
    loss_s.backward()
    errs["logits"] = rel(logits_s.detach(), logits_d.detach())
    errs["loss"] = abs(loss_s.item() - loss_d.item()) / abs(loss_d.item())
    compare(errs, "grad", grad_state(model), grad_state(dense))
    for m in (model, dense):
        torch.optim.AdamW(m.parameters(), lr=1e-2).step()
    compare(errs, "step", state(model), state(dense))
    torch.optim.AdamW(dense.parameters(), lr=1e-2).step()  # then the dense model's state dict loads
    model.load_state_dict(dense.state_dict())
    compare(errs, "load", state(model), state(dense))


def checkpoint_round_trips(model, dense, unswapped, swapped, path: str) -> dict:
    """The keys whose tensors differ (exactly) from ``dense``'s state dict -- ``dense`` the swapped
    ``model``'s unswapped twin -- after each round trip, every rank calling it with one shared
    ``path``: ``model.save_pretrained`` read by the unswapped class's ``from_pretrained``; DCP of
    ``model`` loaded into ``unswapped`` (an unswapped model of other weights); DCP of ``dense``
    loaded into ``swapped`` (a swapped model of other weights) by ``set_model_state_dict``."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    want = dense.state_dict()

    def differing(got: dict) -> list:
        return [k for k in want if k not in got or not torch.equal(full(got[k]).cpu(), want[k])]

    model.save_pretrained(os.path.join(path, "pretrained"))
    dist.barrier()
    out = {"from_pretrained": differing(type(dense).from_pretrained(os.path.join(path, "pretrained")).state_dict())}
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(path, "swapped"))
    into = unswapped.state_dict()
    dcp.load(into, checkpoint_id=os.path.join(path, "swapped"))
    unswapped.load_state_dict(into)
    out["dcp_to_unswapped"] = differing(unswapped.state_dict())
    dcp.save(want, checkpoint_id=os.path.join(path, "unswapped"))
    into = get_model_state_dict(swapped)
    dcp.load(into, checkpoint_id=os.path.join(path, "unswapped"))
    set_model_state_dict(swapped, into)
    out["dcp_to_swapped"] = differing(state(swapped))
    return out
