"""What both ends of a ring share besides the channel: limits, spinning, socket framing.

The socket carries registration (pickled messages through multiprocessing's
``Connection``) and then only two kinds of frame, producer -> consumer, in
the same framing (a 4-byte big-endian length, or -1 and an 8-byte length):
``META`` (a meta too long for its shared-memory entry, just before the
entry) and ``CLOSED`` (the end of the ring, after every item).
"""

from __future__ import annotations

import math
import os
import struct

#: Seconds a registration step (either side) may take before it is abandoned.
REGISTER_TIMEOUT = 30.0
#: Seconds a send to one consumer may stay blocked (its socket full) before that consumer is dropped.
SEND_TIMEOUT = 30.0
#: Seconds ``spin=True`` spins before it sleeps in ``poll``.
SPIN_DEFAULT = 0.005
#: ``spin="auto"`` (the default): the most an end spins before it sleeps, and it spins
#: at all only when its previous wait was shorter than this. About what it costs to
#: wake a process that sleeps (the `ring` and `ring_roundtrip` benchmark scenarios run
#: with and without spinning): a wait then
#: costs at most about twice what sleeping at once would, and items that come further
#: apart than this cost no spinning (see SpinPolicy).
SPIN_AUTO = 50e-6
#: A spinning end gives its core away (``sched_yield``) once every this many looks at
#: the shared words: a yield is a system call, costlier than a look, and the other
#: process's store is seen only at the next look after it.
SPIN_LOOKS = 4
MAX_SLOTS = 1 << 16
MAX_META = 1 << 20

# Socket frames after registration (producer -> consumer only): a meta too long
# for its shared-memory entry, and the end of the ring.
META = 1
CLOSED = 2

_LENGTH = struct.Struct("!i")  # multiprocessing.connection's message header
_LONG_LENGTH = struct.Struct("!Q")


def poll_ms(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, math.ceil(timeout * 1000))


def check_spin(spin: object) -> tuple[float, bool]:
    """``spin=`` as ``(seconds, adaptive)`` ("auto": SPIN_AUTO, adaptive; False: 0; True:
    SPIN_DEFAULT), or a ValueError."""
    if spin == "auto":
        return SPIN_AUTO, True
    if spin is True:
        return SPIN_DEFAULT, False
    if spin is False or spin is None:
        return 0.0, False
    if isinstance(spin, (int, float)) and 0 <= spin <= 10:
        return float(spin), False
    raise ValueError(f'spin={spin!r} must be "auto", True, False or seconds to spin before sleeping (0 to 10)')


class SpinPolicy:
    """How long one end spins on the shared words before it sleeps in ``poll``.

    Fixed (``spin=`` seconds, True or False): that long, every wait.
    Adaptive (``spin="auto"``): up to ``seconds``, but only when the previous
    wait of this end was shorter than that; after a longer one the next wait
    sleeps at once, and a wait that again ends sooner (woken quickly) turns
    spinning back on. A stream of items closer together than ``seconds``
    then costs no sleep and no wakeup; sparse items cost no spinning.
    """

    __slots__ = ("adaptive", "quick", "seconds")

    def __init__(self, seconds: float, adaptive: bool) -> None:
        self.seconds = seconds
        self.adaptive = adaptive
        self.quick = True  # the first wait spins

    def budget(self) -> float:
        """Seconds to spin in the wait that starts now."""
        return self.seconds if self.quick or not self.adaptive else 0.0

    def waited(self, seconds: float) -> None:
        """A wait ended after ``seconds``."""
        self.quick = seconds < self.seconds

    @property
    def setting(self) -> float | str:
        """What ``spin=`` this is: "auto" or seconds."""
        return "auto" if self.adaptive else self.seconds


def send_frame(fd: int, message: bytes) -> None:
    """Write one message in multiprocessing's Connection framing (what ``send_bytes``
    writes, without its per-call overhead); raises OSError like it."""
    data = memoryview(_LENGTH.pack(len(message)) + message)
    while data:
        data = data[os.write(fd, data) :]


class Frames:
    """Messages in multiprocessing's Connection framing, read with one ``os.read`` per wakeup.

    Only used after registration, which goes through the Connection itself
    (it buffers nothing, so no byte is lost).
    """

    __slots__ = ("buf", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def read(self) -> bool:
        """Read what is available (blocks until something is); False at EOF."""
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def pop(self) -> bytes | None:
        """The next complete message, or None."""
        buf = self.buf
        if len(buf) < 4:
            return None
        (size,) = _LENGTH.unpack_from(buf)
        start = 4
        if size == -1:  # Connection's header for messages over 2 GiB
            if len(buf) < 12:
                return None
            (size,) = _LONG_LENGTH.unpack_from(buf, 4)
            start = 12
        end = start + size
        if len(buf) < end:
            return None
        message = bytes(buf[start:end])
        del buf[:end]
        return message
