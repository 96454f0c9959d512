"""Count the suite's checks: ``assert`` statements and ``assert*`` calls in tests/ (ast).

Usage: ``python tests/count_asserts.py [FOLDER]``; a speed-up of the suite must not
lower either figure (issue 68).
"""

import ast
import pathlib
import sys


def count(root: pathlib.Path) -> tuple:
    """``(assert statements, assert* calls)`` in every ``*.py`` under ``root``."""
    statements = calls = 0
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                statements += 1
            elif isinstance(node, ast.Call):
                function = node.func
                name = function.attr if isinstance(function, ast.Attribute) \
                    else getattr(function, "id", "")
                if name.startswith("assert"):
                    calls += 1
    return statements, calls


if __name__ == "__main__":
    folder = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)
    statements, calls = count(folder)
    print(f"assert statements: {statements}, assert* calls: {calls}")
