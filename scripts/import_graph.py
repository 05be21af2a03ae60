"""The package-level import graph of ``workers/`` and its cycles.

    python scripts/import_graph.py            # summary, cycles, every cross-package edge
    python scripts/import_graph.py --module   # module-level imports only (no function bodies)

Nodes are the subpackages of ``workers/`` (``actor``, ``critic``, ``rollout``, ...) and its
top-level modules (``sft``, ``batch``, ...). ``A -> B`` when a module of ``A`` imports a module
of ``B``, counting imports inside functions too (a lazy import is still a dependency), unless
``--module``. Read with :mod:`ast`; nothing is imported. A cycle is a strongly connected
component of more than one node; each mutual pair is listed with the imports that make it.
Module cycles inside one subpackage are listed as well.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "workers"
PKG = "m2flow.workers"


def modules(root: Path) -> dict[str, Path]:
    """Dotted name under ``workers`` (``""`` for its ``__init__``) -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(name: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known) -> set[str]:
    """The ``workers`` modules an import statement of module ``name`` names."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = [PKG, *name.split(".")] if name else [PKG]
            base = base if is_pkg else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join([*base, *([node.module] if node.module else [])])
        else:
            mod = node.module or ""
        targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
    out = set()
    for t in targets:
        if not t.startswith(PKG + "."):
            continue
        t = t[len(PKG) + 1 :]
        while t and t not in known:  # a name from a module, not a module
            t = t.rpartition(".")[0]
        if t and t != name:
            out.add(t)
    return out


def edges(root: Path, module_level_only: bool) -> dict[tuple[str, str], str]:
    """``(importer, imported) -> "mod"|"fn"`` over the modules of ``workers``."""
    known = modules(root)
    out: dict[tuple[str, str], str] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        in_fn = {
            id(s)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for s in ast.walk(f)
        }
        for s in ast.walk(tree):
            if not isinstance(s, ast.Import | ast.ImportFrom):
                continue
            kind = "fn" if id(s) in in_fn else "mod"
            if module_level_only and kind == "fn":
                continue
            for t in imported(name, path.name == "__init__.py", s, known):
                if out.get((name, t)) != "mod":
                    out[(name, t)] = kind
    return out


def package(module: str) -> str:
    return module.split(".")[0]


def main(argv: list[str]) -> int:
    mod_edges = edges(ROOT, "--module" in argv)
    links: dict[tuple[str, str], list[str]] = {}
    for (a, b), kind in sorted(mod_edges.items()):
        pa, pb = package(a), package(b)
        if a and pa != pb:
            links.setdefault((pa, pb), []).append(f"{a} -> {b} ({kind})")
    g = nx.DiGraph(list(links))
    g.add_nodes_from(package(m) for m in modules(ROOT) if m)
    sccs = sorted((sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1), key=len)
    pairs = sorted((a, b) for a, b in links if a < b and (b, a) in links)
    print(f"packages {g.number_of_nodes()}, edges {g.number_of_edges()}, "
          f"module imports across packages {sum(map(len, links.values()))}, "
          f"cycles (SCCs) {len(sccs)}, simple cycles {sum(1 for _ in nx.simple_cycles(g))}, "
          f"mutual pairs {len(pairs)}")  # fmt: skip
    for c in sccs:
        print("cycle:", " ".join(c))
    for a, b in pairs:
        print(f"mutual: {a} <-> {b}")
        for line in links[(a, b)] + links[(b, a)]:
            print("    " + line)
    inner = nx.DiGraph(
        (a, b) for a, b in mod_edges if a and package(a) == package(b) and b != package(a)
    )
    for c in nx.simple_cycles(inner):
        print("module cycle:", " -> ".join([*c, c[0]]))
    print("edges:")
    for (a, b), lines in sorted(links.items()):
        kinds = "/".join(sorted({line.rsplit("(", 1)[1][:-1] for line in lines}))
        print(f"    {a} -> {b}: {len(lines)} ({kinds})")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
