"""The installed layout's import graph: no circle between modules, no module importing another's private
name, the tt floor free of nn.Module-level code and ops; the old module paths still import."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# folder -> package, as pyproject.toml maps them
PACKAGES = {"comera_compile": ROOT / "comera_compile", "comera_compile.passes": ROOT / "passes",
            "comera_compile.kernels": ROOT / "kernels"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(path: pathlib.Path, modules: dict, inside_functions: bool = False) -> tuple[set[str], list[str]]:
    """The package modules ``path`` imports when it is imported (with ``inside_functions``, also those
    its functions import when they run; never those for type checking only), and every private name
    it imports from a package module."""
    eager: set[str] = set()
    private: list[str] = []

    def visit(body, lazy: bool) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, True)
            elif isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With)):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block, lazy)
            elif isinstance(node, (ast.For, ast.While)):
                visit(node.body + node.orelse, lazy)
            elif isinstance(node, ast.Import):
                eager.update(a.name for a in node.names if a.name in modules and (inside_functions or not lazy))
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if alias.name.startswith("_") and target not in modules:
                        private.append(f"from {node.module} import {alias.name}")
                    if inside_functions or not lazy:
                        eager.add(target if target in modules else node.module)

    visit(ast.parse(path.read_text()).body, False)
    return eager, private


@pytest.mark.parametrize("inside_functions", [False, True], ids=["at-import", "with-function-imports"])
def test_no_circles_and_no_private_names(inside_functions):
    """No circle between modules, counting the imports their functions make too (a function-level
    import is no licence to import back up a floor)."""
    modules = _modules()
    graph, private = {}, []
    for name, path in modules.items():
        deps, names = _imports(path, modules, inside_functions)
        graph[name] = deps - {name}
        private += [f"{name}: {n}" for n in names]
    assert not private, private
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, " -> ".join(path[path.index(dep):] + [dep]) if dep in path else dep
            if dep not in state:
                walk(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])


def test_the_tt_floor_holds_no_module_and_no_op():
    modules = _modules()
    allowed = {"comera_compile.tt", "comera_compile.tt.format", "comera_compile.tt.planner",
               "comera_compile.fx_utils", "comera_compile.devices"}
    for name in [m for m in modules if m == "comera_compile.tt" or m.startswith("comera_compile.tt.")]:
        deps, _ = _imports(modules[name], modules)
        assert deps <= allowed, (name, deps - allowed)
        tree = ast.parse(modules[name].read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        used = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not [m for m in imported | used if m.startswith(("torch.nn", "torch.library", "nn."))], name


def test_rank_adaptation_sits_on_tensorize_and_tt():
    """The rank_adaptation package imports (at import time or inside functions) only tt, tensorize and
    itself from the package: nothing of the compiler above it (backend, passes, options, ...)."""
    modules = _modules()
    allowed = ("comera_compile.tt", "comera_compile.tensorize", "comera_compile.rank_adaptation")
    for name in [m for m in modules if m.startswith("comera_compile.rank_adaptation")]:
        tree = ast.parse(modules[name].read_text())
        targets = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for node in [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]:
            targets |= {f"{node.module}.{a.name}" if node.module == "comera_compile" else node.module
                        for a in node.names}
        upward = [t for t in targets if t.split(".")[0] == "comera_compile"
                  and not any(t == a or t.startswith(a + ".") for a in allowed)]
        assert not upward, (name, upward)

def test_the_cce_floor_holds_no_op():
    """The fused loss's decisions (comera_compile.cce: cost model, tuning, observed kept fractions) sit on
    the devices floor: they import (at import time or inside functions) only devices and themselves,
    run no op and no Triton; the kernels import them, never the other way."""
    modules = _modules()
    allowed = ("comera_compile.cce", "comera_compile.devices")
    names = [m for m in modules if m == "comera_compile.cce" or m.startswith("comera_compile.cce.")]
    assert {"comera_compile.cce.planner", "comera_compile.cce.tuning", "comera_compile.cce.observed"} <= set(names)
    for name in names:
        deps, _ = _imports(modules[name], modules, inside_functions=True)
        upward = [d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed)]
        assert not upward, (name, upward)
        tree = ast.parse(modules[name].read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        used = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not [m for m in imported | used
                    if m.startswith(("torch.nn", "torch.library", "torch.ops", "torch._", "nn.", "triton"))], name


def test_nothing_in_the_package_imports_the_deprecated_cce_plan_path():
    """``kernels/linear_cross_entropy_plan.py`` is a shim for one release: no module of the package imports
    it (at import time or inside functions), so its DeprecationWarning reaches only outside callers."""
    modules = _modules()
    shim = "comera_compile.kernels.linear_cross_entropy_plan"
    users = [name for name, path in modules.items() if name != shim
             and shim in _imports(path, modules, inside_functions=True)[0]]
    assert not users, users


def test_old_paths_still_import():
    """The moved modules' old paths re-export the same objects for one release, and say so."""
    import sys

    import comera_compile as cc
    from comera_compile import tt

    for old in ("optim", "planner", "tt_runtime"):
        sys.modules.pop(f"comera_compile.{old}", None)
        with pytest.warns(DeprecationWarning, match=f"comera_compile.{old} is deprecated"):
            importlib.import_module(f"comera_compile.{old}")
    from comera_compile import optim, planner, tt_runtime
    from comera_compile.kernels import tt_runtime as runtime
    from comera_compile.tensorize import optim as new_optim
    from comera_compile.tt import planner as new_planner
    from comera_compile.tt import TTSpec, materialize, random_cores  # noqa: F401

    assert planner.plan_tt_linear is new_planner.plan_tt_linear is cc.plan_tt_linear
    assert planner.H200 is new_planner.H200 and planner.clear_plan_cache is new_planner.clear_plan_cache
    assert tt_runtime.group_outputs is runtime.group_outputs and optim.param_groups is new_optim.param_groups
    assert tt.TTSpec is cc.TTSpec and tt.cap_ranks and tt.TTSpec.from_cores
    tensorize = importlib.import_module("comera_compile.tensorize")
    for name in ("CompressionReport", "LayerReport", "SkippedLayer", "TTConfig", "TTLayer", "TTParametrization",
                 "TTSpec", "compression_report", "densify_", "iter_tt_layers", "require_unsharded",
                 "set_parameter_data_", "tensorize_", "tt_parametrization"):
        assert hasattr(tensorize, name), name
    assert importlib.import_module("comera_compile.backend").comera_backend


def test_the_cce_plan_path_re_exports_the_cce_package():
    """The fused loss's decisions moved from kernels/linear_cross_entropy_plan.py to comera_compile.cce:
    the old path re-exports the same objects (the state lives once, in the new modules) for
    one release, and says so on import."""
    import sys

    from comera_compile import cce
    from comera_compile.cce import observed, planner, tuning

    sys.modules.pop("comera_compile.kernels.linear_cross_entropy_plan", None)
    with pytest.warns(DeprecationWarning, match="linear_cross_entropy_plan is deprecated"):
        old = importlib.import_module("comera_compile.kernels.linear_cross_entropy_plan")
    for name in cce.__all__:
        assert getattr(old, name) is getattr(cce, name), name
    assert old.estimate_seconds is planner.estimate_seconds and old.cce_tuning is tuning.cce_tuning
    assert old.default_kept_fraction_store() is observed.default_kept_fraction_store()
    assert old.FORWARD_DX_PASS is planner.FORWARD_DX_PASS
    with pytest.warns(DeprecationWarning, match="H200 is deprecated"):
        assert old.H200 is planner.rates_for(True)
    with old.cce_tuning(probe_every=7):
        assert tuning.current_tuning().probe_every == 7
    from comera_compile.kernels import linear_cross_entropy as lce

    with pytest.warns(DeprecationWarning, match="comera_compile.cce"):
        assert lce.cce_tuning is cce.cce_tuning
    with pytest.warns(DeprecationWarning, match="comera_compile.cce"):
        assert lce.decide_fused_loss is cce.decide_fused_loss
