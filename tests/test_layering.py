"""Imports run one way: every module of the package imports only modules of its own layer or
the layers below it, `ops` never imports `engine`, `engine` never imports `graphs`, the runtime
(`engine`, `ops`, `graphs`) never imports the benchmarks (`bench`) or the training and
checkpoint-writing scripts (`tools`), and no two modules import each other, however indirectly.
Imports under `TYPE_CHECKING` and inside functions count like any other."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ops", "engine", "graphs", "bench", "tools")
# Lowest first. A module belongs to the entry with the longest matching prefix.
LAYERS = [
    ("ops",),
    ("engine.config", "engine.cpu_mesh", "engine.dist", "engine.kv_cache", "engine.prefix_cache",
     "engine.media",
     "engine.page_table", "engine.memory", "engine.heap",
     "engine.chat",
     "engine.tool_declaration",
     "engine.tokenizer", "engine.grammar",
     "engine.toolcalls", "engine.held_out"),
    ("engine.weights", "engine.models"),
    ("engine.attention",),
    ("engine.spec",),
    ("engine.cpu",),
    ("engine.policy", "engine.runner"),
    ("engine.request", "engine.scheduler"),
    ("engine.leader",),
    ("engine.llm",),
    ("engine", "engine.serve", "engine.generate", "graphs", "bench", "tools"),
]
FORBIDDEN = [("ops", "engine"), ("engine", "graphs"),
             ("engine", "bench"), ("engine", "tools"), ("ops", "bench"), ("ops", "tools"),
             ("graphs", "bench"), ("graphs", "tools")]


def modules(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def layer(mod: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{mod} has no layer: add it to LAYERS"
    return rank


def within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if layer(d) > layer(m):
                bad.append(f"{m} imports {d}, a layer above it")
            bad += [f"{m} imports {d}: {a} never imports {b}" for a, b in FORBIDDEN
                    if within(m, a) and within(d, b)]
    return bad


def test_imports_follow_the_layers():
    bad = violations(import_graph())
    assert not bad, "\n".join(bad)


def test_the_runtime_imports_no_benchmark_and_no_tool(tmp_path):
    """The checker fails a runtime module that imports `bench` or `tools`, even from inside a
    function, though all of them sit in the top layer."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "bench" / "common.py").write_text("def round_order(): pass\n")
    (tmp_path / "tools" / "corpus.py").write_text("def held_out_prompts(): pass\n")
    (tmp_path / "graphs" / "profile.py").write_text(
        "from bench.common import round_order\n"
        "def f():\n    from tools.corpus import held_out_prompts\n")
    (tmp_path / "engine" / "generate.py").write_text("import tools.corpus\n")
    (tmp_path / "ops" / "quant.py").write_text("from bench import common\n")
    (tmp_path / "tools" / "make_tiny.py").write_text("import engine.generate\nimport ops.quant\n"
                                                     "from bench.common import round_order\n")
    assert violations(import_graph(tmp_path)) == [
        "engine.generate imports tools.corpus: engine never imports tools",
        "graphs.profile imports bench.common: graphs never imports bench",
        "graphs.profile imports tools.corpus: graphs never imports tools",
        "ops.quant imports bench.common, a layer above it",
        "ops.quant imports bench.common: ops never imports bench",
    ]


def test_no_import_cycles():
    graph = import_graph()
    # Tarjan's strongly connected components: any with two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checker_sees_type_checking_and_local_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import engine.llm\n"
                 "def f():\n    from engine import spec\n    from engine.runner import X\n")
    assert imports(f, {"engine.llm", "engine.spec", "engine.runner", "engine"}) == {
        "engine.llm", "engine.spec", "engine.runner"}
