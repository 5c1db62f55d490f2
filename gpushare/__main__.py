"""``python -m gpushare info [--json]``: what gpushare can do on this machine.

Reports versions (gpushare, Python, cuda-bindings, driver), which compiled modules are in use
(else why the Python path runs), CUDA devices, the backends each supports, whether the copy
kernel builds for it, peer access, the start method, and whether fds pass over a Unix socket
(tried for real). It never needs a GPU: without one it says why
(:class:`~gpushare.NoDeviceError`'s message) and exits 0. Driver calls go through :mod:`gpushare._cuda`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from typing import Any

import gpushare

from . import _backends, _cuda, _native
from ._context import get_start_method  # what gpushare.get_start_method() is bound to
from ._errors import GpushareError

__all__ = ["collect_info", "main"]

_GIB = 1 << 30


def _format_driver_version(version: int) -> str:
    # cuDriverGetVersion encodes 13.0 as 13000 and 12.4 as 12040.
    return f"{version // 1000}.{(version % 1000) // 10}"


def check_scm_rights() -> tuple[bool, str | None]:
    """Pass a pipe's read end over a Unix socket pair and read through the received fd."""
    if not hasattr(socket, "send_fds") or not hasattr(socket, "AF_UNIX"):
        return False, "socket.send_fds/recv_fds are not available on this platform"
    opened: list[int] = []
    socks: list[socket.socket] = []
    try:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        socks += [left, right]
        for sock in socks:
            sock.settimeout(5.0)
        read_end, write_end = os.pipe()
        opened += [read_end, write_end]
        socket.send_fds(left, [b"x"], [read_end])
        msg, fds, _flags, _addr = socket.recv_fds(right, 1, 1)
        opened += list(fds)
        if msg != b"x" or len(fds) != 1:
            return False, f"sent one fd, received {len(fds)} (message {msg!r})"
        os.write(write_end, b"ok")
        data = os.read(fds[0], 2)
        if data != b"ok":
            return False, f"the received fd does not read what the pipe holds ({data!r})"
        return True, None
    except OSError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    finally:
        for fd in opened:
            try:
                os.close(fd)
            except OSError:
                pass
        for sock in socks:
            sock.close()


def _backend_info(gpus: int) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = {}
    for name in _backends.BACKENDS:
        entry: dict[str, Any] = {"available": False, "cuda": None, "detail": ""}
        try:
            backend = _backends.get(name)
            caps = backend.capabilities()
        except GpushareError as exc:
            entry["detail"] = str(exc)
        else:
            entry["cuda"] = backend.is_cuda
            entry["detail"] = str(caps.get("mechanism", ""))
            if backend.is_cuda and gpus == 0:
                entry["detail"] = "needs a CUDA GPU; none is usable here"
            else:
                entry["available"] = bool(caps.get("available", True))
        result[name] = entry
    return result


def _supports(name: str, ordinal: int) -> bool:
    """Whether CUDA backend ``name`` can allocate on device ``ordinal`` (its own capability check)."""
    try:
        _backends.get(name).check_device(ordinal)
    except GpushareError:
        return False
    return True


def collect_info() -> dict[str, Any]:
    """Everything ``info`` prints, as plain JSON-ready values."""
    info: dict[str, Any] = {
        "gpushare": gpushare.__version__,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cuda_bindings": _cuda.bindings_version(),
    }

    driver: dict[str, Any] = {"available": False, "version": None, "version_string": None, "error": None}
    try:
        version = _cuda.driver_version()
    except GpushareError as exc:
        driver["error"] = str(exc)
    else:
        driver.update(available=True, version=version, version_string=_format_driver_version(version))
    info["driver"] = driver

    devices: list[dict[str, Any]] = []
    gpus = 0
    device_error: str | None = None
    try:
        gpus = _cuda.device_count()
    except GpushareError as exc:  # NoDeviceError: no driver or no GPU
        device_error = str(exc)
    info["device_error"] = device_error

    backends = _backend_info(gpus)
    info["backends"] = backends
    cuda_backends = [name for name, b in backends.items() if b["cuda"] and b["available"]]

    for ordinal in range(gpus):
        entry: dict[str, Any] = {"ordinal": ordinal}
        try:
            entry["uuid"] = _cuda.format_uuid(_cuda.device_uuid(ordinal))
            entry["name"] = _cuda.device_name(ordinal)
            entry["total_memory"] = _cuda.device_total_memory(ordinal)
            entry["backends"] = [name for name in cuda_backends if _supports(name, ordinal)]
            entry["copy_kernel"] = _cuda.copy_kernel_status(ordinal, build=True)  # weight sync's copies
        except GpushareError as exc:
            entry["error"] = str(exc)
            entry["backends"] = []
        devices.append(entry)
    info["devices"] = devices

    matrix: list[list[bool | None]] = []
    for i in range(gpus):
        row: list[bool | None] = []
        for j in range(gpus):
            if i == j:
                row.append(None)
                continue
            try:
                row.append(_cuda.can_access_peer(i, j))
            except GpushareError:
                row.append(False)
        matrix.append(row)
    info["peer_access"] = matrix

    info["start_method"] = get_start_method()
    works, why = check_scm_rights()
    info["scm_rights"] = {"works": works, "error": why}
    info["compiled_core"] = {module: {"in_use": why is None, "why_not": why} for module, why in _native.core_paths()}
    return info


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_info(info: dict[str, Any]) -> str:
    lines: list[str] = []

    def row(label: str, value: object) -> None:
        lines.append(f"{label:<16}{value}")

    row("gpushare", info["gpushare"])
    row("python", f"{info['python']} ({info['python_implementation']}, {info['platform']})")
    row("cuda-bindings", info["cuda_bindings"])
    driver = info["driver"]
    if driver["available"]:
        row("driver", f"CUDA {driver['version_string']} ({driver['version']})")
    else:
        row("driver", f"unavailable: {driver['error']}")
    row("start method", info["start_method"])
    scm = info["scm_rights"]
    row("SCM_RIGHTS", _yes(scm["works"]) + ("" if scm["works"] else f" ({scm['error']})"))

    lines.append("compiled core")
    for module, state in info["compiled_core"].items():
        lines.append(f"  {module:<44}{'in use' if state['in_use'] else 'no: ' + state['why_not']}")

    lines.append("backends")
    for name, b in info["backends"].items():
        lines.append(f"  {name:<14}{_yes(b['available']):<5}{b['detail']}")

    devices = info["devices"]
    if not devices:
        reason = info.get("device_error") or "the driver reports no device"
        if reason == driver["error"]:
            reason = "see driver above"
        row("devices", f"none ({reason})")
    else:
        lines.append("devices")
        for d in devices:
            if "error" in d:
                lines.append(f"  {d['ordinal']}  error: {d['error']}")
                continue
            memory = f"{d['total_memory'] / _GIB:.1f} GiB"
            supported = ", ".join(d["backends"]) or "none"
            lines.append(f"  {d['ordinal']}  {d['uuid']}  {d['name']}  {memory}  backends: {supported}")
            lines.append(f"     copy kernel: {d['copy_kernel']}")

    matrix = info["peer_access"]
    if len(matrix) < 2:
        row("peer access", "n/a (fewer than two devices)")
    else:
        lines.append("peer access (row reads column)")
        header = "      " + "".join(f"{j:>5}" for j in range(len(matrix)))
        lines.append(header)
        for i, cells in enumerate(matrix):
            text = "".join(f"{'-' if c is None else _yes(c):>5}" for c in cells)
            lines.append(f"  {i:>3} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare", description="gpushare: multiprocessing for GPU buffers")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    info_parser = sub.add_parser("info", help="show versions, devices, backends and peer access")
    info_parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)  # unknown commands: usage on stderr, exit 2

    if args.command == "info":
        info = collect_info()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(format_info(info))
        return 0
    parser.print_usage(sys.stderr)  # pragma: no cover - argparse rejects it first
    return 2


if __name__ == "__main__":
    sys.exit(main())
