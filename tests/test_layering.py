"""The package's layering: the import contracts of ``setup.cfg`` (``[importlinter]``: imports point
down, bench > integrations > layers > planning > runtime > kernels | sim > schedule > config, and
the layer families import no other family but through their shared base), checked by running
``lint-imports``; and the simulator and the schedules stay pure Python (no ``torch.distributed``,
no other part of the package but ``config``)."""
import ast
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE = ("sim", "schedule")  # subpackages of pure Python (sim may use torch for dtypes, never torch.distributed)


def _lint_imports() -> list:
    """The ``lint-imports`` command of this interpreter's environment (or the first on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    return [here if os.path.exists(here) else shutil.which("lint-imports") or "lint-imports"]


def test_import_contracts_hold():
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (the test extra installs it: pip install import-linter)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(_lint_imports() + ["--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout, proc.stdout[-6000:]


def _sources(package: str):
    folder = os.path.join(ROOT, "overlap_layers", package)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            yield os.path.join(folder, name)


def _imported_modules(path: str, module: str) -> set:
    """Every module ``path`` (the module ``module``) imports, absolute, at any depth of its code."""
    package = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # "from torch import distributed"
    return out


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_import_no_torch_distributed(package):
    """Read from the source: no module of the package, nor of the package's modules it imports,
    imports ``torch.distributed``; and those modules are its own and ``overlap_layers.config``."""
    seen, todo = set(), [(p, f"overlap_layers.{package}.{os.path.basename(p)[:-3]}".replace(".__init__", ""))
                         for p in _sources(package)]
    while todo:
        path, module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imported_modules(path, module):
            assert not (name == "torch.distributed" or name.startswith("torch.distributed.")), \
                f"{module} imports {name}"
            if name.startswith("overlap_layers."):
                top = name.split(".")[1]
                assert top in PURE or name == "overlap_layers.config" or name.startswith("overlap_layers.config."), \
                    f"{module} imports {name}: the pure packages import only each other and config"
                target = os.path.join(ROOT, *name.split("."))
                for candidate, mod in ((target + ".py", name), (os.path.join(target, "__init__.py"), name)):
                    if os.path.exists(candidate):
                        todo.append((candidate, mod))


def test_pure_packages_load_no_other_part_of_the_package():
    """Imported alone (the root package's ``__init__``, which loads everything, stubbed), the pure
    packages load only themselves and ``config``; and no ``torch.distributed`` while they load no
    torch (``import torch`` loads ``torch.distributed`` itself: then only the source check tells)."""
    code = f"""
import importlib, sys, types
root = types.ModuleType("overlap_layers")
root.__path__ = [{os.path.join(ROOT, "overlap_layers")!r}]
sys.modules["overlap_layers"] = root
for name in {PURE!r}:
    importlib.import_module("overlap_layers." + name)
print(sorted(m for m in sys.modules if m.startswith("overlap_layers.")))
print("torch" not in sys.modules and any(m == "torch.distributed" or m.startswith("torch.distributed.")
                                       for m in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, distributed = proc.stdout.strip().splitlines()
    for name in eval(loaded):
        assert name.split(".")[1] in PURE or name == "overlap_layers.config", name
    assert distributed == "False"


def test_calibration_cache_keeps_its_former_path():
    """``overlap_layers.runtime.calibration_cache`` re-exports the cache from ``planning``."""
    from overlap_layers.planning import calibration_cache as home
    from overlap_layers.runtime import calibration_cache as kept
    for name in ("cache_key", "cache_path", "store", "load_agreed", "default_cache_dir", "CalibrationCacheWarning"):
        assert getattr(kept, name) is getattr(home, name)


def test_integrations_keep_their_names():
    """The integrations' names that users import stay where they were."""
    from overlap_layers.integrations.dtensor import as_dtensor_params, param_groups
    from overlap_layers.integrations.megatron import MegatronBlock, megatron_dense
    from overlap_layers.planning import dtensor
    assert as_dtensor_params is dtensor.as_dtensor_params and callable(param_groups)
    assert callable(megatron_dense) and isinstance(MegatronBlock, type)
