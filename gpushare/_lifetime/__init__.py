"""The lifetime service: leases, recycling, and who may free what, when.

The driver's rule is that freeing exported memory before every importer
has closed it is undefined behaviour. This module makes the order explicit.

Owner side (:class:`Owner`, one per Manager, in the process that allocates)
---------------------------------------------------------------------------
* Every allocation has an id and a *generation* (bumped each time the pool
  hands it out again).
* The owner's own Buffers hold one *owner reference* on the allocation.
* Each pickling of a buffer takes a *lease* on the allocation (``Owner.leases.take``).
  The lease is *unclaimed* until the process that unpickles the buffer
  claims it over its authenticated connection; an unclaimed lease expires
  after ``lease_timeout`` seconds with a :class:`LeaseExpiredWarning`.
* A lease is released by its holder (``release()``, garbage collection,
  worker exit), or when the holder's connection closes: a SIGKILLed
  worker's socket closes at once, so nothing stays pinned.
* When an allocation has neither an owner reference nor a lease it goes back
  to a size-class pool and is reused by the next allocation of that size.
* Memory is freed (``trim()``, shutdown, pool over its limit) only after
  every process that mapped it has unmapped: the owner sends ``Unmap`` to
  each mapper and waits for ``Unmapped``; a mapper that cannot unmap, or
  does not answer in time, makes the owner leak the allocation rather than free
  memory someone may still reach.
* At shutdown the owner waits (bounded) for the leases of other processes
  to come back, then reports what is still leased with a :class:`LeakWarning`
  naming it. Memory still used in its own process (its own buffers, and
  leases it claimed itself) stays valid there and is freed when released.

Consumer side (:class:`Link`, one per owner per process)
--------------------------------------------------------
* One authenticated Unix-socket connection to the owner (multiprocessing's
  HMAC challenge with the process authkey, both ways, before anything is
  unpickled) and a reader thread for replies and ``Unmap`` requests.
* The first arrival of an allocation sends a ``Claim`` and maps the memory
  while the owner answers; the mapping is used only once the claim is
  accepted (a refusal unmaps it and raises). The owner then counts this
  process among the allocation's mappers.
* Claims of allocations this process already maps, and all releases, are
  records in a shared-memory lease journal (:mod:`._protocol`) that
  the owner reads when it needs to: a steady-state handoff sends no
  message and wakes no thread. A release may run inside the garbage
  collector, so recording never blocks: what cannot be written at once
  goes, in order, through a writer thread (which also nudges the owner
  when the journal fills). Without ``memfd_create`` the writer sends the
  same records as ``Batch`` messages.
* Mappings are cached per allocation and *retained* after their last
  buffer goes, so a recycled allocation arrives with no new open; they are
  closed when the owner asks (``Unmap``: the writer thread closes them and
  answers, so the reader goes on delivering replies meanwhile) or the process
  exits. The owner's ready events (a few per device, recorded in turn) are
  opened once per process.
* When the connection closes, the owner is gone: every buffer of that owner
  raises :class:`OwnerGoneError` when touched.

The messages both sides exchange are :mod:`._protocol`'s (``LEASE``: one
NamedTuple per message, on :mod:`gpushare._service`'s message layer), and so is the
journal's format: the records stand in for messages.

Where each part lives. Both sides are objects composed of parts, each with
its own state and methods (no part is a base class of another):

* owner side: :class:`Owner` (``_owner``: allocation, the owner's own
  references, stats, shutdown) holds an :class:`~._records.AllocationPool`,
  a :class:`~._records.LeaseTable` (leases, the journals, deferred
  finalizer work), an :class:`~._unmapper.Unmapper` (the unmap protocol and
  freeing) and a :class:`~._request_loop.RequestLoop` (the socket service and
  housekeeping), which adds and removes the connected
  :class:`~._records.Consumers`; each part owns its facts and asks the others
  for theirs, under one lock (:class:`~._records.OwnerState`, which still
  holds the allocation table); ``_records`` holds the allocation, lease and
  peer records and the tables of them: the allocation table, the pool, the
  lease table and the consumers;
* consumer side: :class:`Link` (``_link``: attaching descriptors, the mapping
  cache, closing, requests; the handler of its :class:`~gpushare._service.Client`)
  holds a :class:`~._link.LeaseRecorder` (lease records, the writer thread), in the same module;
* both: ``_protocol`` (the messages, the journal, constants, warnings) and ``_ready`` (ready events).

The service hands out :class:`~gpushare._memory.Memory` references; the layer above
(:mod:`gpushare._buffer`, the Manager) wraps them in Buffers.

This package's own names are the consumer side's (and :func:`owner_for`): a process
that only receives buffers loads none of the owner side. Whoever makes an Owner
imports it from :mod:`~gpushare._lifetime._owner`.
"""

from __future__ import annotations

from ._link import (
    Link,
    arrival_parts,
    arrival_source,
    attach,
    close_link,
    close_links,
    link_for,
    link_stats,
    links,
    release_in_c,
)
from ._protocol import CLAIM, LOCAL, NUDGE, RELEASE, journal_layout, owner_for

__all__ = [
    "CLAIM",
    "LOCAL",
    "NUDGE",
    "RELEASE",
    "Link",
    "arrival_parts",
    "arrival_source",
    "attach",
    "close_link",
    "close_links",
    "journal_layout",
    "link_for",
    "link_stats",
    "links",
    "owner_for",
    "release_in_c",
]
