"""The error hierarchy of gpushare, split by cause.

- Every exception gpushare raises on purpose derives from :class:`GpushareError`.
- Each subclass says who broke what: the driver, you (closed), the peer (gone), bad bytes,
  the start method, a wait that ran out. Each class's docstring says when it is raised.
- Messages say what was wrong, what is valid, and what to do.
- This module imports nothing of gpushare. The table: dev/design-notes.md, "Errors".
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "BufferReleasedError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "CompiledCoreWarning",
    "DescriptorError",
    "GpushareError",
    "LayoutError",
    "LeakWarning",
    "LeaseExpiredWarning",
    "LoaderError",
    "MainGuardError",
    "ManagerClosedError",
    "NoDeviceError",
    "OutOfMemoryError",
    "OwnerGoneError",
    "ReentrantCallError",
    "RingClosedError",
    "StartMethodError",
    "TensorSetClosedError",
    "WaitTimeoutError",
]


class GpushareError(Exception):
    """Base class of every error gpushare raises on purpose."""


class CUDAError(GpushareError):
    """A CUDA driver call failed.

    ``name`` is the driver's error name (``"CUDA_ERROR_INVALID_VALUE"``),
    ``code`` its number and ``call`` the driver function that returned it.
    """

    def __init__(self, call: str, code: int, name: str, text: str, hint: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        self.text = text
        message = f"{call} failed with {name} ({code}): {text}"
        if hint:
            message += f". {hint}"
        super().__init__(message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.call, self.code, self.name, self.text))


class OutOfMemoryError(GpushareError, MemoryError):
    """No room for an allocation (device or host shared memory).

    Raised after the Manager freed its pool of unused allocations on that
    device and tried again: :class:`CUDAOutOfMemoryError` on a GPU, this class
    itself for host memory.
    """


class CUDAOutOfMemoryError(CUDAError, OutOfMemoryError):
    """The device has no room for the allocation (CUDA_ERROR_OUT_OF_MEMORY)."""


class NoDeviceError(GpushareError, RuntimeError):
    """No CUDA driver, no GPU, or the requested device does not exist."""


class BufferReleasedError(GpushareError, ValueError):
    """The buffer was released in this process; its memory may not be touched here."""


class ManagerClosedError(GpushareError, RuntimeError):
    """The Manager was shut down; it allocates and shares nothing more."""


class OwnerGoneError(GpushareError, ConnectionError):
    """The process that owns the memory exited or stopped answering."""


class RingClosedError(GpushareError, EOFError):
    """The ring was closed: no more items will come (consumer), or none may be published (producer).

    Closed by its producer: a consumer's ``get()`` after the last item. Closed
    by you: the producer's ``acquire()`` or ``publish()`` after ``close()``. A
    producer that *died* shows as :class:`OwnerGoneError` instead.
    """


class TensorSetClosedError(GpushareError, EOFError):
    """The tensor set was closed by its trainer: no newer version will come (reader), or none may be published.

    A reader's ``latest()`` or ``wait()`` raises it once no version it can
    still take is left; the trainer's ``publish()`` or ``draft()`` after
    ``close()``. A trainer that *died* shows as :class:`OwnerGoneError` instead.
    """


class LayoutError(GpushareError, ValueError):
    """A tensor set's layout is invalid, or tensors given for it do not match it.

    A name missing or unknown, a shape, dtype or size that differs, memory that
    is not contiguous or not writable.
    """


class LoaderError(GpushareError, RuntimeError):
    """A SlotLoader cannot go on (a worker failed to start, a batch too large for its slot, every slot held).

    "Every slot held": this process holds every slot of the worker whose batch
    comes next. A worker that *died* shows as :class:`OwnerGoneError`.
    """


class DescriptorError(GpushareError, ValueError):
    """A buffer descriptor is corrupt, truncated, of another version, or stale (a lease the owner does not know)."""


class StartMethodError(GpushareError, RuntimeError):
    """The start method cannot be used here (fork after CUDA was initialised)."""


class MainGuardError(StartMethodError):
    """A process was started while a spawned child was still importing the main module.

    A child started with spawn (gpushare's default) or forkserver imports the
    main module again, so a script that starts processes at its top level,
    outside ``if __name__ == "__main__":``, would start them again in every
    child. The message names the line and the fix. Raised in that child, which
    then exits at once (exit code 78); a Pool or Manager whose process exited
    so raises it in the parent too.
    """


class BackendUnavailableError(GpushareError, RuntimeError):
    """The requested sharing backend cannot run on this machine."""


class WaitTimeoutError(GpushareError, TimeoutError):
    """A wait bounded by ``timeout=`` ran out; the message says what it waited for and who held what.

    A ring's ``acquire()``, ``publish()`` or ``get()``, a loader's next batch,
    a tensor set's ``publish()``, ``draft()`` or ``wait()``.
    """


class ReentrantCallError(GpushareError, RuntimeError):
    """A queue call from a signal handler that interrupted its own thread inside a call on the
    same queue, where it would have to wait for that thread: a ``get()``, or a ``put()`` on a
    bounded queue (an unbounded queue's ``put()`` works from a handler). The interrupted call
    goes on unharmed; set a flag in the handler and make the call from the main code instead.
    """


class LeakWarning(ResourceWarning):
    """Buffers were still leased to other processes when their owner shut down."""


class LeaseExpiredWarning(RuntimeWarning):
    """A lease taken by pickling a buffer was never claimed and has expired."""


class CompiledCoreWarning(RuntimeWarning):
    """gpushare's compiled core is not installed in this Python: its Queue and buffer handoff run
    their Python path, several times slower (given once per process). ``python -m gpushare info``
    says why; reinstall where a C compiler and Python's headers are present, or from a wheel, or
    set ``GPUSHARE_NATIVE=0`` to choose the Python path without this warning."""


for _name in __all__:  # their public names, in tracebacks, help() and pickles: gpushare.OwnerGoneError
    globals()[_name].__module__ = "gpushare"
del _name
