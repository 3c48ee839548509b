"""Every public docstring opens with a one-line summary, then a blank line (what ``help()`` shows).

The public objects are the names of each public module's ``__all__`` (or, without one, its public
names defined in solosave) that are classes or functions, and each class's public methods and
properties defined in its body that carry a docstring. A docstring of more than one line must
have a blank second line: a summary that runs on into a second line is reported, and so is a
public class or function without a docstring.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import ModuleType
from typing import Any

import pytest

MODULES = ("solosave", "solosave.integrations", "solosave.cli")
#: Importable only with their framework installed.
OPTIONAL_MODULES = ("solosave.lightning", "solosave.titan", "solosave.megatron")


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _own_doc(obj: Any) -> str | None:
    """The docstring written for ``obj`` itself (not inherited, not a dataclass's generated one)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc:
        return None
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None  # the signature dataclasses writes when the class has no docstring
    return doc


def summary_problems(obj_list: list[Any]) -> list[str]:
    """One line per object of ``obj_list`` whose docstring is missing or runs its summary on.

    A docstring of more than one line must have a blank second line."""
    problems = []
    for obj in obj_list:
        doc = _own_doc(obj)
        if doc is None:
            problems.append(f"{_name(obj)}: no docstring")
            continue
        lines = inspect.cleandoc(doc).splitlines()
        if len(lines) > 1 and lines[1].strip():
            problems.append(f"{_name(obj)}: summary runs on: {lines[0][:60]!r}")
    return problems


def _members(cls: type) -> list[Any]:
    """The functions of ``cls``'s public methods and properties defined in its body, with a docstring."""
    out = []
    for name, attr in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        f = attr.fget if isinstance(attr, property) else attr
        if isinstance(f, (staticmethod, classmethod)):
            f = f.__func__
        if inspect.isfunction(f) and f.__doc__:
            out.append(f)
    return out


def public_objects(module: ModuleType) -> list[Any]:
    """The classes and functions ``module`` makes public, then the documented members of each class."""
    names = getattr(module, "__all__", None)
    own = names is None
    if own:
        names = [n for n in dir(module) if not n.startswith("_")]
    out: list[Any] = []
    for name in names:
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if own and not getattr(obj, "__module__", "").startswith("solosave"):
            continue  # an import (argparse, typing ...), not the module's own
        out.append(obj)
        if inspect.isclass(obj):
            out.extend(_members(obj))
    return out


def _unique(objs: list[Any]) -> list[Any]:
    seen: set[int] = set()
    return [o for o in objs if not (id(o) in seen or seen.add(id(o)))]


@pytest.mark.parametrize("module_name", MODULES + OPTIONAL_MODULES)
def test_public_docstrings_open_with_a_one_line_summary(module_name):
    if module_name in OPTIONAL_MODULES:
        module = pytest.importorskip(module_name)
    else:
        module = importlib.import_module(module_name)
    objs = _unique(public_objects(module))
    assert objs, f"{module_name}: no public classes or functions found"
    problems = summary_problems(objs)
    assert not problems, f"{len(problems)} docstring(s) without a one-line summary:\n" + "\n".join(problems)


def _runs_on():
    """This summary does not end on its first line
    but runs on into the second one."""


def _summarised():
    """This summary is one line.

    The rest follows a blank line."""


def _one_line():
    """Only a summary."""


def _undocumented():
    pass


class _Planted:
    """A class whose summary
    runs on as well."""


def test_checker_reports_a_summary_that_runs_on():
    problems = summary_problems([_runs_on, _summarised, _one_line, _undocumented, _Planted])
    assert len(problems) == 3, problems
    assert any("_runs_on: summary runs on" in p for p in problems), problems
    assert any("_Planted: summary runs on" in p for p in problems), problems
    assert any("_undocumented: no docstring" in p for p in problems), problems
    assert not any("_summarised" in p or "_one_line" in p for p in problems), problems
