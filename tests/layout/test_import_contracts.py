"""Import contracts: the package layout says which way dependencies run, and this
checks it from the source (every import statement, in functions and TYPE_CHECKING
blocks too), so a wrong import fails `make test` rather than a review.

- operator: handlers -> rollout / tuning -> resource / kube; rollout never imports
  tuning, resource and kube import neither; the pure modules never reach (directly or
  through other operator modules) an I/O module or an I/O library; no cycles;
- engine and operator share no code (docs/contracts.md holds what they share);
- the test bed package has no cycles;
- no package `__init__` re-exports names (import from the defining module).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "slimspec_operator": REPO / "operator" / "slimspec_operator",
    "slimspec": REPO / "engine" / "slimspec",
    "slimspec_testbed": REPO / "scripts" / "testbed" / "slimspec_testbed",
}
OP = "slimspec_operator"

# Decisions and builders: plain data in, plain data out.
PURE = (
    "contract",
    "resource.spec",
    "resource.spec_pod",
    "kube.conditions",
    "kube.ownership",
    "rollout.plan",
    "rollout.manifests",
    "rollout.pod_settings",
    "rollout.model_volumes",
    "rollout.model_prep",
    "rollout.status",
    "rollout.reasons",
    "tuning.types",
    "tuning.reasons",
    "tuning.guards",
    "tuning.ratio_choice",
    "tuning.trials",
    "tuning.verdict",
    "tuning.predictions",
    "tuning.status",
    "tuning.plan",
    "tuning.autoscaler",
    "tuning.keda",
    "tuning.prometheus.queries",
    "tuning.prometheus.errors",
)
# The operator's modules that talk to the API server, Prometheus or Kopf.
IO_MODULES = (
    "kube.client",
    "rollout.observe",
    "rollout.reconcile",
    "rollout.handlers",
    "tuning.tick",
    "tuning.handlers",
    "tuning.prometheus.client",
    "tuning.prometheus.auth",
    "tuning.prometheus.shared",
    "main",
    "metrics",
)
IO_LIBRARIES = (
    "kopf",
    "kubernetes",
    "httpx",
    "requests",
    "urllib3",
    "aiohttp",
    "prometheus_client",
    "socket",
    "subprocess",
    "urllib.request",
)

Graph = dict[str, set[str]]


def module_name(root: str, path: Path) -> str:
    rel = path.relative_to(ROOTS[root]).with_suffix("")
    parts = [root, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(source: str, module: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """Every module `source` imports; `from pkg import mod` counts as pkg.mod when
    that is a module of ours."""
    known = set(known)
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return out


def build_graph(roots: Mapping[str, Path]) -> Graph:
    files = {
        module_name(root, path): path
        for root, folder in roots.items()
        for path in folder.rglob("*.py")
    }
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", files)
        for name, path in files.items()
    }


def _reaches(module: str, target: str) -> bool:
    return module == target or module.startswith(target + ".")


def path_to(graph: Graph, start: str, targets: Iterable[str], within: str) -> list[str] | None:
    """The shortest import chain from `start` to a module under one of `targets`,
    following imports between modules under `within`; None when there is none."""
    targets = tuple(targets)
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for nxt in sorted(graph.get(here, ())):
            if nxt in parent:
                continue
            parent[nxt] = here
            if any(_reaches(nxt, t) for t in targets):
                chain = [nxt]
                while (prev := parent[chain[-1]]) is not None:
                    chain.append(prev)
                return chain[::-1]
            if _reaches(nxt, within) and nxt in graph:
                queue.append(nxt)
    return None


def cycles(graph: Graph, within: str) -> list[list[str]]:
    """One cycle per strongly connected group of modules under `within` (Tarjan)."""
    nodes = sorted(n for n in graph if _reaches(n, within))
    edges = {n: sorted(m for m in graph[n] if m in graph and _reaches(m, within)) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        on_stack.add(n)
        for m in edges[n]:
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in on_stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            group = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                group.append(m)
                if m == n:
                    break
            if len(group) > 1 or n in edges[n]:
                found.append(sorted(group))

    for n in nodes:
        if n not in index:
            visit(n)
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOTS)


def _chain(chain: list[str]) -> str:
    return " -> ".join(chain)


def test_the_listed_modules_exist(graph: Graph) -> None:
    """A rename must update the contracts, not empty them."""
    missing = [m for m in (*PURE, *IO_MODULES) if f"{OP}.{m}" not in graph]
    assert missing == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("rollout", ("tuning",)),
        ("resource", ("rollout", "tuning", "kube")),
        ("kube", ("rollout", "tuning")),
    ],
)
def test_operator_layers(graph: Graph, layer: str, forbidden: tuple[str, ...]) -> None:
    targets = [f"{OP}.{f}" for f in forbidden]
    bad = [
        _chain(chain)
        for m in sorted(graph)
        if _reaches(m, f"{OP}.{layer}")
        and (chain := path_to(graph, m, targets, within=OP)) is not None
    ]
    assert bad == []


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_reach_no_io(graph: Graph, module: str) -> None:
    targets = [f"{OP}.{m}" for m in IO_MODULES] + list(IO_LIBRARIES)
    chain = path_to(graph, f"{OP}.{module}", targets, within=OP)
    assert chain is None, _chain(chain)


@pytest.mark.parametrize(
    ("package", "other"),
    [
        ("slimspec", "slimspec_operator"),
        ("slimspec", "slimspec_testbed"),
        ("slimspec_operator", "slimspec"),
        ("slimspec_operator", "slimspec_testbed"),
    ],
)
def test_packages_share_no_code(graph: Graph, package: str, other: str) -> None:
    bad = [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        if _reaches(m, package)
        for t in sorted(targets)
        if _reaches(t, other)
    ]
    assert bad == []


@pytest.mark.parametrize("package", ["slimspec_testbed", "slimspec_operator"])
def test_no_import_cycles(graph: Graph, package: str) -> None:
    assert cycles(graph, package) == []


@pytest.mark.parametrize("package", ["slimspec_operator", "slimspec_testbed"])
def test_no_reexporting_init(package: str) -> None:
    """A package's __init__ is a docstring: callers import from the defining module."""
    bad = []
    for init in sorted(ROOTS[package].rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        body = [n for n in tree.body if not isinstance(n, ast.Expr)]
        if body:
            bad.append(str(init.relative_to(REPO)))
    assert bad == []


# ------------------------------------------------------------------ the checker itself


def test_checker_finds_a_chain_and_a_cycle() -> None:
    """The helpers on a made-up graph: a transitive path and a cycle are found."""
    g: Graph = {
        "p.a": {"p.b"},
        "p.b": {"p.c", "os"},
        "p.c": {"httpx", "p.a"},
    }
    assert path_to(g, "p.a", ["httpx"], within="p") == ["p.a", "p.b", "p.c", "httpx"]
    assert path_to(g, "p.a", ["kopf"], within="p") is None
    assert cycles(g, "p") == [["p.a", "p.b", "p.c"]]


def test_relative_imports_resolve() -> None:
    src = "from . import x\nfrom .y import z\nfrom ..w import v\n"
    found = imports_of(src, "p.q.mod", False, {"p.q.x"})
    assert found == {"p.q", "p.q.x", "p.q.y", "p.w"}
