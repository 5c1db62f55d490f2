"""The Queue region's put and get in C (``_region.c``, an extension module built on first
use), else nothing.

- Built with the system C compiler (``$CC``, else ``cc``) and this Python's headers into a
  cache folder (``$GPUSHARE_CACHE``, else ``$XDG_CACHE_HOME/gpushare``, else
  ``~/.cache/gpushare``, else ``/tmp/gpushare-UID``; a folder or file another user owns or
  may write to is never used), once per source, machine and Python:
  the file's name carries the source's hash. Later processes load the file; two that build
  at once each write their own and rename it into place.
- Used only where the Python path's lock is the robust pthread mutex (Linux) on x86-64, which
  the C code shares; anywhere else, with no compiler, or with ``GPUSHARE_QUEUE_NATIVE=0``
  (every user of a queue may differ: both paths follow one protocol), :func:`region_ops`
  is None and the Queue runs its Python path alone.
- The C calls take the plain case only. Whatever else (a busy lock, a payload to spill)
  they hand back untouched (PYTHON), and the Python path takes it.
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

__all__ = ["EMPTY", "PYTHON", "region_ops", "why_not"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_region.c")
EMPTY, PYTHON = -1, -2  # the C calls' answers besides a put's own (Region.try_put's) and a message
BUILD_TIMEOUT = 120.0
MODULE = "gpushare_region"  # the extension's name (its PyInit_ function)


_ring: Any = None
_tried = False
_lock = threading.Lock()
#: Why the C path is not in use in this process (None while it is, or before the first try).
why_not: str | None = None


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


def _build(source: bytes) -> str:
    """The path of the built library for ``source``: found in a cache folder, or built there.

    Only a build imports subprocess, sysconfig and tempfile: a process that finds the file
    (every process after the first) pays for a hash of the source and two stats."""
    tag = f"{os.uname().machine}-{sys.implementation.cache_tag}{sys.abiflags}"
    key = f"{zlib.crc32(source):08x}{zlib.adler32(source):08x}-{tag}"
    name = f"region-{key}.so"
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
        command = [compiler, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", tmp, SOURCE, "-lpthread"]
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


def _load() -> Any:
    """The extension's ``Ring`` type, built if need be; None (``why_not`` says why) where it
    cannot be built or loaded."""
    global _ring, _tried, why_not
    if _tried:
        return _ring
    with _lock:
        if _tried:
            return _ring
        try:
            from importlib.machinery import ExtensionFileLoader
            from importlib.util import module_from_spec, spec_from_file_location

            with open(SOURCE, "rb") as f:
                path = _build(f.read())
            spec = spec_from_file_location(MODULE, path, loader=ExtensionFileLoader(MODULE, path))
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = module_from_spec(spec)
            spec.loader.exec_module(module)
            _ring = module.Ring
        except (OSError, ImportError, AttributeError) as exc:
            why_not = f"the C region could not be built or loaded: {exc}"
        _tried = True
        return _ring


def region_ops(
    start: Any, cap: int, spill_over: int, header: int, words: tuple[int, int, int, int],
    copies: tuple[tuple[int, int], tuple[int, int]], locks: tuple[int, int],
) -> Any:  # fmt: skip
    """The C calls for a region whose mapping begins at ``start`` (a ctypes object exported
    from the mapping, kept so that the mapping outlives the calls; offsets as ``_queues``
    lays the region out): an object whose ``put(payload, kind, task, maxsize, pending)``
    answers as ``Region.try_put`` does or PYTHON, and whose ``get()`` answers ``(kind,
    payload)``, EMPTY or PYTHON. None where they cannot be used."""
    global why_not
    if os.environ.get("GPUSHARE_QUEUE_NATIVE", "1") == "0":
        why_not = "GPUSHARE_QUEUE_NATIVE=0"
        return None
    if not sys.platform.startswith("linux") or os.uname().machine.lower() not in ("x86_64", "amd64"):
        why_not = "the C region is built for Linux on x86-64 only"
        return None
    ring = _load()
    if ring is None:
        return None
    (p0, p1), (c0, c1) = copies
    return ring(start, ctypes.addressof(start), cap, spill_over, header, *words, p0, p1, c0, c1, *locks)
