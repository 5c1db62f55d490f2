"""Limits of both fan-outs, and how a waiting end spins before it sleeps (``spin=``)."""

from __future__ import annotations

import math

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
#: apart than this cost no spinning (see gpushare._spin.SpinPolicy).
SPIN_AUTO = 50e-6
#: A spinning end gives its core away (``sched_yield``) once every this many looks at
#: the shared words: a yield is a system call, costlier than a look, and the other
#: process's store is seen only at the next look after it.
SPIN_LOOKS = 4
MAX_SLOTS = 1 << 16
MAX_META = 1 << 20


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
