"""The module replacement both swaps share (:mod:`.hf` and :mod:`.megatron`): the arguments every
``swap`` checks, the ``plan`` it parses, and the walk that replaces a model's recognised modules
in place (:func:`replace_modules`: everything built before anything is put in, every module left
in place logged and warned about -- never a silent half-swap).

What is recognised, and what builds the replacement, is each swap's own (:mod:`.hf_build`,
:mod:`.megatron_build`); a builder raises :class:`Unswappable` for a recognised module it cannot
replace, which is then left, with a warning.
"""
from __future__ import annotations

import fnmatch
import logging
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import OverlapConfig
from ..runtime import resolve_group
from .dtensor import tp_mesh

# replace_modules logs to the Hugging Face swap's logger unless given another one
_HF_LOG = logging.getLogger(__package__ + ".hf")

KINDS = ("mlp", "attention", "moe")
BLOCK_KINDS = ("block",)  # swap(..., block=True): whole decoder layers first
_OPTIONS = ("num_tiles", "config", "spec")
_TARGETS = {"mlp": "OverlapMLP", "attention": "OverlapAttention", "moe": "OverlapMoE",
            "block": "OverlapTransformerBlock"}


class Unswappable(Exception):
    """A recognised module that cannot be replaced (the message says why); it is left, warned."""


def on(place) -> dict:
    """The layers' keyword for where they run: ``mesh=`` a 1-D DeviceMesh (DTensor parameters),
    or ``group=`` a ProcessGroup (plain parameters)."""
    return {"mesh": place} if isinstance(place, DeviceMesh) else {"group": place}


def group_of(place):
    """The ProcessGroup of ``place`` (a 1-D DeviceMesh or a ProcessGroup)."""
    return place.get_group() if isinstance(place, DeviceMesh) else place


# ---------------------------------------------------------------------------- arguments
def check_swap_args(model, block: bool, config, what: str) -> None:
    """The arguments every ``swap`` shares (ValueError otherwise)."""
    if not isinstance(block, bool):
        raise ValueError(f"block={block!r}; must be True or False")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__}: must be a torch.nn.Module ({what})")
    if config is not None and not isinstance(config, OverlapConfig):
        raise ValueError(f"config={config!r}: must be an OverlapConfig or None")


def swap_place(model, group, mesh, axis, dtensor) -> tuple:
    """``(group, place)`` of a ``swap`` call: the tensor-parallel group, and where the layers run
    (the 1-D mesh of their DTensor parameters with ``dtensor``, else the group)."""
    group = resolve_group(group, mesh, axis)
    if not isinstance(dtensor, bool):
        raise ValueError(f"dtensor={dtensor!r}; must be True (DTensor parameters) or False (plain)")
    return group, (tp_mesh(None if mesh is not None else group, mesh, axis, model) if dtensor else group)


def _spec_kind(pattern: str, spec, specs: dict) -> str:
    """The kind a plan's spec swaps (``specs``: spec class -> kind); ValueError for anything else."""
    if type(spec) not in specs:
        valid = ", ".join(c.__name__ for c in specs) or "none (this swap takes no specs)"
        raise ValueError(f"plan[{pattern!r}]['spec'] = {spec!r}: must be a spec ({valid})")
    return specs[type(spec)]


def parse_plan(plan, block: bool = False, specs: Optional[dict] = None) -> Optional[List[tuple]]:
    """``[(pattern, kind or None, options)]`` in the plan's order, or None without a plan; the kind
    ``"block"`` (a decoder layer) is valid with ``block=True`` only. ``specs`` (spec class -> the
    kind it swaps): a plan value may be such a spec, or a dict with ``"spec"``, which describes the
    matched modules (options ``{"spec": ...}``, the kind the spec's)."""
    if plan is None:
        return None
    specs = specs or {}
    kinds = KINDS + BLOCK_KINDS if block else KINDS
    if not isinstance(plan, dict):
        raise ValueError(f"plan={plan!r}; must be a dict from module-name patterns (fnmatch) to a kind "
                         f"({', '.join(kinds)}), "
                         + (f"a spec ({', '.join(c.__name__ for c in specs)}), " if specs else "")
                         + "a dict {'kind': ..., 'num_tiles': ..., 'config': ...}, or None")
    rules = []
    for pattern, spec in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f"plan key {pattern!r}: must be a module-name pattern (str), e.g. 'model.layers.*.mlp'")
        opts = {}
        if type(spec) in specs:
            spec = {"spec": spec}
        if isinstance(spec, dict):
            opts = dict(spec)
            if "kind" not in opts and "spec" not in opts:
                raise ValueError(f"plan[{pattern!r}] = {spec!r}: a dict spec needs 'kind' (one of {kinds})")
            valid = _OPTIONS if specs else tuple(o for o in _OPTIONS if o != "spec")
            bad = sorted(set(opts) - set(valid) - {"kind"})
            if bad:
                raise ValueError(f"plan[{pattern!r}]: unknown option(s) {bad}; valid: kind, {', '.join(valid)}")
            spec_kind = _spec_kind(pattern, opts["spec"], specs) if "spec" in opts else None
            kind = opts.pop("kind", spec_kind)
            if spec_kind is not None and spec_kind != kind:
                raise ValueError(f"plan[{pattern!r}]: kind {kind!r} but the spec {type(opts['spec']).__name__} "
                                 f"swaps {spec_kind!r}")
            if "config" in opts and opts["config"] is not None and not isinstance(opts["config"], OverlapConfig):
                raise ValueError(f"plan[{pattern!r}]['config'] = {opts['config']!r}: must be an OverlapConfig")
        else:
            kind = spec
        if kind is not None and kind not in kinds:
            raise ValueError(f"plan[{pattern!r}]: kind {kind!r}; valid: {', '.join(kinds)}, or None to leave the "
                             f"matching modules as they are")
        rules.append((pattern, kind, opts))
    return rules


# ---------------------------------------------------------------------------- the walk
def _names(names: List[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


def _set_parent(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@dataclass
class _Walk:
    """What the walk over a model decided: the modules to build, those left (and why), the
    warnings owed."""
    todo: list = field(default_factory=list)  # (name, module, kind, opts)
    left: dict = field(default_factory=lambda: defaultdict(list))  # kind -> [(name, class name, reason)]
    warned: dict = field(default_factory=lambda: defaultdict(list))  # (kind, class, reason) -> [names]
    handled: set = field(default_factory=set)  # modules decided on: their descendants are not looked at
    already: int = 0
    pattern_hits: dict = field(default_factory=lambda: defaultdict(int))

    def inside(self, name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in self.handled for i in range(1, len(parts)))

    def leave(self, kind: str, name: str, cls: str, reason: str, warning: Optional[str] = None) -> None:
        self.left[kind].append((name, cls, reason))
        if warning is not None:
            self.warned[(kind, cls, warning)].append(name)


def _opts_by_plan(walk: _Walk, rules, name: str, kind: Optional[str], cls: str) -> Optional[tuple]:
    """``(kind, options)`` of the plan's rule for the module ``name``, or None when the module is
    not to be replaced (recorded in ``walk``). A module of an unknown class is replaced where the
    rule gives a spec (which describes it)."""
    rule = next((r for r in rules if fnmatch.fnmatchcase(name, r[0])), None)
    if rule is None:
        if kind is not None:
            walk.leave(kind, name, cls, "not in the plan")
            walk.handled.add(name)
        return None
    pattern, want, opts = rule
    walk.pattern_hits[pattern] += 1
    if want is None:
        if kind is not None:
            walk.leave(kind, name, cls, f"excluded by plan[{pattern!r}]")
        walk.handled.add(name)
        return None
    if kind is None and "spec" in opts:
        return want, dict(opts)
    if kind is None:
        reason = f"plan[{pattern!r}] asks for {want!r} but {cls} is not a recognised {want} class"
        walk.leave(want, name, cls, "unknown class", reason)
        walk.handled.add(name)
        return None
    if kind != want:
        raise ValueError(f"plan[{pattern!r}] = {want!r} matches {name} ({cls}), which is a known {kind} "
                         f"module; map it to {kind!r}, or narrow the pattern")
    return kind, dict(opts)


def _walk(model: nn.Module, rules, config, kind_of: Callable, lookalike: Callable, ours: tuple) -> _Walk:
    """Decide on every module of ``model``, outermost first: already ours, to replace (with its
    options), or left (and whether to warn)."""
    walk = _Walk()
    for name, module in model.named_modules():
        if not name or walk.inside(name):
            continue
        if isinstance(module, ours):
            walk.already += 1
            walk.handled.add(name)
            continue
        kind, cls = kind_of(module), type(module).__name__
        if rules is not None:
            chosen = _opts_by_plan(walk, rules, name, kind, cls)
            if chosen is None:
                continue
            kind, opts = chosen
        else:
            if kind is None:
                look = lookalike(module)
                if look is not None:
                    walk.leave(look, name, cls, "unknown class",
                               f"{cls} looks like a {look} module but is not a recognised class")
                    walk.handled.add(name)
                continue
            opts = {}
        if config is not None and "config" not in opts:
            opts["config"] = config
        walk.todo.append((name, module, kind, opts))
        walk.handled.add(name)
    return walk


def _build_all(walk: _Walk, build: Callable) -> list:
    """``[(name, module, kind, new)]``: every replacement built before the first is put in, so an
    error leaves the model as it was; a module whose build refuses is left (recorded in ``walk``)."""
    built = []
    for name, module, kind, opts in walk.todo:
        cls = type(module).__name__
        try:
            new = build(module, kind, opts)
        except (Unswappable, ValueError) as e:  # ValueError: the layer's own checks (e.g. heads % group size)
            walk.leave(kind, name, cls, str(e), str(e))
            continue
        new.train(module.training)
        if not any(p.requires_grad for p in module.parameters()):
            new.requires_grad_(False)
        built.append((name, module, kind, new))
    return built


def _log_kinds(log: logging.Logger, replaced, left, kinds: Sequence[str], ws: int) -> None:
    """One log line per kind of ``kinds``, and per other kind met: what was replaced and left."""
    for kind in dict.fromkeys(list(kinds) + list(KINDS)):
        rep, lft = replaced[kind], left[kind]
        if kind not in kinds and not rep and not lft:
            continue
        by_cls = defaultdict(int)
        for _, c in rep:
            by_cls[c] += 1
        line = f"overlap_layers.swap: {kind}: replaced {len(rep)}"
        if rep:
            line += f" ({', '.join(f'{c} x{n}' for c, n in by_cls.items())} -> {_TARGETS[kind]} over {ws} ranks)"
        line += f", left {len(lft)}"
        if lft:
            reasons = defaultdict(list)
            for n, c, r in lft:
                reasons[f"{c}: {r}"].append(n)
            line += " (" + "; ".join(f"{r}: {_names(ns, 2)}" for r, ns in reasons.items()) + ")"
        log.info(line)


def replace_modules(model: nn.Module, group, rules, config, *, kind_of: Callable, lookalike: Callable,
                    build: Callable, ours: tuple, nothing: Optional[str], before_build: Optional[Callable] = None,
                    kinds: Sequence[str] = KINDS, log: logging.Logger = _HF_LOG, stacklevel: int = 4):
    """Replace, in place, the modules of ``model`` that ``kind_of`` recognises (or ``rules``
    select) by ``build(module, kind, opts)``; all built before any is put in, so an error leaves
    the model as it was. Modules left in place are logged and warned about (never a silent
    half-swap; one log line per kind of ``kinds``, and per other kind met); ``before_build(todo)``
    may raise first; ``nothing`` (None: no warning) says what was looked for when nothing was
    replaced. Returns ``(replaced, already)``:
    kind -> [(name, class)], and how many modules were already ours. Logs go to ``log``;
    ``stacklevel`` is the warnings' (counted from this function's frame)."""
    walk = _walk(model, rules, config, kind_of, lookalike, ours)
    if before_build is not None:
        before_build(walk.todo)
    built = _build_all(walk, build)
    replaced = defaultdict(list)  # kind -> [(name, class)]
    for name, module, kind, new in built:
        _set_parent(model, name, new)
        replaced[kind].append((name, type(module).__name__))
    del built
    walk.todo.clear()  # the replaced modules are not held past here

    if rules is not None:
        for pattern, _, _ in rules:
            if not walk.pattern_hits[pattern]:
                warnings.warn(f"overlap_layers.swap: plan pattern {pattern!r} matched no module", UserWarning,
                              stacklevel=stacklevel)
    for (kind, cls, reason), names in walk.warned.items():
        warnings.warn(f"overlap_layers.swap: left {len(names)} {kind} module(s) of class {cls} unswapped ({reason}): "
                      f"{_names(names)}", UserWarning, stacklevel=stacklevel)
    _log_kinds(log, replaced, walk.left, kinds, dist.get_world_size(group))
    if walk.already:
        log.info(f"overlap_layers.swap: {walk.already} module(s) were already overlap layers (left as they are)")
    if nothing is not None and not any(replaced.values()) and not walk.already:
        warnings.warn(f"overlap_layers.swap: nothing was replaced ({nothing}"
                      + (" matched the plan" if rules is not None else "") + ")", UserWarning, stacklevel=stacklevel)
    return replaced, walk.already
