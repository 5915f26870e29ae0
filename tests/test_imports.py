"""The packages only look up the README's map: the "Layout of the code" list is read here, and every import of
every module under megalysses/ (imports inside functions included) points at its own line or a line above it;
every module is on the map, a line names one package or at most three modules, and no two modules import each
other, directly or round a longer circle. And no function under megalysses/ is over 80 lines, takes more than 8
parameters or nests its control flow more than 4 deep."""
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
    """Functions stay short: none in megalysses/ over 80 lines (split by part of the step or by cost term)."""
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


MAX_PARAMETERS = 8
MAX_NESTING = 4
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)


def functions(tree: ast.AST) -> list[ast.FunctionDef]:
    """Every function and method of a module, nested ones included, in line order."""
    return sorted((node for node in ast.walk(tree) if isinstance(node, FUNCTIONS)), key=lambda fn: fn.lineno)


def parameter_count(fn: ast.FunctionDef) -> int:
    """The parameters a caller passes: self and cls left out, *args and **kwargs one each."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    own = 1 if a.posonlyargs + a.args and names[0] in ("self", "cls") else 0
    return len(names) - own + (a.vararg is not None) + (a.kwarg is not None)


def triton_kernel(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in fn.decorator_list)


def nesting(nodes: list[ast.AST], depth: int = 0) -> int:
    """The deepest control-flow nesting under `nodes` (if, for, while, with, try, match; an elif chain is one
    level; a nested function or class counts on its own)."""
    deepest = depth
    for node in nodes:
        if isinstance(node, FUNCTIONS + (ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If):
            chain = node.orelse if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) else []
            deepest = max(deepest, nesting(node.body, depth + 1), nesting(chain, depth),
                          nesting([] if chain else node.orelse, depth + 1))
        else:
            deepest = max(deepest, nesting(list(ast.iter_child_nodes(node)), depth + isinstance(node, BLOCKS)))
    return deepest


def signature_problems(path: Path, source: str) -> list[str]:
    """Every function of `source` over MAX_PARAMETERS parameters (Triton kernels aside) or
    nesting deeper than MAX_NESTING."""
    where = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
    found = []
    for fn in functions(ast.parse(source)):
        n = parameter_count(fn)
        if n > MAX_PARAMETERS and not triton_kernel(fn):
            found.append(f"{where}:{fn.lineno} {fn.name}: {n} parameters")
        depth = nesting(fn.body)
        if depth > MAX_NESTING:
            found.append(f"{where}:{fn.lineno} {fn.name}: nested {depth} deep")
    return found


def test_short_signatures_and_shallow_nesting():
    """No function in megalysses/ over 8 parameters (what travels together travels as one dataclass; @triton.jit
    kernels aside) or nesting control flow more than 4 deep."""
    bad = [p for path in sorted(ROOT.rglob("*.py")) for p in signature_problems(path, path.read_text())]
    assert not bad, bad


def test_the_signature_check_sees_long_lists_and_deep_nesting():
    source = """
class C:
    def method(self, a, b, c, d, e, f, g, h): ...
    def wide(self, a, b, c, d, e, f, g, *rest, **named): ...
    @staticmethod
    def forward(ctx, a, b, c, d, e, f, g, h): ...

@triton.jit
def kernel(a, b, c, d, e, f, g, h, i): ...

def chained(x):
    for a in x:
        while a:
            with a:
                if a == 1:
                    pass
                elif a == 2:
                    pass
                elif a == 3:
                    pass
                else:
                    pass

def deep(x):
    for a in x:
        while a:
            with a:
                try:
                    if a:
                        pass
                except ValueError:
                    pass

def outer(x):
    for a in x:
        def inner():
            for b in a:
                if b:
                    while b:
                        pass
"""
    assert signature_problems(Path("f.py"), source) == ["f.py:4 wide: 9 parameters", "f.py:6 forward: 9 parameters",
                                                        "f.py:24 deep: nested 5 deep"]
