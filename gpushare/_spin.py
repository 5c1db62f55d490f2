"""How a waiting end spins before it sleeps (:class:`SpinPolicy`): the Queue's ``get()`` and
both ends of the ring. The reasoning and the figures: dev/performance.md ("Spinning before a
get() sleeps")."""

from __future__ import annotations


class SpinPolicy:
    """How long one end spins on the shared words before it sleeps.

    Fixed (``adaptive`` false): ``seconds``, every wait.
    Adaptive: up to ``seconds``, but only when the previous wait of this end was
    shorter than that; after a longer one the next wait sleeps at once, and a wait
    that again ends sooner (woken quickly) turns spinning back on. A stream of items
    closer together than ``seconds`` then costs no sleep and no wake-up; sparse items
    cost no spinning. An end that sleeps stays asleep while its waits, wake-up included,
    are longer than ``seconds`` (why it does not spin again to find out: dev/design-notes.md,
    "The ring").
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
        """A wait that slept (or spun its whole budget) ended after ``seconds``."""
        self.quick = seconds < self.seconds

    @property
    def setting(self) -> float | str:
        """What ``spin=`` this is: "auto" or seconds."""
        return "auto" if self.adaptive else self.seconds
