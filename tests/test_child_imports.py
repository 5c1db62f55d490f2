"""What a spawned child loads of gpushare to receive one buffer, and how modules find each other.

A child that takes one buffer off a gpushare Queue loads the facade, the queue, the
Buffer and its wire form, the lifetime service's consumer side and the buffer's backend:
never the owner side (Owner, its pool, lease table, unmapper, request loop, records; the
Manager and its server), and, for host memory, never the CUDA layer. The child reports
``sys.modules`` itself, so the figures are those of a fresh process.

Modules are wired by imports, not found in ``sys.modules``: only the facade's lazy
attribute loader (``gpushare.__getattr__``) turns a name into a module at run time.

This file imports nothing of gpushare at module level beyond the facade: a spawned child
imports it to find its target, and what it imports would count as the child's.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

import gpushare as mp

PACKAGE = Path(__file__).resolve().parent.parent / "gpushare"

#: The owner side: a process that only receives buffers loads none of it.
OWNER_SIDE = {
    "gpushare._lifetime._owner",
    "gpushare._lifetime._request_loop",
    "gpushare._lifetime._unmapper",
    "gpushare._lifetime._records",
    "gpushare._manager_server",
    "gpushare._manager",
}
#: The most gpushare Python modules a fresh child loads to get and read one host buffer
#: (_native, which loads the compiled core, and how its get() spins, _spin, among them).
HOST_LIMIT = 17
#: The compiled modules, counted apart from HOST_LIMIT and CUDA_LIMIT: a child with the compiled
#: core loads it (the region's and the handoff's calls in one module) and, with CUDA, the queries'.
COMPILED = {"gpushare._core", "gpushare._cuda._cqueries"}
#: Everything a fresh child loads of gpushare to get and read one host buffer, compiled or not.
HOST_TOTAL_LIMIT = HOST_LIMIT + 1
#: The same with a CUDA buffer: the host figure, less the host backend, plus the CUDA layer (its
#: package, the five modules the package imports, and _queries, which loads with the driver) and
#: the CUDA backend with its shared base. The ready events (_lifetime._ready) are not among them:
#: they load only in a process that shares a CUDA buffer, and this child only receives one.
CUDA_LIMIT = HOST_LIMIT - 1 + 7 + 2


def _loaded_after_get(jobs, out) -> None:
    """The child: get one buffer, read it, report the gpushare modules loaded."""
    buf = jobs.get(timeout=60)
    total = float(buf.numpy().sum())  # a view of host memory, a host copy of device memory
    loaded = sorted(m for m in sys.modules if m == "gpushare" or m.startswith("gpushare."))
    buf.release()
    out.put((total, loaded))


def child_modules(device: int | str, reap: list) -> list[str]:
    """The gpushare modules a fresh spawned child has loaded after its first ``get`` of a
    buffer on ``device`` (filled with ones), read."""
    saved = os.environ.get("GPUSHARE_BACKEND")
    if device == "cpu":
        os.environ["GPUSHARE_BACKEND"] = "host"  # the child inherits it at start()
    try:
        with mp.Manager() as manager:
            buf = manager.full((4,), 1.0, dtype="float32", device=device)
            jobs, out = mp.Queue(), mp.Queue()
            proc = mp.Process(target=_loaded_after_get, args=(jobs, out))
            proc.start()
            reap.append(proc)
            jobs.put(buf)
            total, loaded = out.get(timeout=60)
            proc.join(timeout=30)
    finally:
        if saved is None:
            os.environ.pop("GPUSHARE_BACKEND", None)
        else:
            os.environ["GPUSHARE_BACKEND"] = saved
    assert total == 4.0
    return loaded


def test_a_child_getting_a_host_buffer_loads_no_cuda_and_no_owner_side(reap) -> None:
    loaded = child_modules("cpu", reap)
    print(len(loaded), loaded)
    assert not [m for m in loaded if m == "gpushare._cuda" or m.startswith("gpushare._cuda.")], loaded
    assert not OWNER_SIDE & set(loaded), sorted(OWNER_SIDE & set(loaded))
    python = [m for m in loaded if m not in COMPILED]
    assert len(python) <= HOST_LIMIT, f"{len(python)} gpushare Python modules in the child: {loaded}"
    assert len(loaded) <= HOST_TOTAL_LIMIT, f"{len(loaded)} gpushare modules in the child: {loaded}"


@pytest.mark.gpu
def test_a_child_getting_a_cuda_buffer_loads_no_owner_side(reap) -> None:
    loaded = child_modules(0, reap)
    print(len(loaded), loaded)
    assert not OWNER_SIDE & set(loaded), sorted(OWNER_SIDE & set(loaded))
    python = [m for m in loaded if m not in COMPILED]
    assert len(python) <= CUDA_LIMIT, f"{len(python)} gpushare Python modules in the child: {loaded}"


# -- no module is found through sys.modules ---------------------------------------------------


def _names_gpushare(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.split(".")[0] == "gpushare"
        for n in ast.walk(node)
    )


def _is_sys_modules(node: ast.AST) -> bool:
    return ast.unparse(node) == "sys.modules"


def sys_modules_lookups(source: str) -> list[tuple[int, str]]:
    """Each use of ``sys.modules`` in ``source`` whose expression names a gpushare module
    (``sys.modules.get("gpushare...")``, ``"gpushare..." in sys.modules``,
    ``sys.modules["gpushare..."]``), as (line, code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value):
            target: ast.AST = node
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
            target = node.slice
        elif isinstance(node, ast.Compare) and any(_is_sys_modules(c) for c in node.comparators):
            target = node.left
        else:
            continue
        if node is not target and isinstance(node, ast.Call):
            target = ast.Tuple(elts=list(node.args), ctx=ast.Load())
        if _names_gpushare(target):
            found.append((node.lineno, ast.unparse(node)))
    return found


#: gpushare.dummy's ``sys.modules.setdefault(f"{__name__}.connection", connection)`` is a
#: registration, not a lookup (it puts multiprocessing.dummy.connection where ``import
#: gpushare.dummy.connection`` finds it: gpushare.dummy is a module, not a package), and the
#: check does not count it.


def test_no_gpushare_module_is_found_through_sys_modules() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        if rel == "gpushare/__init__.py":
            continue  # the facade's lazy loader imports by name; it does not read sys.modules
        for line, code in sys_modules_lookups(path.read_text(encoding="utf-8")):
            found.append(f"{rel}:{line}: {code}")
    assert not found, "gpushare modules found through sys.modules (import them instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "hits"),
    [
        ('sys.modules.get("gpushare._cuda")', 1),
        ('"gpushare._buffer" in sys.modules', 1),
        ('sys.modules["gpushare._lifetime"]', 1),
        ('sys.modules.get("torch")', 0),
        ('"concurrent.futures.process" in sys.modules', 0),
        ('sys.modules.get("__main__")', 0),
    ],
)
def test_the_sys_modules_check_finds_lookups(source: str, hits: int) -> None:
    assert len(sys_modules_lookups(source)) == hits


def test_the_queue_pickle_names_rebuild_buffer() -> None:
    from gpushare import _buffer

    assert _buffer.REBUILD == (_buffer.__name__, _buffer.rebuild_buffer.__name__)
