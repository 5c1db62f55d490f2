"""The package's import graph: no circles, and layers that import only downwards.

The layers are read from dev/design.md (the picture under "## Layers": one line per
layer, top first; a line starting with a space continues the description above it, or,
when the names above end with a comma, those names: a layer of many small modules, such
as the mirrors of multiprocessing's submodules, would not fit one line), so the picture
and the code cannot drift apart. Every ``import`` and ``from ... import`` in
every module of the package counts, at module level and inside functions alike (those
under ``if TYPE_CHECKING:`` too: they name the layer a module depends on).

The benchmark (``bench/``, at the checkout's root) is a tool of the repository, above the
package: it imports gpushare, and no module of the package imports it (it is not in the wheel).

Also the test suite's own rule: a helper is defined once, in conftest.py,
in workers.py (worker targets several files start) or in the one test file
that uses it, never copied into a second test file.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpushare"
TESTS = ROOT / "tests"
DESIGN = ROOT / "dev" / "design.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def doc_layers() -> list[list[str]]:
    """The layers of dev/design.md's picture, top first, as module or package names."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1]
    block = section.split("```", 2)[1]
    layers: list[list[str]] = []
    continued = False  # the names above ended with a comma: this line goes on with them
    for line in block.splitlines()[1:]:
        if not line.strip() or (line[0].isspace() and not continued):
            continue
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names = []
        for token in (t.strip() for t in column.split(",") if t.strip()):
            token = token.removeprefix("gpushare/")
            if token == "__init__.py":
                names.append("gpushare")
            elif token.endswith("/"):
                names.append("gpushare." + token[:-1])
            elif token.endswith(".py"):
                names.append("gpushare." + token[:-3])
            else:
                raise AssertionError(f"dev/design.md layer line names {token!r}: write module.py or package/")
        if continued:
            layers[-1].extend(names)
        else:
            layers.append(names)
        continued = column.endswith(",")
    return layers


def unit_of(name: str, layer_of: dict[str, int]) -> str | None:
    """The layer entry a module belongs to: itself, or the package it is in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in layer_of:
            return candidate
    return None


def test_docs_name_every_module_in_one_layer() -> None:
    layers = doc_layers()
    assert len(layers) >= 5, layers
    listed = [name for layer in layers for name in layer]
    assert len(listed) == len(set(listed)), f"a module is in two layers of dev/design.md: {listed}"
    mods = modules()
    for name in listed:
        assert name in mods, f"dev/design.md's layer picture names {name}, which is not a module of the package"
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer}
    missing = sorted(m for m in mods if unit_of(m, layer_of) is None)
    assert not missing, f"modules in no layer of dev/design.md's picture (add them to a line): {missing}"


def test_no_import_goes_up_a_layer() -> None:
    layers = doc_layers()
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer}
    upward = []
    for name, targets in graph().items():
        here = unit_of(name, layer_of)
        for target in targets:
            there = unit_of(target, layer_of)
            if here is None or there is None:
                continue  # reported by test_docs_name_every_module_in_one_layer
            if layer_of[there] < layer_of[here]:
                upward.append(
                    f"{name} imports {target} (layer {layer_of[there] + 1} is above layer {layer_of[here] + 1})"
                )
    assert not upward, "imports that go up dev/design.md's layers:\n" + "\n".join(sorted(upward))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("edges", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], has_cycle: bool) -> None:
    assert (find_cycle(edges) is not None) is has_cycle


def test_function_level_imports_count(tmp_path: Path) -> None:
    source = "def f():\n    from . import _b\n    import gpushare._c\n"
    path = tmp_path / "m.py"
    path.write_text(source, encoding="utf-8")
    known = {"gpushare._a", "gpushare._b", "gpushare._c"}
    assert imports_of("gpushare._a", path, known) == {"gpushare._b", "gpushare._c"}


def test_no_module_of_the_package_imports_the_benchmark() -> None:
    """``bench`` lives in the checkout, not in the wheel: an import of it from the package
    would work in the checkout and fail for every user."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module or ""]
            else:
                continue
            found += [f"{name} imports {t} (line {node.lineno})" for t in targets if t.split(".")[0] == "bench"]
    assert not found, "the package imports the benchmark, which is not in the wheel:\n" + "\n".join(found)


# -- the test suite: one home per helper ---------------------------------------------------


def helpers_of(path: Path) -> dict[str, bool]:
    """The module-level functions of ``path`` other than tests and pytest hooks, each with
    whether it is a fixture."""
    found = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith(("test_", "pytest_")):
            marks = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            found[node.name] = "pytest.fixture" in marks
    return found


def test_no_helper_is_defined_in_two_test_files() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    fixture: dict[tuple[str, str], bool] = {}
    for path in [*sorted(TESTS.glob("test_*.py")), TESTS / "conftest.py", TESTS / "workers.py"]:
        for name, is_fixture in helpers_of(path).items():
            where[name].append(path.name)
            fixture[path.name, name] = is_fixture
    copies = {
        name: files
        for name, files in where.items()
        if len(files) > 1
        # one test file overriding a conftest fixture (test_ray.py's manager) is pytest's design, not a copy
        and not (len(files) == 2 and "conftest.py" in files and all(fixture[f, name] for f in files))
    }
    assert copies == {}, f"defined in more than one file (keep one, in conftest.py if shared): {copies}"


def test_no_two_modules_share_a_name() -> None:
    """A newcomer tells modules apart by their file names: each is used once in the package
    (a package's ``__init__.py`` and ``__main__.py`` aside)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "gpushare").rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
