"""The packages only look down: no module below the tools imports them, the kernels never import the model,
the plan imports neither model nor training, checkpoints do not import training, the evaluation's prompts and
reports import no model or grid; and no two modules import
each other, directly or round a longer circle (imports inside functions included)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megalysses"

# package -> packages (first component after megalysses.) it must never import
FORBIDDEN = {
    "kernels": {"model", "training", "tools", "plan", "memory", "checkpoint", "grid", "parallel"},
    "plan": {"model", "training", "tools", "checkpoint", "grid"},
    "memory": {"model", "training", "tools", "checkpoint", "grid"},
    "config": {"model", "training", "tools", "plan", "memory", "checkpoint", "parallel", "kernels", "grid"},
    "parallel": {"model", "training", "tools", "checkpoint"},
    "model": {"training", "tools", "checkpoint"},
    "data": {"model", "training", "tools", "plan", "checkpoint"},
    "checkpoint": {"training", "tools"},
    "evaluation": {"model", "training", "tools", "checkpoint", "grid", "parallel"},
    "training": {"tools"},
}


def modules() -> dict[str, set[str]]:
    """megalysses module -> the megalysses modules it imports anywhere in its file."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("megalysses",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megalysses"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("megalysses"))
        graph[name] = found
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def package(module: str) -> str:
    part = module.split(".")[1] if module.count(".") else ""
    return "config" if part.startswith("config") else part


def test_packages_only_look_down():
    bad = [f"{m} imports {t}" for m, targets in modules().items() for t in targets
           if package(t) in FORBIDDEN.get(package(m), set())]
    assert not bad, bad


def test_no_import_circles():
    graph = modules()
    # a package's __init__ importing its own modules is how a package exposes them, not a circle
    edges = {m: {t for t in ts if not (m.endswith(package(m)) and t.startswith(m + "."))} for m, ts in graph.items()}
    state, circles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, circles
