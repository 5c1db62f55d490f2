"""gpushare.queues: :mod:`multiprocessing.queues`, with gpushare's queues.

gpushare's in the stdlib's place: ``Queue`` and ``JoinableQueue`` (pickle
in ``put()``; ``get()`` ends with OwnerGoneError once the creator is gone)
and ``SimpleQueue``; all three pickle their items as a Process's arguments
are, lambdas and closures included (see :mod:`gpushare._queues`). As in
multiprocessing, they take ``ctx=``: ``gpushare.Queue()`` and the like make
them with gpushare's default context. The rest is multiprocessing's, by the
rule of :mod:`gpushare._mirror`.
"""

from __future__ import annotations

from multiprocessing import queues as _stdlib

from ._mirror import mirror as _mirror
from ._queues import JoinableQueue as JoinableQueue
from ._queues import Queue as Queue
from ._queues import SimpleQueue as SimpleQueue

__all__ = _mirror(globals(), _stdlib)
