"""The only place in gpushare that imports ``cuda.bindings``.

Everything above this package speaks in plain Python values: device
ordinals (ints valid in *this* process), device UUIDs (16 bytes, valid in
every process whatever ``CUDA_VISIBLE_DEVICES`` says), device and host
pointers, stream handles (ints) and IPC handles (64 bytes).

Protocol of this layer:

* The driver is loaded lazily, on the first call that needs it, and
  ``cuInit`` runs once per process. With no driver library, or no GPU,
  :class:`~gpushare._errors.NoDeviceError` says so and what to do instead.
  Importing this package loads neither cuda-bindings nor ctypes, typing or
  threading: it stays cheap for a process that never touches a GPU.
* Every driver call goes through :func:`_driver._check`: a failing
  ``CUresult`` becomes one :class:`~gpushare._errors.CUDAError` carrying the
  call, the driver's error name and text (out of memory becomes
  :class:`~gpushare._errors.CUDAOutOfMemoryError`, a ``MemoryError``).
* Work on a device runs inside that device's *primary* context, pushed
  for the call and popped after, so the caller's current context (torch's,
  CuPy's) is left as it was and any thread may call in. The per-handoff
  calls (event record and wait, stream and event queries, asynchronous
  copies) push only when that context is not already current on the thread.
* Handles cross the process boundary as bytes. cuda-bindings changed the
  fields of ``CUipcMemHandle`` between releases, so bytes are copied
  through the struct's address with ctypes, which works on 12.x and 13.x.
* The per-handoff calls (``cuCtxGetCurrent``, ``cuStreamQuery``,
  ``cuEventQuery``, ``cuEventRecord``: :func:`stream_idle`, :func:`event_done`,
  :func:`event_record`) keep the GIL. cuda-bindings releases it around every
  driver call, which lets another thread (a Queue's feeder, woken by the put
  before) take it in the middle of a put or a publish for a call that lasts
  microseconds. These four do not wait for the device, so they are called
  through ``ctypes.PyDLL`` on the driver library that cuda-bindings loaded
  (:class:`_queries._Queries`); every other call, and these when that
  library cannot be found that way, go through cuda-bindings.

The modules, by concern:

* :mod:`._driver`: loading, :func:`_check`, devices, primary contexts; it
  owns all of this layer's module-level state (loaded driver, contexts,
  caches, queries), which the other modules read from it at call time.
* :mod:`._queries`: the GIL-keeping calls, imported when the driver loads.
* :mod:`._device_memory`: device allocations, legacy IPC handles, VMM, IPC pools.
* :mod:`._copies`: synchronous and asynchronous copies, page-locked host memory.
* :mod:`._kernels`: gpushare's one kernel, many device-to-device copies in one launch.
* :mod:`._streams`: streams, events (interprocess and plain), their queries.

Everything public is re-exported here, and the rest of gpushare calls it as
``gpushare._cuda.<name>``.
"""

from __future__ import annotations

from ._copies import (
    host_alloc,
    host_free,
    host_register,
    host_unregister,
    memcpy,
    memcpy_async,
    memcpy_batch_async,
    memcpy_dtoh,
    memcpy_htod,
    memcpy_htod_async,
    memset,
    memset32,
)
from ._device_memory import (
    address_range,
    ipc_close,
    ipc_get_handle,
    ipc_open,
    mem_alloc,
    mem_free,
    mem_info,
    pointer_device,
    pool_alloc,
    pool_create,
    pool_destroy,
    pool_free,
    pool_import,
    pool_import_pointer,
    pool_trim,
    vmm_alloc,
    vmm_export,
    vmm_free,
    vmm_granularity,
    vmm_import,
)
from ._driver import (
    IPC_HANDLE_SIZE,
    available,
    bindings_version,
    can_access_peer,
    child_device_count,
    device_count,
    device_name,
    device_total_memory,
    device_uuid,
    driver_version,
    format_uuid,
    initialized,
    make_current,
    on_device,
    ordinal_from_uuid,
    present_device_count,
    start_context,
    supports,
)
from ._kernels import kernel_status as copy_kernel_status
from ._streams import (
    event_create,
    event_create_ipc,
    event_destroy,
    event_done,
    event_open,
    event_record,
    event_synchronize,
    stream_create,
    stream_destroy,
    stream_idle,
    stream_synchronize,
    stream_wait_event,
    synchronize,
)

__all__ = [
    "IPC_HANDLE_SIZE",
    "address_range",
    "available",
    "bindings_version",
    "can_access_peer",
    "child_device_count",
    "copy_kernel_status",
    "device_count",
    "device_name",
    "device_total_memory",
    "device_uuid",
    "driver_version",
    "event_create",
    "event_create_ipc",
    "event_destroy",
    "event_done",
    "event_open",
    "event_record",
    "event_synchronize",
    "format_uuid",
    "host_alloc",
    "host_free",
    "host_register",
    "host_unregister",
    "initialized",
    "ipc_close",
    "ipc_get_handle",
    "ipc_open",
    "make_current",
    "mem_alloc",
    "mem_free",
    "mem_info",
    "memcpy",
    "memcpy_async",
    "memcpy_batch_async",
    "memcpy_dtoh",
    "memcpy_htod",
    "memcpy_htod_async",
    "memset",
    "memset32",
    "on_device",
    "ordinal_from_uuid",
    "pointer_device",
    "pool_alloc",
    "pool_create",
    "pool_destroy",
    "pool_free",
    "pool_import",
    "pool_import_pointer",
    "pool_trim",
    "present_device_count",
    "start_context",
    "stream_create",
    "stream_destroy",
    "stream_idle",
    "stream_synchronize",
    "stream_wait_event",
    "supports",
    "synchronize",
    "vmm_alloc",
    "vmm_export",
    "vmm_free",
    "vmm_granularity",
    "vmm_import",
]
