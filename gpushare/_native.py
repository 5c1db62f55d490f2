"""gpushare's compiled core, loaded if installed: the Queue region's put and get
(``_region.c``, the module ``gpushare._cregion``), a buffer's handoff at both ends of a Queue
(``_handoff.c``, ``gpushare._chandoff``) and the driver's per-handoff queries
(``_cuda/_queries.c``, ``gpushare._cuda._cqueries``).

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
- ``GPUSHARE_NATIVE=0`` turns all three off (no warning: that is asked for).
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
    """One compiled module, imported once per process: the object it exports, or None
    (``why_not`` says why)."""

    def __init__(self, module: str, attr: str, what: str) -> None:
        self.module = module
        self.attr = attr
        self.what = what  # for messages: "region", "handoff", "driver queries"
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
                module = importlib.import_module(self.module)
                self.value = getattr(module, self.attr) if self.attr else module
            except (ImportError, AttributeError) as exc:
                self.why_not = f"{self.module} (the compiled {self.what}) is not installed: {exc}"
                missing = exc
            self.tried = True
        if missing is not None:
            _warn_missing(self.module, missing)
        return self.value


_region = _Extension("gpushare._cregion", "Ring", "region")
_queries = _Extension("gpushare._cuda._cqueries", "Queries", "driver queries")
_handoff = _Extension("gpushare._chandoff", "", "handoff")


def _off() -> bool:
    return os.environ.get("GPUSHARE_NATIVE", "1") == "0"


def core_paths() -> list[tuple[str, str | None]]:
    """``gpushare info``'s lines: each compiled module's name, and None where it loads and is
    used here, else why not (set off by the environment, not built, not this platform)."""
    out: list[tuple[str, str | None]] = []
    for ext, switch in ((_region, "GPUSHARE_QUEUE_NATIVE"), (_handoff, "GPUSHARE_HANDOFF_NATIVE"), (_queries, None)):
        why: str | None = None
        for name in ("GPUSHARE_NATIVE", switch):
            if name and os.environ.get(name, "1") == "0":
                why = f"{name}=0: the Python path is chosen"
                break
        if why is None and not sys.platform.startswith("linux"):
            why = "built on Linux only"
        elif why is None and ext is _region and os.uname().machine.lower() not in ("x86_64", "amd64"):
            why = "used on x86-64 only (its lock must be the Python path's)"
        if why is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CompiledCoreWarning)
                if ext.load() is None:
                    why = ext.why_not
        out.append((ext.module, why))
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
    ring = _region.load()
    if ring is None:
        why_not = _region.why_not
        return None
    (p0, p1), (c0, c1) = copies
    return ring(start, ctypes.addressof(start), cap, spill_over, header, *words, p0, p1, c0, c1, *locks)


def handoff_module() -> Any:
    """The module of ``_handoff.c`` (its ``Shares`` and ``Arrivals``: see ``gpushare._buffer``),
    or None where it cannot be built or loaded, off Linux, or with ``GPUSHARE_NATIVE=0``."""
    if _off() or _handoff_off() or not sys.platform.startswith("linux"):
        return None
    return _handoff.load()


def _handoff_off() -> bool:
    return os.environ.get("GPUSHARE_HANDOFF_NATIVE", "1") == "0"


def handoff_why_not() -> str | None:
    """Why the handoff's C calls are not in use (None while they are, or before the first try)."""
    for name in ("GPUSHARE_NATIVE", "GPUSHARE_HANDOFF_NATIVE"):
        if os.environ.get(name, "1") == "0":
            return f"{name}=0"
    if not sys.platform.startswith("linux"):
        return "the C handoff is built on Linux only"
    return _handoff.why_not


def queries_type() -> Any:
    """The ``Queries`` type of ``_cuda/_queries.c`` (``Queries(library)`` binds the driver's
    per-handoff calls in a driver library already loaded), or None where it cannot be
    built or loaded, off Linux, or with ``GPUSHARE_NATIVE=0``."""
    if _off() or not sys.platform.startswith("linux"):
        return None
    return _queries.load()
