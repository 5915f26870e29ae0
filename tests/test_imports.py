"""The packages only look up the README's map: the "Layout of the code" list is read here, and every import of
every module under megalysses/ (imports inside functions included) points at its own line or a line above it;
every module is on the map, a line names one package or at most three modules, and no two modules import each
other, directly or round a longer circle. And no function under megalysses/ is over 80 lines."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "megalysses"


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


def code_map() -> list[list[str]]:
    """The README's list, line by line: the packages (`kernels`) or modules (`comm`) each line names."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    lines = []
    for line in section.splitlines():
        m = re.match(r" {4}megalysses/((?:[\w/.]+, )*[\w/.]+)(?:\s|$)", line)
        if m:
            lines.append([name.removesuffix("/").removesuffix(".py") for name in m.group(1).split(", ")])
    return lines


def line_of(module: str, lines: list[list[str]]) -> int | None:
    """The index of the map's line that holds `module` (its package, or itself at the top level)."""
    top = module.split(".")[1]
    return next((i for i, names in enumerate(lines) if top in names), None)


def test_the_map_names_every_module_once():
    lines = code_map()
    names = [n for line in lines for n in line]
    assert len(names) == len(set(names)), names
    for line in lines:       # one package, or at most three top-level modules
        packages = [n for n in line if (ROOT / n).is_dir()]
        assert (len(line) == 1 and packages) or (not packages and len(line) <= 3), line
        assert all((ROOT / n).is_dir() or (ROOT / f"{n}.py").is_file() for n in line), line
    unmapped = sorted(m for m in modules() if m != "megalysses" and line_of(m, lines) is None)
    assert not unmapped, f"modules the README's code map does not name: {unmapped}"


def violations(graph: dict[str, set[str]], lines: list[list[str]]) -> list[str]:
    """Every import that points below its own line of the map."""
    return [f"{m} (line {line_of(m, lines)}) imports {t} (line {line_of(t, lines)})"
            for m, targets in sorted(graph.items()) if m != "megalysses"
            for t in sorted(targets) if t != "megalysses" and line_of(t, lines) > line_of(m, lines)]


def test_imports_follow_the_map():
    graph = modules()
    assert not graph["megalysses"], "the package root imports nothing of its own"
    bad = violations(graph, code_map())
    assert not bad, bad


def test_the_check_sees_a_wrong_import():
    """A module reaching down the map is caught: the model importing the training loop, the config the data."""
    graph, lines = modules(), code_map()
    graph["megalysses.model.gpt"].add("megalysses.training.loop")
    graph["megalysses.config.checks"].add("megalysses.data.blend")
    data, model, loop = (line_of(f"megalysses.{m}", lines) for m in ("data.blend", "model.gpt", "training.loop"))
    assert violations(graph, lines) == [
        f"megalysses.config.checks (line 0) imports megalysses.data.blend (line {data})",
        f"megalysses.model.gpt (line {model}) imports megalysses.training.loop (line {loop})"]


def package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


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


def test_no_function_over_80_lines():
    """Functions stay short: none in megalysses/ over 80 lines (split by phase or by cost term)."""
    long = [f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(ROOT.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long


PLANNERS = {"resolve", "resolve_run", "plan_and_grid"}
"""The functions that resolve a config into a RunPlan (megalysses.plan.resolve, and megalysses.testing's two that
plan a test's run)."""


def plan_resolutions() -> set[str]:
    """Every `module:function` under megalysses/, megalysses/plan/ aside, that calls a planner it imported."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "plan":
            continue
        module, tree = ".".join(rel.with_suffix("").parts), ast.parse(path.read_text())
        planners = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module in ("megalysses.plan", "megalysses.testing") for a in node.names} & PLANNERS
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name not in PLANNERS and any(
                    isinstance(c, ast.Call) and getattr(c.func, "id", None) in planners for c in ast.walk(fn)):
                found.add(f"{module}:{fn.name}")
    return found


def test_the_plan_is_resolved_only_where_a_process_starts():
    """Outside megalysses/plan/ a config is resolved into its plan once, by what starts the process: the command
    lines (megalysses/tools/), and the dry run and the trace, which start their own process groups; everything
    else (training, evaluation, the builder) is handed the plan."""
    assert plan_resolutions() == {
        "tools.pretrain:_plan", "tools.eval_long:evaluate", "tools.generate:generation_plan",
        "tools.from_megatron:check_start", "training.dry_run:dry_run", "training.trace:trace_step"}
