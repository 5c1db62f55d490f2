"""Fan-out: one producer's slots, held by many readers; the ring and the tensor set on top.

The mechanism: :mod:`._slots` (slots that readers hold, given back by release
words and events), :mod:`._registry` (the socket side: its messages, and registering readers),
:mod:`._channel` (one reader's
shared memory). Two policies over it:

* the ring (:mod:`._ring`, :mod:`._ring_producer`, :mod:`._consumer`,
  :mod:`._item`): every consumer gets every slot, in order, with back-pressure;
* the tensor set (:mod:`._tensor_set`, :mod:`._set_producer`,
  :mod:`._tensor_reader`, :mod:`._views`, :mod:`._layout`, :mod:`._copy`):
  readers take the latest version.

A *slot* is one of the producer's buffers; a *version* is the number of a tensor
set's publication. dev/design-notes.md ("The fan-out") has the protocol and why it is safe.
"""

from ._channel import Channel
from ._consumer import RingConsumer
from ._item import RingItem
from ._layout import ALIGN, Layout, TensorSpec, make_layout
from ._ring import Ring, create_ring
from ._ring_producer import RingProducer
from ._set_producer import SetProducer
from ._tensor_reader import Snapshot, TensorSetReader
from ._tensor_set import Draft, TensorSet, create_tensor_set
from ._views import TensorView
from ._wire import MAX_META, REGISTER_TIMEOUT, SEND_TIMEOUT, SPIN_DEFAULT

__all__ = [
    "ALIGN",
    "MAX_META",
    "REGISTER_TIMEOUT",
    "SEND_TIMEOUT",
    "SPIN_DEFAULT",
    "Channel",
    "Draft",
    "Layout",
    "Ring",
    "RingConsumer",
    "RingItem",
    "RingProducer",
    "SetProducer",
    "Snapshot",
    "TensorSet",
    "TensorSetReader",
    "TensorSpec",
    "TensorView",
    "create_ring",
    "create_tensor_set",
    "make_layout",
]
