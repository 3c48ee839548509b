"""Each of the design's invariants is written once in ``src/``; these tests find any second copy.

* publishing: only ``write/publish.py`` commits, stages or removes ``.metadata`` or the load index
  (``commit_checkpoint``, ``begin_publication``, ``unpublish``); everything else calls those;
* agreeing: only ``coordination/`` encodes, reduces and decodes a status, flag or set-up word
  (``Channel.agree``, ``agree_flags``, ``agree_ok``, ``agree_setup``).

Checked on the parsed source (every call anywhere in a module). The planted tests copy a line
that breaks each rule into a module and check that the checker names it: a rule that cannot fail
is no rule.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "solosave"
PUBLISH_MODULE = "_src/write/publish.py"
#: Names that carry a checkpoint's published files.
PUBLISHED_NAMES = {"METADATA_FILE", "INDEX_FILE"}
#: Calls that write or remove a file.
FILE_CALLS = {"commit", "begin_commit", "remove", "write_bytes", "unlink"}
#: The status word's own functions, and the raw 8-byte reduction.
WORD_CALLS = {"encode_status", "decode_status", "encode_flags", "decode_flags", "encode_setup", "decode_setup",
              "all_reduce_and"}


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def breaches(root: pathlib.Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            args = set().union(*(_names_in(a) for a in [*node.args, *(k.value for k in node.keywords)])) \
                if node.args or node.keywords else set()
            if name in FILE_CALLS and args & PUBLISHED_NAMES and rel != PUBLISH_MODULE:
                found.append(f"{rel}:{node.lineno}: {name}() of {sorted(args & PUBLISHED_NAMES)[0]} outside "
                             "write/publish.py (use commit_checkpoint / begin_publication / unpublish)")
            if name in WORD_CALLS and not rel.startswith("_src/coordination/") and not rel.startswith("_src/testing/"):
                found.append(f"{rel}:{node.lineno}: {name}() outside coordination/ (use Channel.agree and its kin)")
    return found


def test_each_invariant_is_written_once():
    assert breaches() == []


def _plant(tmp_path: pathlib.Path, module: str, line: str) -> list[str]:
    import shutil
    root = tmp_path / "solosave"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / module
    path.write_text(path.read_text() + "\n\n" + line + "\n")
    return breaches(root)


def test_a_second_publication_is_named(tmp_path):
    found = _plant(tmp_path, "_src/tiers/durable.py",
                   "def _again(st, d, md):\n    st.commit(st.join(d, METADATA_FILE), md)")
    assert any(f.startswith("_src/tiers/durable.py") and "commit() of METADATA_FILE" in f for f in found), found


def test_a_second_stale_metadata_removal_is_named(tmp_path):
    found = _plant(tmp_path, "_src/engine/rank_io.py", "def _gone(st, d):\n    st.remove(st.join(d, METADATA_FILE))")
    assert any(f.startswith("_src/engine/rank_io.py") and "remove()" in f for f in found), found


def test_a_second_status_word_is_named(tmp_path):
    found = _plant(tmp_path, "_src/load/load.py",
                   "def _word(ch, s, i):\n    return decode_status(ch.all_reduce_and(encode_status(s, i)), i)")
    assert sum(f.startswith("_src/load/load.py") for f in found) == 3, found
