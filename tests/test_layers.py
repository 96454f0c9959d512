"""The architecture, checked: layers import downwards only (the top package included), no cycles.

Layers (``docs/design/architecture.md``), lowest first: ``ops`` < ``comm`` < ``ps`` <
``sync`` < ``plan`` (pure planning) < ``runlog`` (the run log) < ``tune`` (what runs
collectives or live steps to decide) < ``engine`` (one job's machinery, one factory) <
``app`` < ``torch`` (the PyTorch adapter). ``data``
and ``models`` serve the application and import no layer above ``ops``;
``cluster`` (the emulated cluster, a tool) imports only the base. ``errors``,
``options``, ``backend`` and ``input_checks`` (the one validator of flags, configs and
plan files) are the base every layer may use. Every import
counts, lazy ones inside functions
included: a lazy import only hides a dependency, it does not remove it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hpcpax"
LAYERS = {"ops": 0, "comm": 1, "ps": 2, "sync": 3, "plan": 4, "runlog": 5, "tune": 6,
          "engine": 7, "app": 8, "torch": 9,
          "data": 1, "models": 1,
          "cluster": 0}  # the emulated cluster is a tool beside the library: base only
BASE = {"errors", "options", "backend", "input_checks"}
#: Planning maths (all of ``plan/``) and the run log's: pure, no MPI anywhere in them.
PURE_PLANNING = ["plan.cost_model", "plan.auto", "plan.plan", "plan.partition_search",
                 "plan.measure", "plan.sim", "plan.adaptive", "plan.collectives",
                 "plan.dense_period", "plan.hot_rows_cost", "plan.joint_choice",
                 "plan.kernel_rates", "plan.loss_guard", "plan.shares", "plan.step_model",
                 "plan.traffic", "runlog.learned", "runlog.log"]


#: What ``import hpcpax`` / ``from hpcpax import x`` reaches: the whole public API, on top.
TOP = "<hpcpax>"


def modules():
    """``{dotted name relative to hpcpax: path}`` of every module."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name, path):
    """Every hpcpax module ``name`` imports (relative to hpcpax), and its other imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "hpcpax":
                target = ""
            elif (node.module or "").startswith("hpcpax."):
                target = node.module[len("hpcpax."):]
            else:
                others.add((node.module or "").split(".")[0])
                continue
            for alias in node.names:  # "from . import x" names a module when x is one
                candidate = f"{target}.{alias.name}" if target else alias.name
                ours.add(candidate if candidate in ALL else (target or TOP))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "hpcpax":
                    ours.add(TOP)
                elif alias.name.startswith("hpcpax."):
                    ours.add(alias.name[len("hpcpax."):])
                else:
                    others.add(alias.name.split(".")[0])
    ours.discard("")
    return ours, others


ALL = modules()


def layer_of(name):
    if name == TOP:
        return 99
    top = name.split(".")[0]
    if top in BASE:
        return -1
    return LAYERS.get(top, 99)  # loose entry points (train, sim, ...) are on top


def test_every_import_goes_down_the_layers():
    wrong = []
    for name, path in ALL.items():
        mine = layer_of(name)
        if mine == 99:
            continue
        for target in imports_of(name, path)[0]:
            top = target.split(".")[0]
            if layer_of(target) > mine or (mine >= 0 and top in ("data", "models")
                                           and name.split(".")[0] not in ("app", top)):
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_comm_imports_no_higher_layer():
    for name, path in ALL.items():
        if name.startswith("comm"):
            bad = [t for t in imports_of(name, path)[0]
                   if t.split(".")[0] in ("ps", "sync", "plan", "runlog", "tune", "engine",
                                          "app", "data", "models")]
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", PURE_PLANNING)
def test_pure_planning_modules_import_no_mpi(name):
    assert "mpi4py" not in imports_of(name, ALL[name])[1]
    code = (f"import sys, hpcpax.{name}; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_no_import_cycles():
    graph = {name: {t for t in imports_of(name, path)[0] if t in ALL and t != name}
             for name, path in ALL.items()}
    # a package's __init__ may name its own modules; the cycle rule is for modules
    graph = {n: {t for t in ts if not n.startswith(t + ".") and not t.startswith(n + ".")}
             for n, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, cycles


def test_the_top_package_is_few_entry_points():
    """Cohesion, not size, shapes modules (no line caps); but the top level stays a
    handful of entry points and the base, not a place where modules pile up."""
    loose = [p.name for p in PACKAGE.glob("*.py")]
    assert len(loose) <= 10, loose


def test_imports_of_the_top_package_are_seen():
    """``import hpcpax`` from a layer counts as an import of the top (it is caught)."""
    import textwrap

    probe = PACKAGE.parent / "tests" / "_layers_probe.py"
    try:
        probe.write_text(textwrap.dedent("""
            import hpcpax
            from hpcpax import init
            from .. import errors
        """))
        ours, _ = imports_of("plan.probe", probe)
    finally:
        probe.unlink()
    assert TOP in ours and layer_of(TOP) > layer_of("plan.probe")


#: Entry points that are MPI programs themselves: the trainer's ``__main__`` and the
#: emulated cluster's link probe. Everything else reaches MPI through ``hpcpax.comm``.
MPI_ENTRY_POINTS = {"train", "cluster.probe"}


def test_only_comm_and_the_entry_points_import_mpi4py():
    """The transport seam: the layers above ``comm`` reduce, message and abort through
    it (``comm.reductions``, ``comm.messages``, ``comm.deathwatch``), never mpi4py."""
    wrong = sorted(name for name, path in ALL.items()
                   if "mpi4py" in imports_of(name, path)[1]
                   and name.split(".")[0] != "comm" and name not in MPI_ENTRY_POINTS)
    assert not wrong, wrong
