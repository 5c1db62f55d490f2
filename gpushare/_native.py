"""gpushare's compiled modules, loaded if installed: the core (``gpushare._core``: the Queue
region's put and get, ``Ring`` in ``_region.c``, and a buffer's handoff at both ends of a Queue,
``Arrivals`` and ``Shares`` in ``_handoff.c``) and the driver's per-handoff queries
(``_cuda/_queries.c``, ``gpushare._cuda._cqueries``, loaded only with CUDA).

- Built with the package (setup.py: ``pip install .``, ``make``, the wheels), never at run
  time. Where they were not built (no C compiler or Python headers at install time, not
  Linux) gpushare runs the same protocol in Python; the first use warns once per process
  (:class:`CompiledCoreWarning`) and ``gpushare info`` says which path is in use and why.
- The region is used only where the Python path's lock is the robust pthread mutex (Linux)
  on x86-64, which the C code shares; anywhere else, or with ``GPUSHARE_QUEUE_NATIVE=0``
  (every user of a queue may differ: both paths follow one protocol), :func:`region_ops` is
  None and the Queue runs its Python path alone. Its C calls take the plain case only.
  Whatever else (a busy lock, a payload to spill) they hand back untouched (PYTHON), and
  the Python path takes it.
- The handoff (:func:`handoff_module`) is used on Linux wherever it is installed: a Manager's
  buffer put on a Queue, and a Queue message naming an allocation this process maps, each in
  one call, from what the Python path left (``gpushare._buffer``); anything else, and
  everywhere it is missing, or with ``GPUSHARE_HANDOFF_NATIVE=0``, takes the Python path.
- The queries (:func:`queries_type`) are used on Linux wherever they are installed;
  elsewhere the driver's queries go through ctypes (``_cuda._queries``).
- ``GPUSHARE_NATIVE=0`` turns all of them off (no warning: that is asked for).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading
import warnings

from ._errors import CompiledCoreWarning

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "EMPTY",
    "PYTHON",
    "CompiledCoreWarning",
    "core_paths",
    "handoff_module",
    "handoff_why_not",
    "queries_type",
    "region_ops",
    "why_not",
]

EMPTY, PYTHON = -1, -2  # the region's answers besides a put's own (Region.try_put's) and a message

#: Why the Queue's C calls are not in use in this process (None while they are, or before the first try).
why_not: str | None = None


_warned = False


def _warn_missing(module: str, exc: BaseException) -> None:
    """Once per process: the compiled core is missing, what that costs and how to get it."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"gpushare: its compiled core is not installed ({module}: {exc}), so the Queue and the buffer "
        "handoff run their Python path, several times slower. Install gpushare where a C compiler and "
        "Python's headers are present (pip builds it), or use a wheel; GPUSHARE_NATIVE=0 chooses the "
        "Python path without this warning. `python -m gpushare info` shows which path is in use",
        CompiledCoreWarning,
        stacklevel=4,
    )


class _Extension:
    """One compiled module, imported once per process: the module, or None (``why_not`` says why)."""

    def __init__(self, module: str, what: str) -> None:
        self.module = module
        self.what = what  # for messages: "core", "driver queries"
        self.value: Any = None
        self.tried = False
        self.why_not: str | None = None
        self.lock = threading.Lock()

    def load(self) -> Any:
        if self.tried:
            return self.value
        with self.lock:
            if self.tried:
                return self.value
            missing = None
            try:
                self.value = importlib.import_module(self.module)
            except ImportError as exc:
                self.why_not = f"{self.module} (the compiled {self.what}) is not installed: {exc}"
                missing = exc
            self.tried = True
        if missing is not None:
            _warn_missing(self.module, missing)
        return self.value


_core = _Extension("gpushare._core", "core")
_queries = _Extension("gpushare._cuda._cqueries", "driver queries")


def _off() -> bool:
    return os.environ.get("GPUSHARE_NATIVE", "1") == "0"


def core_paths() -> list[tuple[str, str | None]]:
    """``gpushare info``'s lines: each use of a compiled module (what, and the module), and None
    where it loads and is used here, else why not (set off by the environment, not built, not
    this platform)."""
    out: list[tuple[str, str | None]] = []
    uses = (
        ("Queue region", _core, "GPUSHARE_QUEUE_NATIVE"),
        ("buffer handoff", _core, "GPUSHARE_HANDOFF_NATIVE"),
        ("driver queries", _queries, None),
    )
    for what, ext, switch in uses:
        why: str | None = None
        for name in ("GPUSHARE_NATIVE", switch):
            if name and os.environ.get(name, "1") == "0":
                why = f"{name}=0: the Python path is chosen"
                break
        if why is None and not sys.platform.startswith("linux"):
            why = "built on Linux only"
        elif why is None and what == "Queue region" and os.uname().machine.lower() not in ("x86_64", "amd64"):
            why = "used on x86-64 only (its lock must be the Python path's)"
        if why is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CompiledCoreWarning)
                if ext.load() is None:
                    why = ext.why_not
        out.append((f"{what} ({ext.module})", why))
    return out


def region_ops(
    start: Any, cap: int, spill_over: int, header: int, words: tuple[int, int, int, int, int],
    copies: tuple[tuple[int, int], tuple[int, int]], locks: tuple[int, int],
) -> Any:  # fmt: skip
    """The C calls for a region whose mapping begins at ``start`` (a ctypes object exported
    from the mapping, kept so that the mapping outlives the calls; offsets as ``_queues``
    lays the region out): an object whose ``put(payload, kind, task, maxsize)``
    answers as ``Region.try_put`` does or PYTHON, and whose ``get()`` answers ``(kind,
    payload)``, EMPTY or PYTHON. None where they cannot be used."""
    global why_not
    for name in ("GPUSHARE_NATIVE", "GPUSHARE_QUEUE_NATIVE"):
        if os.environ.get(name, "1") == "0":
            why_not = f"{name}=0"
            return None
    if not sys.platform.startswith("linux") or os.uname().machine.lower() not in ("x86_64", "amd64"):
        why_not = "the C region is built for Linux on x86-64 only"
        return None
    core = _core.load()
    if core is None:
        why_not = _core.why_not
        return None
    (p0, p1), (c0, c1) = copies
    return core.Ring(start, ctypes.addressof(start), cap, spill_over, header, *words, p0, p1, c0, c1, *locks)


def handoff_module() -> Any:
    """The compiled core (its ``Shares`` and ``Arrivals``, from ``_handoff.c``: see
    ``gpushare._buffer``), or None where it cannot be built or loaded, off Linux, or with
    ``GPUSHARE_NATIVE=0`` or ``GPUSHARE_HANDOFF_NATIVE=0``."""
    if _off() or _handoff_off() or not sys.platform.startswith("linux"):
        return None
    return _core.load()


def _handoff_off() -> bool:
    return os.environ.get("GPUSHARE_HANDOFF_NATIVE", "1") == "0"


def handoff_why_not() -> str | None:
    """Why the handoff's C calls are not in use (None while they are, or before the first try)."""
    for name in ("GPUSHARE_NATIVE", "GPUSHARE_HANDOFF_NATIVE"):
        if os.environ.get(name, "1") == "0":
            return f"{name}=0"
    if not sys.platform.startswith("linux"):
        return "the C handoff is built on Linux only"
    return _core.why_not


def queries_type() -> Any:
    """The ``Queries`` type of ``_cuda/_queries.c`` (``Queries(library)`` binds the driver's
    per-handoff calls in a driver library already loaded), or None where it cannot be
    built or loaded, off Linux, or with ``GPUSHARE_NATIVE=0``."""
    if _off() or not sys.platform.startswith("linux"):
        return None
    queries = _queries.load()
    return None if queries is None else queries.Queries
