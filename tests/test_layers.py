"""The core imports only downwards (DESIGN.md's layer table) and never imports by name at run time.

Read from the source with ``ast``, so imports inside functions count too: a lazy import of a
layer above is the same cycle, only hidden.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# DESIGN.md's layer table, bottom up: a module may import its own layer and the layers below.
LAYERS = [
    ("native", ["_native", "_records", "errors", "threads", "threadkeys", "sizes", "profiles",
                "heap", "copyengine"]),
    ("devices", ["devices"]),
    ("manager", ["registry", "poison", "telemetry", "lineage", "manager"]),
    ("policy lab", ["trace", "torchtrace", "costmodel", "replay", "triggers", "stepprofile",
                    "batching"]),
    ("policies", ["policies"]),
    ("array", ["layout", "pinning", "viewattrs", "array", "wrapping", "scopes", "ufuncs",
               "dispatch", "creation", "routines", "defaults"]),
    ("annotations", ["annotations"]),
    ("package", [""]),                    # cachedarrays/__init__.py: the public names
    ("integrations", ["dask"]),           # chunk types of other libraries (optional extras)
    ("models", ["models"]),
]
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
MODELS = RANK["models"]
ABOVE_EVERYTHING = ("benchmarks", "tests")     # top-level folders nothing installed imports


def _core_files():
    """(module name, path) of every core module: cachedarrays/**.py and policies/**.py."""
    out = []
    for folder, package in ((ROOT / "cachedarrays", ["cachedarrays"]),
                            (ROOT / "policies", ["cachedarrays", "policies"])):
        for p in sorted(folder.rglob("*.py")):
            parts = list(p.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append((".".join(package + parts), p))
    return out


CORE = _core_files()


def _submodule_exists(module):
    """True if module (e.g. cachedarrays.heap, cachedarrays.policies.lru) is a file or package."""
    parts = module.split(".")[1:]
    if parts and parts[0] in ("policies", "models"):
        base, parts = ROOT / parts[0], parts[1:]
    else:
        base = ROOT / "cachedarrays"
    path = base.joinpath(*parts)
    return (path.with_suffix(".py").exists() or (path / "__init__.py").exists()
            or any(path.parent.glob(f"{path.name}.*so")))


def _imports(module, path):
    """Absolute names of everything path imports (at any depth), submodules resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            # "from X import y" imports X.y when y is a module of X, else a name from X
            for a in node.names:
                sub = f"{name}.{a.name}"
                out.append((sub if name.startswith("cachedarrays") and _submodule_exists(sub)
                            else name, node.lineno))
    return out


def _rank(module):
    """Layer rank of a cachedarrays module (None for third-party and standard modules)."""
    if module != "cachedarrays" and not module.startswith("cachedarrays."):
        return None
    parts = module.split(".")
    return RANK.get(parts[1] if len(parts) > 1 else "")


@pytest.mark.parametrize("module, path", CORE, ids=[m for m, _ in CORE])
def test_core_modules_import_only_their_layer_and_below(module, path):
    own = _rank(module)
    for name, line in _imports(module, path):
        where = f"{path.relative_to(ROOT)}:{line} imports {name}"
        assert name.split(".")[0] not in ABOVE_EVERYTHING, where
        rank = _rank(name)
        if rank is None:
            continue
        assert rank < MODELS, f"{where}: the core never imports the models"
        if own is not None:
            assert rank <= own, (f"{where}, a layer above ({LAYERS[rank][0]} over "
                                 f"{LAYERS[own][0]}); see the layer table in DESIGN.md")
        else:
            assert name != "cachedarrays", f"{where}: only the package's __init__ imports it"


def test_every_core_module_has_a_layer():
    missing = [str(p.relative_to(ROOT)) for m, p in CORE if _rank(m) is None]
    assert not missing, (f"{missing}: add each to LAYERS in tests/test_layers.py, in its layer "
                         "of DESIGN.md's table")


@pytest.mark.parametrize("module, path", CORE, ids=[m for m, _ in CORE])
def test_core_modules_never_import_by_name_at_run_time(module, path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else
                node.attr if isinstance(node, ast.Attribute) else None)
        assert name not in ("import_module", "__import__"), (
            f"{path.relative_to(ROOT)}:{node.lineno} uses {name}: import explicitly, downwards")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert "importlib" not in names, (
                f"{path.relative_to(ROOT)}:{node.lineno} imports importlib")


def test_core_imports_form_no_cycle():
    graph = {m: {n for n, _ in _imports(m, p) if _rank(n) is not None and n != m}
             for m, p in CORE}
    # a module imports its package first, so the package's own imports do not count as edges
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n in graph and n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_the_demo_lives_above_the_core():
    assert not (ROOT / "cachedarrays" / "demo.py").exists()
    assert (ROOT / "models" / "demo.py").exists()
    assert "-m cachedarrays.models.demo" in (ROOT / "Makefile").read_text()


def test_importing_the_package_loads_no_jit_compiler():
    """numba takes seconds to import; the kernels that need it load it on first use (a dask
    worker, a script or a test that never runs them does not pay for it)."""
    import subprocess
    import sys
    code = ("import sys, cachedarrays, cachedarrays.policies; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
