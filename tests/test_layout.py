"""The package layout is a rule, not a habit: the import graph of `localspec` (function-level imports counted) has
no cycle, every import points down the layers, and each heavy third-party library stays in its own layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "localspec"

# rank of each part of the package; a module may import modules of its own rank or lower, never higher
LAYERS = [
    (0, ("localspec", "localspec.errors", "localspec.seq", "localspec.rpcwire", "localspec.defaults",
         "localspec.printable", "localspec.sample", "localspec.knobs")),  # leaves: no localspec imports but errors
    (1, ("localspec.llama",)),  # the only llama_cpp importer
    (2, ("localspec.drafters", "localspec.store")),  # drafters decode with sample/, on llama objects
    (3, ("localspec.models",)),
    (4, ("localspec.rpc",)),
    (5, ("localspec.core",)),  # the generation loop: drafters below it, never the other way
    (6, ("localspec.bench",)),
    (7, ("localspec.settings",)),
    (8, ("localspec.session",)),
    (9, ("localspec.cli", "localspec.tui", "localspec.server", "localspec.__main__")),
]
# third-party libraries that belong to one layer only
OWNERS = {
    "llama_cpp": ("localspec.llama.lib",),
    "typer": ("localspec.cli",),
    "click": ("localspec.cli",),
    "textual": ("localspec.tui",),
    "fastapi": ("localspec.server",),
    "starlette": ("localspec.server",),
    "uvicorn": ("localspec.server",),
    "rich": ("localspec.cli", "localspec.tui"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import anywhere in the file: localspec modules resolved to the module
    (not the attribute), other packages to their top-level name."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in known else mod, node.lineno))
    return out


def rank(mod: str) -> int:
    best, found = -1, None
    for r, prefixes in LAYERS:
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, found = len(p), r
    assert found is not None, f"{mod} is in no layer: add it to LAYERS"
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, m, known) for m, p in mods.items()}


def test_every_module_is_in_a_layer():
    for m in modules():
        rank(m)


def test_imports_point_down_the_layers():
    bad = []
    for mod, imps in graph().items():
        for imp, line in imps:
            if imp.startswith("localspec") and imp in modules() and rank(imp) > rank(mod):
                bad.append(f"{mod}:{line} imports {imp} (layer {rank(imp)} above {rank(mod)})")
    assert not bad, "\n".join(bad)


def test_third_party_libraries_stay_in_their_layer():
    bad = []
    for mod, imps in graph().items():
        for imp, line in imps:
            top = imp.split(".")[0]
            owners = OWNERS.get(top)
            if owners and not any(mod == o or mod.startswith(o + ".") for o in owners):
                bad.append(f"{mod}:{line} imports {imp} (only {', '.join(owners)} may)")
    assert not bad, "\n".join(bad)


def find_cycle(g: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in g.get(n, ()):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def local_graph() -> dict[str, list[str]]:
    g = graph()
    mods = set(g)
    # a package's __init__ re-exporting its submodules is not a cycle with them
    return {m: sorted({i for i, _ in imps if i in mods and i != m and not i.startswith(m + ".")}) for m, imps in g.items()}


def test_import_graph_has_no_cycle():
    assert find_cycle(local_graph()) is None, " -> ".join(find_cycle(local_graph()))


def test_the_cycle_check_sees_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


def package(mod: str) -> str:
    """The part of the package a module belongs to: localspec.core.engine -> localspec.core."""
    return ".".join(mod.split(".")[:2])


def package_graph(g: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    g = local_graph() if g is None else g
    out: dict[str, set[str]] = {}
    for m, imps in g.items():
        out.setdefault(package(m), set()).update(package(i) for i in imps if package(i) != package(m))
    return {p: sorted(v) for p, v in out.items()}


def package_problems(g: dict[str, list[str]]) -> list[str]:
    """What is wrong with a module graph at the level of packages: a cycle between packages, or an import up the
    layers."""
    pg = package_graph(g)
    bad = [f"{p} imports {q} (layer {rank(q)} above {rank(p)})" for p, qs in pg.items() for q in qs
           if rank(q) > rank(p)]
    cycle = find_cycle(pg)
    if cycle:
        bad.append("package cycle: " + " -> ".join(cycle))
    return bad


def test_the_packages_form_a_dag_down_the_layers():
    """Not only modules: a package that imports another may not be imported by it (core and drafters, llama and rpc,
    store and models were such pairs)."""
    assert package_problems(local_graph()) == []


def test_the_package_check_fails_on_a_planted_upward_import():
    g = {m: list(v) for m, v in local_graph().items()}
    g["localspec.drafters.base"].append("localspec.core.engine")  # a drafter reaching up into the core
    problems = package_problems(g)
    assert any("localspec.drafters imports localspec.core" in p for p in problems)
    assert any(p.startswith("package cycle:") for p in problems)


def test_the_leaves_import_nothing_of_localspec_but_errors():
    pg = package_graph()
    for leaf in ("localspec.sample", "localspec.rpcwire", "localspec.defaults", "localspec.printable", "localspec.knobs",
                 "localspec.seq"):
        assert set(pg.get(leaf, [])) <= {"localspec.errors"}, (leaf, pg.get(leaf))


def longest_path(g: dict[str, list[str]]) -> list[str]:
    memo: dict[str, list[str]] = {}

    def lp(n):
        if n not in memo:
            memo[n] = [n] + max((lp(m) for m in g.get(n, ())), key=len, default=[])
        return memo[n]

    return max((lp(n) for n in g), key=len)


def test_longest_import_path_is_reported(capsys):
    """Not a limit, a measurement (the layout note quotes it): printed with -s."""
    path = longest_path(local_graph())
    with capsys.disabled():
        print(f"\nlongest import path ({len(path)} modules): {' -> '.join(path)}")
    assert len(path) >= 3


@pytest.mark.parametrize("src,owner", [("import typer\n", "localspec.core.engine"),
                                       ("from localspec.cli import main\n", "localspec.core.engine")])
def test_the_layer_checks_catch_a_violation(tmp_path, src, owner):
    """A deliberately wrong import is caught by the same code the real checks use."""
    p = tmp_path / "engine.py"
    p.write_text(src)
    imps = imports_of(p, owner, set(modules()))
    top = imps[0][0]
    if top.startswith("localspec"):
        assert rank(top) > rank(owner)
    else:
        assert owner not in OWNERS[top.split(".")[0]]


def test_checking_settings_does_not_load_llama_cpp():
    """`localspec config set threads 4` validated the value through the llama layer and loaded llama.cpp to do it;
    the thread bound needs only the CPU count."""
    import subprocess
    import sys

    code = ("import sys; from localspec import session; session.validate({'threads': 2, 'ctx_size': 64});"
            "assert 'llama_cpp' not in sys.modules, 'llama_cpp was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_settings_load_no_model_code():
    """`localspec config` and every front end's flag parsing read the settings: they import neither numpy nor a
    drafter nor the engine."""
    import subprocess
    import sys

    code = ("import sys, localspec.settings, localspec.defaults; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy' or "
            "m.startswith(('localspec.drafters', 'localspec.core', 'localspec.llama'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def private_reaches(path: Path) -> list[str]:
    """`obj._name` where obj is not self or cls: a module reaching into another object's private fields."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno} .{node.attr}")
    return out


def test_drafters_use_the_models_public_interface():
    """Drafters run on llama objects through their public methods and handles, never their private fields."""
    bad = [r for p in sorted((PKG / "drafters").glob("*.py")) for r in private_reaches(p)]
    assert not bad, "\n".join(bad)


def test_the_scheduler_uses_the_engines_public_interface():
    """core/ reads, calls and writes another object's fields only through its public interface (the scheduler sets
    no `engine._field`, the engine none of a model's): a class's private state has one owner."""
    bad = [r for p in sorted((PKG / "core").glob("*.py")) for r in private_reaches(p)]
    assert not bad, "\n".join(bad)


def test_the_private_field_check_sees_a_write(tmp_path):
    p = tmp_path / "w.py"
    p.write_text("def f(engine, run):\n    engine._hooked = [run]\n    self._mine = 1\n")
    assert private_reaches(p) == ["w.py:2 ._hooked"]


def test_the_private_field_check_sees_one(tmp_path):
    p = tmp_path / "d.py"
    p.write_text("def f(target):\n    return target._ctx, self._ok\n")
    assert private_reaches(p) == ["d.py:2 ._ctx"]


def test_the_localspec_switches_are_read_in_one_place():
    """LOCALSPEC_* variables are read by knobs.py (diagnostic switches), settings/session (user settings), store/
    (where files live) and cli/ (the front end's own), never deep in core, llama or the server."""
    readers = ("localspec.knobs", "localspec.settings", "localspec.session", "localspec.store", "localspec.cli")
    bad = []
    for mod, path in modules().items():
        if mod.startswith(readers):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "LOCALSPEC_" in line and ("environ" in line or "getenv" in line):
                bad.append(f"{mod}:{i}")
    assert not bad, bad


def test_the_switches_are_typed_and_a_bad_value_is_one_error():
    from localspec.errors import UsageError
    from localspec.knobs import Knobs

    k = Knobs.read({"LOCALSPEC_RS_SEQ": "3", "LOCALSPEC_KV_UNIFIED": "0", "LOCALSPEC_BATCH_PAD": "1",
                    "LOCALSPEC_ALLOW_INEXACT": "0", "LOCALSPEC_DEBUG": "1"})
    assert (k.rs_seq, k.kv_unified, k.batch_pad, k.allow_inexact, k.debug) == (3, False, True, False, True)
    assert Knobs.read({}).kv_unified is None and Knobs.read({}).rs_seq is None
    for env in ({"LOCALSPEC_RS_SEQ": "many"}, {"LOCALSPEC_KV_TYPE": "f64"}, {"LOCALSPEC_ROLLBACK": "maybe"}):
        with pytest.raises(UsageError):
            Knobs.read(env)
