"""gpushare's small C extension modules, built on first use, else nothing: the Queue region's
put and get (``_region.c``), a buffer's handoff at both ends of a Queue (``_handoff.c``) and
the driver's per-handoff queries (``_cuda/_queries.c``).

- Built with the system C compiler (``$CC``, else ``cc``) and this Python's headers into a
  cache folder (``$GPUSHARE_CACHE``, else ``$XDG_CACHE_HOME/gpushare``, else
  ``~/.cache/gpushare``, else ``/tmp/gpushare-UID``; a folder or file another user owns or
  may write to is never used), once per source, machine and Python:
  the file's name carries the source's hash. Later processes load the file; two that build
  at once each write their own and rename it into place.
- The region is used only where the Python path's lock is the robust pthread mutex (Linux)
  on x86-64, which the C code shares; anywhere else, with no compiler, or with
  ``GPUSHARE_QUEUE_NATIVE=0`` (every user of a queue may differ: both paths follow one
  protocol), :func:`region_ops` is None and the Queue runs its Python path alone. Its C
  calls take the plain case only. Whatever else (a busy lock, a payload to spill) they hand
  back untouched (PYTHON), and the Python path takes it.
- The handoff (:func:`handoff_module`) is used on Linux wherever it builds: a Manager's
  buffer put on a Queue, and a Queue message naming an allocation this process maps, each in
  one call, from what the Python path left (``gpushare._buffer``); anything else, and
  everywhere it does not build, or with ``GPUSHARE_HANDOFF_NATIVE=0``, takes the Python path.
- The queries (:func:`queries_type`) are used on Linux wherever they build; elsewhere the
  driver's queries go through ctypes (``_cuda._queries``).
- ``GPUSHARE_NATIVE=0`` turns all three off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import zlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["EMPTY", "PYTHON", "handoff_module", "handoff_why_not", "queries_type", "region_ops", "why_not"]

HERE = os.path.dirname(os.path.abspath(__file__))
EMPTY, PYTHON = -1, -2  # the region's answers besides a put's own (Region.try_put's) and a message
BUILD_TIMEOUT = 120.0

#: Why the Queue's C calls are not in use in this process (None while they are, or before the first try).
why_not: str | None = None


class _Extension:
    """One C source, built and loaded once per process: the type it exports, or None
    (``why_not`` says why)."""

    def __init__(self, source: str, module: str, attr: str, stem: str, libraries: tuple[str, ...]) -> None:
        self.source = os.path.join(HERE, source)
        self.module = module  # the extension's name (its PyInit_ function)
        self.attr = attr
        self.stem = stem  # the built file's name starts with it
        self.libraries = libraries  # what it links with (-l...)
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
            try:
                from importlib.machinery import ExtensionFileLoader
                from importlib.util import module_from_spec, spec_from_file_location

                with open(self.source, "rb") as f:
                    path = _build(f.read(), self.source, self.stem, self.libraries)
                loader = ExtensionFileLoader(self.module, path)
                spec = spec_from_file_location(self.module, path, loader=loader)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load {path}")
                module = module_from_spec(spec)
                spec.loader.exec_module(module)
                self.value = getattr(module, self.attr) if self.attr else module
            except (OSError, ImportError, AttributeError) as exc:
                self.why_not = f"the C {self.stem} could not be built or loaded: {exc}"
            self.tried = True
            return self.value


_region = _Extension("_region.c", "gpushare_region", "Ring", "region", ("pthread",))
_queries = _Extension(os.path.join("_cuda", "_queries.c"), "gpushare_queries", "Queries", "queries", ("dl",))
_handoff = _Extension("_handoff.c", "gpushare_handoff", "", "handoff", ())


def _off() -> bool:
    return os.environ.get("GPUSHARE_NATIVE", "1") == "0"


def _cache_dirs() -> list[str]:
    chosen = os.environ.get("GPUSHARE_CACHE")
    if chosen:
        return [chosen]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(xdg, "gpushare"), os.path.join("/tmp", f"gpushare-{os.getuid()}")]


def _ours(path: str) -> bool:
    """Whether ``path`` belongs to this user and no one else may write to it: a library is
    loaded into this process only from such a folder and file."""
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(source: bytes, path_of_source: str, stem: str, libraries: tuple[str, ...]) -> str:
    """The path of the built library for ``source`` (read from ``path_of_source``, linked
    with ``libraries``): found in a cache folder, or built there.

    Only a build imports subprocess, sysconfig and tempfile: a process that finds the file
    (every process after the first) pays for a hash of the source and two stats."""
    tag = f"{os.uname().machine}-{sys.implementation.cache_tag}{sys.abiflags}"
    key = f"{zlib.crc32(source):08x}{zlib.adler32(source):08x}-{tag}"
    name = f"{stem}-{key}.so"
    folders = _cache_dirs()
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.exists(path) and _ours(folder) and _ours(path):
            return path
    import subprocess
    import sysconfig
    import tempfile

    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"this Python's headers are not installed (no Python.h in {include})")
    errors = []
    for folder in folders:
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if not _ours(folder):
                raise OSError("not this user's alone (another user owns it, or may write in it)")
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        compiler = os.environ.get("CC") or "cc"
        command = [compiler, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", tmp, path_of_source]
        command += [f"-l{name}" for name in libraries]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[:500]}")
            os.chmod(tmp, 0o700)  # whatever the umask: a file others may write to is never loaded
            os.replace(tmp, path)  # atomic: a process building beside this one finds a whole file
            return path
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(str(exc))
            break  # the compiler failed: another folder would not help
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise OSError("; ".join(errors) or "no cache folder")


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
