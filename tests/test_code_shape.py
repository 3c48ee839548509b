"""The package stays readable: no module in src/solosave over 450 lines, no function over 80
(the limits of the architecture issue; the demo job included)."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "solosave"


def _modules():
    return sorted(SRC.rglob("*.py"))


def test_no_module_over_450_lines():
    long = {str(p.relative_to(SRC)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_no_function_over_80_lines():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long[f"{p.relative_to(SRC)}:{node.name}"] = n
    assert not long, long
