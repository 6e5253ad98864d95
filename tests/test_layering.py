"""Imports point down (README, "Layout"): each layer imports only the layers below it, and a target
never imports another target. Read from the source with ast, deferred imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stitchflow

ROOT = Path(stitchflow.__file__).parent

# what each part of the package may import from stitchflow (besides itself)
ALLOWED = {
    "ir": set(),
    "frontend": {"ir"},
    "planner": {"ir", "targets"},
    "targets": {"ir"},
    "replay": set(),
    "program": {"ir", "frontend", "planner", "targets", "replay"},
    "explore": {"ir", "frontend", "planner", "targets", "program", "replay"},
    "apps": {"ir", "frontend", "explore"},
}


def _part(module: str) -> str:
    """stitchflow.targets.gpu.codegen -> targets.gpu; stitchflow.planner.cost -> planner."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    return ".".join(parts[:2]) if parts[0] == "targets" and len(parts) >= 2 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The stitchflow modules `path` imports (relative imports resolved; `from . import x` as x)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "stitchflow"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "stitchflow":
                continue
            out |= {f"{mod}.{a.name}" for a in node.names} if not node.module else {mod}
    return out


def _sources(part: str) -> list[Path]:
    """A package's modules, or the one module of that name."""
    module = ROOT / f"{part.replace('.', '/')}.py"
    return [module] if module.exists() else sorted((ROOT / part.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below(part):
    bad = []
    assert _sources(part), f"no module or package {part}"
    for path in _sources(part):
        own = _part(_module_name(path))
        for mod in _imports(path):
            other = _part(mod)
            layer = other.split(".")[0]
            if other == own or layer == part or layer == "" or layer in ALLOWED[part]:
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_a_target_never_imports_another_target():
    bad = []
    for path in _sources("targets"):
        own = _part(_module_name(path))
        for mod in _imports(path):
            other = _part(mod)
            if other.startswith("targets.") and own.startswith("targets.") and other != own:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_nothing_below_the_command_line_imports_it_or_the_benchmarks():
    bad = [f"{path.relative_to(ROOT)} imports {mod}" for path in sorted(ROOT.rglob("*.py"))
           if _part(_module_name(path)) not in ("cli", "bench", "__main__")
           for mod in _imports(path) if _part(mod) in ("cli", "bench")]
    assert not bad, "\n".join(bad)
