"""The lifetime service: leases, recycling, and who may free what, when.

The driver's rule is that freeing exported memory before every importer
has closed it is undefined behaviour. This module makes the order explicit.

Owner side (:class:`Owner`, one per Manager, in the process that allocates)
---------------------------------------------------------------------------
* Every allocation is a *slot* with an id and a *generation* (bumped each
  time the pool hands the slot out again).
* The owner's own Buffers hold one *owner reference* on the slot.
* Each pickling of a buffer takes a *lease* on the slot (:meth:`Owner.take_lease`).
  The lease is *unclaimed* until the process that unpickles the buffer
  claims it over its authenticated connection; an unclaimed lease expires
  after ``lease_timeout`` seconds with a :class:`LeaseExpiredWarning`.
* A lease is released by its holder (``release()``, garbage collection,
  worker exit), or when the holder's connection closes: a SIGKILLed
  worker's socket closes at once, so nothing stays pinned.
* When a slot has neither an owner reference nor a lease it goes back to a
  size-class pool and is reused by the next allocation of that size.
* Memory is freed (``trim()``, shutdown, pool over its limit) only after
  every process that mapped it has unmapped: the owner sends ``unmap`` to
  each mapper and waits for ``unmapped``; a mapper that cannot unmap, or
  does not answer in time, makes the owner leak the slot rather than free
  memory someone may still reach.
* At shutdown the owner waits (bounded) for leases to come back, then
  reports what is still leased with a :class:`LeakWarning` naming it.

Consumer side (:class:`Link`, one per owner per process)
--------------------------------------------------------
* One authenticated Unix-socket connection to the owner (multiprocessing's
  HMAC challenge with the process authkey, both ways, before anything is
  unpickled) and a reader thread for replies and ``unmap`` requests.
* The first arrival of an allocation sends a ``claim`` and maps the memory
  while the owner answers; the mapping is used only once the claim is
  accepted (a refusal unmaps it and raises). The owner then counts this
  process among the allocation's mappers.
* Claims of allocations this process already maps, and all releases, are
  records in a shared-memory lease journal (:mod:`gpushare._journal`) that
  the owner reads when it needs to: a steady-state handoff sends no
  message and wakes no thread. A release may run inside the garbage
  collector, so recording never blocks: what cannot be written at once
  goes, in order, through a writer thread (which also nudges the owner
  when the journal fills). Without ``memfd_create`` the writer sends the
  same records as ``batch`` messages.
* Mappings are cached per allocation and *retained* after their last
  buffer goes, so a recycled allocation arrives with no new open; they are
  closed when the owner asks (``unmap``) or the process exits. The owner's
  ready events (a few per device, recorded in turn) are opened once per
  process.
* When the connection closes, the owner is gone: every buffer of that owner
  raises :class:`OwnerGoneError` when touched.

Wire messages are pickled tuples on an authenticated connection:
consumer -> owner ``("hello", pid, owner token, has_journal)`` (then, if it
has one, the journal's file descriptor by SCM_RIGHTS; a token that is not
this owner's is answered by ``("refused", message)`` and the connection
closed: the descriptor named another Manager), ``("claim", req, lease, alloc)``
(first arrival of an allocation: answered), ``("drain",)`` (read my
journal), ``("batch", [lease...], [lease...])`` (no journal: claims, then
releases), ``("lease", req, alloc, generation, lease it came under)``
(re-sharing: answered with the new lease; the re-sharing process records
its own ready event),
``("fd", req, alloc)``, ``("unmapped", alloc, ok)``; owner -> consumer
``("ok", req, value)``, ``("okfd", req, None)`` immediately followed on the
socket by one file descriptor (SCM_RIGHTS: the fd-based backends'
allocation or pool handle, sent only for an allocation the consumer holds
a lease on), ``("err", req, message)``, ``("claim_failed", lease, message)``
(an asynchronous claim was refused), ``("unmap", alloc)``, ``("bye", reason)``.
The owner reads a consumer's journal before it handles any message from
it, so records always count before whatever the consumer sent after them.

Where each part lives (the Owner and the Link are their parts stacked, each part a
class whose docstring states its share of the protocol):

* owner side: ``_pool`` (the owner's state and the size-class pool), ``_leases`` (the
  lease table; deferred finalizer work; reading the consumers' journals), ``_unmap``
  (the unmap protocol and freeing), ``_serve`` (the socket service loop, the message
  handler, housekeeping), ``_owner`` (``Owner``: allocation, owner references, stats,
  shutdown); ``_records`` holds the slot, lease and peer records;
* consumer side: ``_channel`` (requests, the reader thread, answering ``unmap``),
  ``_recorder`` (lease records: the journal writer and its backlog), ``_link``
  (``Link``: connecting, attaching descriptors, closing; ``attach`` and the per-process
  links);
* both: ``_common`` (constants, the ready events).

The service hands out :class:`~gpushare._memory.Memory` references; the layer above
(:mod:`gpushare._reduction`, the Manager) wraps them in Buffers.
"""

from __future__ import annotations

from ._common import LOCAL
from ._link import Link, attach, close_link, close_links, link_for, link_stats
from ._link import _links as _links  # tests read the open links
from ._owner import Owner, owner_for

__all__ = ["LOCAL", "Link", "Owner", "attach", "close_link", "close_links", "link_for", "link_stats", "owner_for"]
