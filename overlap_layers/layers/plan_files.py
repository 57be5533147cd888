"""Plan files: the settled plans of a model's layers and blocks written to JSON, and read back into
another run of the same model, so that its calls run those plans from their first call on.

Reference: after ``load_plans(model, path)`` every planned layer (``num_tiles="auto"``, nothing
pinned) and every ``OverlapTransformerBlock`` of ``model`` holds, for each plan key in ``path``,
the plan ``save_plans`` wrote for the module of that name, as settled: a call of that key runs it
without planning, calibrating or verifying. Keys missing from the file plan as usual.

[Note: plan files]
A planned layer picks its plan by timing on the first calls ([Note: first-call verification] in
``planning/plan_cache.py``), so two runs of one model can run different plans, whose rounding
can differ (GEMMs of other shapes, partial sums reduced in another order). Writing the settled plans of one run and
loading them into the next makes the second run's plans the first run's; with the same seeds,
inputs, versions and devices (and deterministic kernels where torch needs
``torch.use_deterministic_algorithms``) its outputs and gradients are bit-identical. Which plans
a call runs decides which collectives it issues, so a loaded plan must be loaded on every rank:
``load_plans`` is a collective, one gather per planned module over its group, of a digest of what
the rank loaded for it (and whether it could read the file): any difference is a ValueError on
every rank of that group, before a plan is used. Each module's name (``named_modules``) also
becomes the layer's name in the agreement's errors. The file holds per module its class and per
settled key the key and the plan's fields (``TilePlan``: tiles, buckets, re-gather, streams,
transport, decomposition, SM carveout; a block's: fused or not, and its K), in JSON, written by
one rank or by each (the plans are equal on every rank).
"""
from __future__ import annotations

import json
import zlib
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import check_num_tiles, check_positive_int
from ..planning.layer_spec import TiledLayer
from ..planning.plan import TilePlan
from .block.fused import BlockPlan
from .block.layer import OverlapTransformerBlock

FORMAT = 1  # the file's "overlap_layers_plans" version
_TILE_FIELDS = ("num_tiles", "buckets_fwd", "buckets_bwd", "regather", "num_streams", "transport", "decomposition",
                "carveout")  # what runs (TilePlan's other fields explain a choice)
_BLOCK_FIELDS = ("fused", "num_tiles")


def _planned(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every planned layer and block of ``model``, in ``named_modules`` order."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: must be a torch.nn.Module")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (TiledLayer, OverlapTransformerBlock))]


def _cache(module):
    """The plan cache of a layer, or of a block's fusion."""
    return module.planner.plans if isinstance(module, TiledLayer) else module._fusion.cache()


def _agreement(module):
    """The agreement of a layer's group, or of a block's (its attention's)."""
    return (module if isinstance(module, TiledLayer) else module.attention).planner.agreement


def _to_json(v):
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (tuple, list)):
        return [_to_json(x) for x in v]
    return v


def _from_json(v):
    """A key or field from JSON: lists as tuples, ``{"dtype": name}`` as the torch dtype."""
    if isinstance(v, list):
        return tuple(_from_json(x) for x in v)
    if isinstance(v, dict):
        dtype = getattr(torch, str(v.get("dtype")), None)
        if set(v) != {"dtype"} or not isinstance(dtype, torch.dtype):
            raise ValueError(f"{v!r} is not a dtype ({{'dtype': 'bfloat16'}}, ...)")
        return dtype
    return v


def save_plans(model: nn.Module, path) -> None:
    """Write the settled plans of ``model``'s planned layers and blocks to ``path`` as JSON, by
    module name ([Note: plan files]); rank-local (the plans are equal on every rank)."""
    out = {}
    for name, m in _planned(model):
        if isinstance(m, TiledLayer):
            m.planner.name = name
        keep = _TILE_FIELDS if isinstance(m, TiledLayer) else _BLOCK_FIELDS
        out[name] = {"class": type(m).__name__,
                     "plans": [{"key": _to_json(key), "plan": {f: _to_json(getattr(plan, f)) for f in keep}}
                               for key, plan in _cache(m).settled_items()]}
    with open(path, "w") as f:
        json.dump({"overlap_layers_plans": FORMAT, "modules": out}, f, indent=1)


def _decode(module, entry, path) -> list:
    """``[(key, plan)]`` of a module's entry in a plan file (ValueError naming what is wrong)."""
    if not isinstance(entry, dict) or entry.get("class") != type(module).__name__ or \
            not isinstance(entry.get("plans"), list):
        raise ValueError(f"its entry must be {{'class': '{type(module).__name__}', 'plans': [...]}}; got "
                         f"{str(entry)[:200]}")
    layer = isinstance(module, TiledLayer)
    names = _TILE_FIELDS if layer else _BLOCK_FIELDS
    out = []
    for item in entry["plans"]:
        plan = item.get("plan") if isinstance(item, dict) else None
        if not isinstance(plan, dict) or set(plan) != set(names) or "key" not in item:
            raise ValueError(f"each plan must be {{'key': [...], 'plan': {{{', '.join(names)}}}}}; "
                             f"got {str(item)[:200]}")
        values = {f: _from_json(v) for f, v in plan.items()}
        reason = f"loaded by load_plans from {path}"
        if layer:
            made = TilePlan(**values, reason=reason)
            check_num_tiles(made.num_tiles, "plan.num_tiles")
            check_positive_int(made.num_streams, "plan.num_streams")
            module._check_pin(made)
        else:
            made = BlockPlan(**values, reason=reason)
            if not isinstance(made.fused, bool):
                raise ValueError(f"plan.fused={made.fused!r}; must be true or false")
            check_positive_int(made.num_tiles, "plan.num_tiles")
        out.append((_from_json(item["key"]), made))
    return out


def load_plans(model: nn.Module, path) -> None:
    """Hold the plans ``save_plans`` wrote to ``path`` as the settled plans of ``model``'s modules
    of the same names ([Note: plan files]). A collective over each planned module's group: call
    it on every rank with the same file; a file that cannot be read or does not fit the model, or
    differs across the ranks, is a ValueError on every rank and loads nothing."""
    planned = _planned(model)
    problem: Optional[str] = None
    loaded = {}
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("overlap_layers_plans") != FORMAT or \
                not isinstance(data.get("modules"), dict):
            raise ValueError(f"not a plan file of format {FORMAT} (save_plans writes them)")
        unknown = sorted(set(data["modules"]) - {name for name, _ in planned})
        if unknown:
            raise ValueError(f"no planned module of the model is named {unknown[:4]}")
        for name, m in planned:
            if name in data["modules"]:
                try:
                    loaded[name] = _decode(m, data["modules"][name], path)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"module {name!r}: {e}") from e
    except (OSError, ValueError) as e:
        problem, loaded = f"load_plans(path={str(path)!r}): {e}", {}
    for name, m in planned:  # every rank, every module: the same gathers whatever this rank read
        agreement = _agreement(m)
        if dist.get_world_size(agreement.group) == 1:
            continue
        mine = zlib.crc32(repr([(key, plan.digest()) for key, plan in loaded.get(name, ())]).encode())
        rows = agreement.gather((int(problem is not None), mine), who=lambda: f"load_plans, module {name!r}")
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            raise ValueError(problem or f"load_plans(path={str(path)!r}): rank(s) {failed} could not load the file")
        if len({row[1] for row in rows}) > 1:
            raise ValueError(f"load_plans(path={str(path)!r}): the ranks loaded different plans for module {name!r}; "
                             f"every rank must load the same file")
    if problem is not None:
        raise ValueError(problem)
    for name, m in planned:
        if isinstance(m, TiledLayer):
            m.planner.name = name
        cache = _cache(m)
        for key, plan in loaded.get(name, ()):
            cache.preload(key, plan)

