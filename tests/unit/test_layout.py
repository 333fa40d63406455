"""The package's layout: no import circle between its modules, and every module, file and name
the README and docs point at exists (read with `ast`, nothing imported: milliseconds)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "vllm_smurfs"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__'s file)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports, at any depth of its code (lazy imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a.b import c`: module a.b, and a.b.c when c is a module.
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        out.update(name for name in names if name in modules and name != module)
    return out


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_the_package_has_no_import_circle() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # A package imports nothing of its own here, so its __init__ is no hub of false circles.
    assert all(not graph[m] for m in modules if modules[m].name == "__init__.py"
               and m != "vllm_smurfs.patches"), "a package __init__ imports a module"
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            pytest.fail("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def _doc_references() -> list[tuple[str, str]]:
    refs = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"from (vllm_smurfs[\w.]*) import ([\w, ]+)", text):
            refs += [(doc.name, f"{match.group(1)}:{name.strip()}")
                     for name in match.group(2).split(",") if name.strip()]
        refs += [(doc.name, m) for m in re.findall(r"(?<![\w/])vllm_smurfs(?:\.\w+)+", text)]
        refs += [(doc.name, m) for m in re.findall(r"vllm_smurfs/[\w/]+\.py", text)]
    return refs


def test_the_docs_know_the_layout() -> None:
    refs = _doc_references()
    assert len(refs) > 5  # the docs do point into the package
    modules = _modules()
    missing = []
    for doc, ref in refs:
        if ref.endswith(".py"):
            ok = (ROOT / ref).is_file()
        elif ":" in ref:  # from module import name
            module, name = ref.split(":")
            ok = module in modules and (name in _top_level_names(modules[module])
                                        or f"{module}.{name}" in modules)
        elif ref in modules:  # a module
            ok = True
        else:  # a module's name
            module, _, name = ref.rpartition(".")
            ok = module in modules and name in _top_level_names(modules[module])
        if not ok:
            missing.append(f"{doc}: {ref}")
    assert not missing, "the docs point at what does not exist: " + ", ".join(missing)
