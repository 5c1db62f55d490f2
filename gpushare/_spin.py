"""How a waiting end spins before it sleeps (:class:`SpinPolicy`): the Queue's ``get()`` and
both ends of the ring. The reasoning and the figures: dev/performance.md ("Spinning before a
get() sleeps")."""

from __future__ import annotations

#: An adaptive end that has slept through this many waits in a row spins through the next
#: one anyway: see SpinPolicy.
PROBE_EVERY = 8


class SpinPolicy:
    """How long one end spins on the shared words before it sleeps.

    Fixed (``adaptive`` false): ``seconds``, every wait.
    Adaptive: up to ``seconds``, but only when the previous wait of this end was
    shorter than that; after a longer one the next wait sleeps at once, and a wait
    that again ends sooner (woken quickly) turns spinning back on. A stream of items
    closer together than ``seconds`` then costs no sleep and no wake-up; sparse items
    cost one spin in ``PROBE_EVERY + 1`` waits. After ``PROBE_EVERY`` sleeping waits in a row the next one spins
    again: where both ends of a stream wait for each other, each end's wake-up adds to
    the other's wait, so a stream that would come quicker than ``seconds`` while both
    spin can come slower while both sleep, and would stay asleep for good.
    """

    __slots__ = ("adaptive", "naps", "quick", "seconds")

    def __init__(self, seconds: float, adaptive: bool) -> None:
        self.seconds = seconds
        self.adaptive = adaptive
        self.quick = True  # the first wait spins
        self.naps = 0  # long waits in a row since the last spin

    def budget(self) -> float:
        """Seconds to spin in the wait that starts now."""
        if self.quick or not self.adaptive or self.naps >= PROBE_EVERY:
            return self.seconds
        return 0.0

    def waited(self, seconds: float) -> None:
        """A wait that slept (or spun its whole budget) ended after ``seconds``."""
        self.quick = seconds < self.seconds
        self.naps = 0 if self.quick or self.naps >= PROBE_EVERY else self.naps + 1

    @property
    def setting(self) -> float | str:
        """What ``spin=`` this is: "auto" or seconds."""
        return "auto" if self.adaptive else self.seconds
