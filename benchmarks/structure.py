"""Structure figures of the source tree: the largest files, the longest functions, import circles.

    python3 benchmarks/structure.py [--root src] [--top 5] [--out benchmarks/results/structure.json]

Functions are measured from their `def` line to their last line (decorators excluded, nested
functions counted in their own right and inside their parent). Import circles are the strongly
connected components (more than one module) of the graph of draftrelay modules importing each other
at any level (module top or inside a function), since a lazy import is still a dependency.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, mod: str, is_pkg: bool, known: set[str]) -> set[str]:
    """draftrelay modules `mod` imports; `from pkg import name` counts as pkg.name when that is a module."""
    out: set[str] = set()
    base_parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(base_parts[:len(base_parts) - node.level + 1])
                src = f"{base}.{node.module}" if node.module else base
            else:
                src = node.module or ""
            subs = {f"{src}.{a.name}" for a in node.names} & known
            # `from pkg import mod` depends on pkg.mod; on pkg itself only for names that are not modules
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(src)
    return {m for m in out if m in known and m != mod}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def measure(root: Path, top: int) -> dict:
    files = sorted(root.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    names = {p: module_name(root, p) for p in files}
    known = set(names.values())
    graph = {names[p]: imports_of(t, names[p], p.name == "__init__.py", known) for p, t in trees.items()}
    funcs = []
    for p, t in trees.items():
        for node in ast.walk(t):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.lineno} {node.name}"))
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files), reverse=True)
    return {"largest_files": [{"file": f, "lines": n} for n, f in sizes[:top]],
            "longest_functions": [{"function": f, "lines": n} for n, f in sorted(funcs, reverse=True)[:top]],
            "import_circles": circles(graph), "modules": len(known)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="src")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = measure(Path(args.root), args.top)
    for row in res["largest_files"]:
        print(f"{row['lines']:6d}  {row['file']}")
    print()
    for row in res["longest_functions"]:
        print(f"{row['lines']:6d}  {row['function']}")
    print(f"\nimport circles: {len(res['import_circles'])}")
    for c in res["import_circles"]:
        print("  " + " <-> ".join(c))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
