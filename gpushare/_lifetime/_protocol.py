"""What both sides of the lifetime service agree on: record kinds, holder ids, timeouts, logging.

The wire messages themselves are listed in the package docstring
(:mod:`gpushare._lifetime`); this module holds the constants they use, the one
way either side warns from a thread, and this process's Owners by token: the
owner side registers each Owner here, and the consumer side looks here first
(a buffer unpickled in its owner's process needs no link), so the consumer
side does not import the owner side.
"""

from __future__ import annotations

import logging
import warnings

from .. import _journal

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["CLAIM", "LOCAL", "NUDGE", "RELEASE", "REQUEST_TIMEOUT", "RETIRE", "log", "owner_for", "owners", "warn"]

log = logging.getLogger("gpushare")

#: Holder id of a lease claimed inside the owner's own process (a buffer unpickled where it was made).
LOCAL = 0
#: The kinds of a consumer's lease records (the journal's own constants).
CLAIM, RELEASE = _journal.CLAIM, _journal.RELEASE
#: Signals to a consumer's record writer thread besides "records are waiting" (1) and "stop" (None):
NUDGE = -1  # tell the owner to read this consumer's journal
RETIRE = -2  # the owner is gone and nothing here uses it any more: close the link
#: Seconds a consumer waits for the owner to answer a request.
REQUEST_TIMEOUT = 30.0

#: This process's Owners by token (``_owner.Owner`` adds itself when made and removes itself at shutdown).
owners: dict[bytes, Any] = {}


def owner_for(token: bytes) -> Any:
    """This process's Owner with ``token``, or None when the owner is another process."""
    return owners.get(token)


def warn(message: str, category: type[Warning]) -> None:
    """Warn from any thread without letting a warnings filter kill that thread.

    The message also goes to the ``gpushare`` logger: a warning raised in a
    service thread is otherwise easy to miss.
    """
    log.warning(message)
    try:
        warnings.warn(message, category, stacklevel=3)
    except Warning:  # a filter turned it into an error: that must not end the thread
        pass
