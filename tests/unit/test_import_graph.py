"""The import graph of src/pagedllm: no cycles, and the layering rules of docs/architecture.md.

Every module is parsed with `ast`; every `import` / `from ... import` counts, at module level or inside a function
(a function-local import is still a dependency, only a later one). An edge goes to the module named: `from a.b
import c` is an edge to `a.b.c` when that is a module, else to `a.b`. Importing `a.b.c` also runs `a/__init__.py`
and `a/b/__init__.py`, but those implicit edges are left out (a package's `__init__` is not one of its modules'
pieces). Imports through `importlib` (the quantization registry) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "pagedllm"

# kernels/ are leaves: besides other kernels/ modules they may import only these pagedllm modules (the environment
# switches; nothing that reaches back into layers, models or quantization).
KERNEL_ALLOWED = {"pagedllm.envs"}
# core/ is pure Python and sits below everything that runs a model.
CORE_FORBIDDEN_PACKAGES = ("worker", "models", "layers", "kernels", "entrypoints", "attention", "quantization")
# The CPU decode stack plugs into models from outside (`LlamaModel.fast_path`): only the loader attaches it.
CPU_DECODE = "pagedllm.models.cpu_decode"
CPU_DECODE_IMPORTERS = {"pagedllm.models.loader"}


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(src: Path = SRC) -> dict[str, Path]:
    return {_module_name(src, p): p for p in sorted((src / ROOT).rglob("*.py"))}


class Import:
    def __init__(self, target: str, line: int, local: bool):
        self.target, self.line, self.local = target, line, local

    def __repr__(self):
        return f"Import({self.target!r}, line {self.line}{', local' if self.local else ''})"


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """(node, inside a function) for every node."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, local = stack.pop()
        yield node, local
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in one module: pagedllm ones resolved to a module, others kept as their top-level name."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]

    def resolve(dotted: str) -> str:
        # The longest prefix that is one of our modules ("pagedllm.x.y.Attr" -> "pagedllm.x.y").
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    found: list[Import] = []
    nodes = sorted(_walk(ast.parse(path.read_text(), str(path))), key=lambda n: getattr(n[0], "lineno", 0))
    for node, local in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name) if alias.name.split(".")[0] == ROOT else alias.name
                found.append(Import(target, node.lineno, local))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != ROOT:
                found.append(Import(base, node.lineno, local))
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in modules else resolve(base), node.lineno, local))
    return found


def _graph(src: Path = SRC) -> tuple[dict[str, Path], dict[str, list[Import]]]:
    modules = _modules(src)
    return modules, {name: _imports(name, path, modules) for name, path in modules.items()}


def _internal_edges(graph: dict[str, list[Import]]) -> dict[str, dict[str, Import]]:
    edges: dict[str, dict[str, Import]] = {}
    for name, imports in graph.items():
        out = edges.setdefault(name, {})
        for imp in imports:
            if imp.target in graph and imp.target != name:
                out.setdefault(imp.target, imp)
    return edges


def _components(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _find_cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One shortest cycle through the first module of each component."""
    return [_cycle_in(c, edges) for c in _components(edges)]


def _cycle_in(component: list[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    parent: dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges[node]):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if child in members and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle found in component {component}")


def _describe(cycle: list[str], edges: dict[str, dict[str, Import]]) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        imp = edges[a][b]
        hops.append(f"{a} -> {b} (line {imp.line}{', in a function' if imp.local else ''})")
    return "\n    ".join(hops)


def _in(name: str, package: str) -> bool:
    full = f"{ROOT}.{package}"
    return name == full or name.startswith(full + ".")


def test_checker_sees_local_and_relative_imports(tmp_path):
    """The parser counts function-local and relative imports, resolves `from pkg import submodule`, and the
    cycle finder reports the circle they make."""
    pkg = tmp_path / ROOT / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / ROOT / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from pagedllm.sub.a import f\nimport torch.nn\n")
    (pkg / "c.py").write_text("from pagedllm.sub import a\n")
    _, graph = _graph(tmp_path)
    assert [(i.target, i.local) for i in graph["pagedllm.sub.a"]] == [("pagedllm.sub.b", True)]
    assert [(i.target, i.local) for i in graph["pagedllm.sub.b"]] == [("pagedllm.sub.a", False), ("torch.nn", False)]
    assert [i.target for i in graph["pagedllm.sub.c"]] == ["pagedllm.sub.a"]
    edges = _internal_edges(graph)
    assert _find_cycles(edges) == [["pagedllm.sub.a", "pagedllm.sub.b", "pagedllm.sub.a"]]


def test_no_import_cycles():
    _, graph = _graph()
    edges = _internal_edges(graph)
    report = [
        f"  modules in one circle: {', '.join(component)}\n  e.g. {' -> '.join(cycle)}\n    {_describe(cycle, edges)}"
        for component, cycle in zip(_components(edges), _find_cycles(edges))
    ]
    assert not report, "import cycles:\n" + "\n".join(report)


def _violations(rule, graph: dict[str, list[Import]]) -> list[str]:
    bad = []
    for name, imports in sorted(graph.items()):
        for imp in imports:
            why = rule(name, imp.target)
            if why:
                where = "in a function" if imp.local else "module level"
                bad.append(f"{name} imports {imp.target} (line {imp.line}, {where}): {why}")
    return bad


def core_rule(name: str, target: str) -> Optional[str]:
    if not _in(name, "core"):
        return None
    if target.split(".")[0] == "torch":
        return "core/ never imports torch"
    for package in CORE_FORBIDDEN_PACKAGES:
        if _in(target, package):
            return f"core/ never imports {package}/"
    return None


def kernels_rule(name: str, target: str) -> Optional[str]:
    if not _in(name, "kernels") or target.split(".")[0] != ROOT:
        return None
    if _in(target, "kernels") or target in KERNEL_ALLOWED:
        return None
    return f"kernels/ imports only kernels/ and {sorted(KERNEL_ALLOWED)}"


def layers_rule(name: str, target: str) -> Optional[str]:
    if _in(name, "layers") and _in(target, "models"):
        return "layers/ never imports models/"
    return None


def cpu_decode_rule(name: str, target: str) -> Optional[str]:
    if target == CPU_DECODE and name not in CPU_DECODE_IMPORTERS:
        return f"only {sorted(CPU_DECODE_IMPORTERS)} attach the CPU decode stack; models never reach for it"
    return None


RULES = {"core": core_rule, "kernels": kernels_rule, "layers": layers_rule, "cpu_decode": cpu_decode_rule}


def test_rules_flag_what_they_forbid(tmp_path):
    """Each rule reports a breach planted in a fake tree (module level and in a function), and nothing else."""
    root = tmp_path / ROOT
    files = {
        "__init__.py": "",
        "envs.py": "",
        "core/__init__.py": "",
        "core/sched.py": "import torch\ndef f():\n    from pagedllm.worker import runner\n",
        "kernels/__init__.py": "",
        "kernels/k.py": "from pagedllm import envs\nfrom pagedllm.kernels import k2\ndef f():\n"
                        "    from pagedllm.quantization import q\n",
        "kernels/k2.py": "",
        "layers/__init__.py": "",
        "layers/lin.py": "from pagedllm.models.llama import X\n",
        "models/__init__.py": "",
        "models/llama.py": "from pagedllm.models import cpu_decode\n",
        "models/cpu_decode.py": "",
        "models/loader.py": "from pagedllm.models import cpu_decode\n",
        "quantization/__init__.py": "",
        "quantization/q.py": "from pagedllm.kernels import k\n",
        "worker/__init__.py": "",
        "worker/runner.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _, graph = _graph(tmp_path)
    found = {key: _violations(rule, graph) for key, rule in RULES.items()}
    assert [b.split(" (")[0] for b in found["core"]] == ["pagedllm.core.sched imports torch",
                                                       "pagedllm.core.sched imports pagedllm.worker.runner"]
    assert "in a function" in found["core"][1]
    assert [b.split(" (")[0] for b in found["kernels"]] == ["pagedllm.kernels.k imports pagedllm.quantization.q"]
    assert [b.split(" (")[0] for b in found["layers"]] == ["pagedllm.layers.lin imports pagedllm.models.llama"]
    assert [b.split(" (")[0] for b in found["cpu_decode"]] == [
        "pagedllm.models.llama imports pagedllm.models.cpu_decode"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layering(rule):
    """core/ is pure Python below the model stack; kernels/ are leaves; layers/ never import models/; the CPU decode
    stack is attached from outside the model (docs/architecture.md, "Layering")."""
    _, graph = _graph()
    assert not (bad := _violations(RULES[rule], graph)), "\n".join(bad)


@pytest.mark.parametrize("package", ["core", "kernels", "layers", "models", "quantization", "entrypoints"])
def test_every_package_is_seen(package):
    """The rules above cannot pass by finding nothing: every package has modules and imports."""
    modules, graph = _graph()
    names = [n for n in modules if _in(n, package)]
    assert len(names) >= 3
    assert sum(len(graph[n]) for n in names) >= 10
