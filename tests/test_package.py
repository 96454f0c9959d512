"""The package surface: flat public names, documented, cheap to import."""

import subprocess
import sys

import hpcpax


def test_import_loads_no_gpu_jit_or_mpi_library():
    code = ("import sys, hpcpax; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'cupy', 'numba', 'torch', 'matplotlib', 'mpi4py'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_documented():
    missing = [name for name in hpcpax.__all__ if not (getattr(hpcpax, name).__doc__ or "").strip()]
    assert not missing, missing


def test_every_public_function_method_and_property_has_a_docstring():
    """Outside private modules (``_name.py``), every public top-level function and
    class, and every public method and property of a public class, says what it does."""
    import ast
    from pathlib import Path

    root = Path(hpcpax.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        if path.name.startswith("_") and path.name not in ("__init__.py", "__main__.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name[0] == "_":
                continue
            members = [node] + [m for m in getattr(node, "body", [])
                                if isinstance(node, ast.ClassDef)
                                and isinstance(m, ast.FunctionDef) and m.name[0] != "_"]
            missing += [f"{path.relative_to(root)}:{m.lineno} {m.name}" for m in members
                        if not ast.get_docstring(m)]
    assert not missing, missing
