"""The per-handoff driver calls that keep the GIL, called through ``ctypes.PyDLL``.

cuda-bindings releases the GIL around every driver call. For
``cuCtxGetCurrent``, ``cuStreamQuery``, ``cuEventQuery`` and ``cuEventRecord``,
which do not wait for the device and return at once, that lets another
thread (a Queue's feeder, woken by the put before) take the GIL in the middle
of a put or a publish, and the caller then waits for it to give the GIL back.
:func:`load` binds these four on the driver library cuda-bindings already
loaded, to be called with the GIL held: through the C extension ``_queries.c``
where ``gpushare._native`` builds it (no ctypes object per call: a stream query
costs well under a microsecond of Python), else through :class:`_Queries`
(ctypes). Both answer alike. :func:`gpushare._cuda._driver._load` calls
:func:`load` when the driver loads (so this module, and ctypes, are imported
then, not with the package).
"""

from __future__ import annotations

import ctypes
import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600


class _Queries:
    """``cuCtxGetCurrent``, ``cuStreamQuery``, ``cuEventQuery`` and ``cuEventRecord`` called
    with the GIL held.

    ``ctypes.PyDLL`` calls a C function without releasing the GIL. The library is the
    ``libcuda.so.1`` cuda-bindings already loaded in this process
    (``RTLD_NOLOAD`` never loads a second copy), so its handles are valid here.
    Not used when cuda-bindings runs on the per-thread default stream
    (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``), since these plain symbols
    name the legacy one.
    """

    __slots__ = ("ctx", "event", "recorder", "stream")

    def __init__(self, lib: Any) -> None:
        self.ctx = lib.cuCtxGetCurrent
        self.ctx.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.stream = lib.cuStreamQuery
        self.event = lib.cuEventQuery
        self.recorder = lib.cuEventRecord
        for fn in (self.stream, self.event):
            fn.argtypes = [ctypes.c_void_p]
        self.recorder.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        for fn in (self.ctx, self.stream, self.event, self.recorder):
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls, library: str = "libcuda.so.1") -> _Queries | None:
        """The ctypes queries on the driver library already loaded, or None (use cuda-bindings).
        :func:`load`, the one entry, has already looked at the default stream in use."""
        no_load = getattr(os, "RTLD_NOLOAD", None)
        if no_load is None:  # no way to ask for the copy already loaded only
            return None
        try:
            return cls(ctypes.PyDLL(library, mode=no_load | ctypes.RTLD_LOCAL))
        except (OSError, AttributeError):  # not loaded under that name, or not a CUDA driver
            return None

    def stream_done(self, key: int | None, stream: int) -> bool | None:
        """``cuStreamQuery(stream)`` when the primary context ``key`` is current on this
        thread: True when done, False when not yet; None when this cannot answer (another
        context current, or an error: the caller asks again through cuda-bindings,
        which sets the context or reports the error with its name)."""
        return self._done(key, self.stream, stream)

    def event_done(self, key: int | None, event: int) -> bool | None:
        """``cuEventQuery(event)``, answered as :meth:`stream_done` answers."""
        return self._done(key, self.event, event)

    def _done(self, key: int | None, query: Any, handle: int) -> bool | None:
        if not self._current(key):
            return None
        err = query(handle)
        if err == _CUDA_SUCCESS:
            return True
        if err == _CUDA_ERROR_NOT_READY:
            return False
        return None

    def record(self, key: int | None, event: int, stream: int) -> bool:
        """``cuEventRecord(event, stream)`` when the primary context ``key`` is current on
        this thread; True when recorded. False when this cannot (another context
        current, or an error): the caller records through cuda-bindings, which sets
        the context or reports the error with its name (a failed record recorded
        nothing, so recording again is safe). ``stream`` is an int handle (0 and 1:
        the legacy default stream; 2: the per-thread one)."""
        return self._current(key) and self.recorder(event, stream) == _CUDA_SUCCESS

    def _current(self, key: int | None) -> bool:
        """Whether the primary context ``key`` (its handle as an int) is current on this thread."""
        if key is None:
            return False
        current = ctypes.c_void_p()
        return self.ctx(current) == _CUDA_SUCCESS and current.value == key


def load(library: str = "libcuda.so.1", native: bool = True) -> Any:
    """The queries on the driver library already loaded (the C extension's where it builds
    and ``native``, else :class:`_Queries`), or None (use cuda-bindings)."""
    if os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0"):
        return None
    if native:
        from .. import _native

        kind = _native.queries_type()
        if kind is not None:
            try:
                return kind(library)
            except ImportError:  # not loaded under that name, or not a CUDA driver
                return None
    return _Queries.load(library)
