"""The layering rule of ``src/solosave`` (docs/design.md, "How the code is laid out"), checked on the
imports themselves (parsed, every ``import`` anywhere in a module, ``TYPE_CHECKING`` ones too):

* a module of ``_src/<folder>/`` imports only from its own folder or from folders below it;
  folders on one level do not import each other; nothing in ``_src`` imports the public modules
  (``solosave/*.py``, ``demo``) or ``testing`` (test doubles, above the library);
* no ``_private`` name is imported across a folder;
* no import cycle between modules;
* soft size limits: no module over 800 lines, no function over 80.

The planted-violation tests copy the tree, plant one upward import or one cycle, and check that
the checker names it: a rule that cannot fail is no rule.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "solosave"

#: Each folder's level, lowest first. Two folders of one level may not import each other.
LEVELS = {
    "core": 0, "formats": 1, "storage": 2, "coordination": 3, "plan": 4, "index": 5, "prepared": 6,
    "staging": 7, "write": 7, "tiers": 8, "engine": 9, "load": 9, "worker": 10, "save": 11, "tools": 12,
    "testing": 13,
}
PUBLIC = 14  # solosave/*.py and solosave/demo: the public modules and the demo, above _src
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _folder(module: str) -> str | None:
    """``solosave._src.<folder>.x`` -> folder; ``None`` for public modules."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "_src":
        return parts[2]
    return None


def _level(module: str) -> int:
    f = _folder(module)
    if f is None:
        return -1 if module == "solosave._src" else PUBLIC
    return LEVELS.get(f, PUBLIC)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: pathlib.Path) -> dict[str, list[tuple[str, tuple[str, ...], int]]]:
    """Per module of the package at ``root``: ``(imported module, names, line)`` for every
    import of a solosave module (``from x import y`` counts as an import of ``x.y`` when
    ``x.y`` is a module)."""
    files = {_module_name(root, p): p for p in root.rglob("*.py")}
    out: dict[str, list[tuple[str, tuple[str, ...], int]]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(a.name, (), node.lineno) for a in node.names if a.name.split(".")[0] == "solosave"]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                if target.split(".")[0] != "solosave":
                    continue
                names = tuple(a.name for a in node.names)
                submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in files]
                if submodules:
                    found += [(s, (), node.lineno) for s in submodules]
                    names = tuple(n for n in names if f"{target}.{n}" not in files)
                if names or not submodules:
                    found.append((target, names, node.lineno))
        out[mod] = found
    return out


def violations(root: pathlib.Path = SRC) -> list[str]:
    """Every breach of the layering rule in the package at ``root`` (a list of sentences)."""
    found = []
    graph = imports_of(root)
    for mod, imports in graph.items():
        f, lvl = _folder(mod), _level(mod)
        if f is None:
            continue  # public modules may import anything of the package
        for target, names, line in imports:
            tf, tl = _folder(target), _level(target)
            where = f"{mod}:{line} imports {target}"
            if target == "solosave._src":
                continue
            if tf is None:
                found.append(f"{where}: _src never imports the public modules")
            elif tf != f and tl > lvl:
                found.append(f"{where}: {tf} is above {f}")
            elif tf != f and tl == lvl:
                found.append(f"{where}: {f} and {tf} are on one level and may not import each other")
            if tf != f:
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private or target.rsplit(".", 1)[-1].startswith("_") and target.count(".") > 2:
                    found.append(f"{where} ({', '.join(private) or 'a private module'}): "
                                 "private names stay in their folder")
    found += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return found


def _cycles(graph: dict[str, list[tuple[str, tuple[str, ...], int]]]) -> list[list[str]]:
    """Import cycles between modules (one per strongly connected component, Tarjan's)."""
    edges = {m: sorted({t for t, _, _ in imps if t in graph and t != m}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    # a package's __init__ importing its own modules is not a cycle worth naming
    return [c for c in out if not all(m == "solosave" or m.startswith("solosave.") and "_src" not in m for m in c)]


def test_layering_rule_holds():
    assert violations() == []


def test_every_folder_has_a_level():
    folders = {p.name for p in (SRC / "_src").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LEVELS)


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "solosave"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _plant(path: pathlib.Path, line: str) -> None:
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


@pytest.mark.parametrize(("module", "line", "expected"), [
    ("core/errors.py", "from solosave._src.engine.engine import Engine", "engine is above core"),
    ("tiers/durable.py", "from solosave._src.engine.rank_io import RankIO", "engine is above tiers"),
    ("write/writer.py", "from solosave._src.tiers.choice import complete_here", "tiers is above write"),
    ("load/load.py", "from solosave._src.save.checkpointer import AsyncCheckpointer", "save is above load"),
    ("worker/host.py", "from solosave._src.save.session import SaveSession", "save is above worker"),
    ("plan/layout.py", "if True:\n    from solosave._src.prepared.sections import SectionReader", "prepared is above plan"),
    ("engine/engine.py", "from solosave._src.load.load import load", "on one level"),
    ("storage/local.py", "import solosave.integrations", "never imports the public modules"),
    ("engine/engine.py", "from solosave._src.plan.local_plan import _is_dtensor", "private names stay in their folder"),
])
def test_a_planted_breach_is_named(tmp_path, module, line, expected):
    root = _copy(tmp_path)
    _plant(root / "_src" / module, line)
    found = violations(root)
    assert any(expected in v and module.replace("/", ".").removesuffix(".py") in v for v in found), found


def test_a_planted_cycle_is_named(tmp_path):
    root = _copy(tmp_path)
    # coordination/status.py is imported by coordination/protocol.py; importing it back closes a cycle in one folder
    _plant(root / "_src" / "coordination" / "status.py", "from solosave._src.coordination.protocol import Mode")
    found = violations(root)
    assert any(v.startswith("import cycle") and "solosave._src.coordination.status" in v
               and "solosave._src.coordination.protocol" in v for v in found), found


def test_modules_and_functions_stay_small():
    long = {}
    for p in SRC.rglob("*.py"):
        text = p.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            long[str(p.relative_to(SRC))] = n
        for node in ast.walk(ast.parse(text)):
            n = node.end_lineno - node.lineno + 1 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
            if n > MAX_FUNCTION_LINES:
                long[f"{p.relative_to(SRC)}:{node.name}"] = n
    assert not long, long
