"""Every module path that the docs, the README and the code's own text name exists.

A path such as ``write/publish.py`` or ``tests/unit/test_layering.py``, or a dotted module such
as ``solosave._src.write.publish``, outlives the code it points to when a file moves; this test
finds the stale ones. A ``.py`` path is looked up under the repository root, ``src``, ``tests``, ``src/solosave``
and ``src/solosave/_src`` (the docs name modules relative to those); a dotted ``solosave.``
name must import as a module or name an attribute of one."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASES = (ROOT, ROOT / "src", ROOT / "tests", ROOT / "src" / "solosave", ROOT / "src" / "solosave" / "_src")
PY_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[A-Za-z_]\w*\.py)\b")
DOTTED = re.compile(r"(?<![\w.])(solosave(?:\._?[a-z]\w*)+)")
#: Paths in other projects' trees, named on purpose (the code they point to is not ours).
FOREIGN = re.compile(r"^(torch|torchtitan|megatron|lightning|pytorch_lightning|nvidia_resiliency_ext|"
                     r"examples|site-packages|checkpoint|distributed|tools/checkpoint|a|b)/|^core/")


def _texts() -> list[Path]:
    docs = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    code = [*(ROOT / "src").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
            *(ROOT / "tests").rglob("*.py"), ROOT / "Makefile", ROOT / ".ci" / "run"]
    return [p for p in docs + code if p.is_file()]


def missing_paths(text: str) -> list[str]:
    """The ``.py`` paths in ``text`` that exist under none of :data:`BASES`."""
    out = []
    for m in PY_PATH.finditer(text):
        path = m.group(1)
        if FOREIGN.match(path) or any((base / path).exists() for base in BASES):
            continue
        out.append(path)
    return out


def missing_modules(text: str) -> list[str]:
    """The dotted ``solosave.`` names in ``text`` that are neither a module nor an attribute of one."""
    out = []
    for m in DOTTED.finditer(text):
        name = m.group(1).rstrip(".")
        if not _resolves(name):
            out.append(name)
    return out


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as e:
            missing = getattr(e, "name", None) or ""
            if missing and not missing.startswith("solosave") and importlib.util.find_spec(".".join(parts[:cut])):
                return True  # a module of an optional extra whose package is not installed here
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("path", _texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(path):
    text = path.read_text(encoding="utf-8", errors="replace")
    if path == Path(__file__).resolve():
        text = text.split("# -- planted", 1)[0]
    stale = missing_paths(text) + missing_modules(text)
    assert not stale, f"{path.relative_to(ROOT)} names what does not exist: {sorted(set(stale))}"


# -- planted: the checks find a stale name ------------------------------------------------------

def test_a_moved_module_is_found():
    assert missing_paths("see save/durable.py and write/publish.py") == ["save/durable.py"]
    assert missing_modules("solosave._src.save.durable or solosave._src.write.publish.commit_checkpoint") == [
        "solosave._src.save.durable"]
