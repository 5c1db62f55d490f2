"""Benchmarks: gpushare's buffer handoff against its floors and its peers.

A tool of the repository, not part of the library: it is not in the wheel,
and it imports gpushare as any user would, plus the private modules it
measures or reports on (``_cuda``, ``_backends``, ``torch._weights``). ``python -m bench``, from
the checkout's root (``make bench``; ``--quick`` for a short run, ``--help``
for the options), measures everything below in one run and writes three
files: into ``--out`` (default ``dev/benchmarks``), ``report.md`` (machine,
versions and one table per scenario: medians, p90 and ratios to the floor)
and ``report.json`` (every median, p90, mean and minimum, plus skip reasons,
errors and whether each target is met); and the plot ``benchmarks.png``
(latency against the number of consumers, one panel per fan-out scenario,
one line per system, the ring's panel with the Pipe floor and its targets;
skipped with a note when matplotlib does not import) to ``--plot``: by
default ``docs/assets/benchmarks.png``, which the user docs show, or next
to the reports when ``--out`` is given. A run kept on its own (one scenario
on one machine, say) goes in a folder of ``dev/benchmarks/runs/`` (``--out
dev/benchmarks/runs/<date>-<device>-<what>``); ``--render`` joins such runs'
JSON into one report.

gpushare is measured once per CUDA backend (``--backends``, default every
CUDA backend: ``cuda_ipc``, ``cuda_vmm``, ``cuda_pool``), each its own
column ("gpushare cuda_vmm") with its own ratio to the floor, in the same
run as the peers. The backend is chosen per allocation
(``Manager.empty(..., backend=name)``); a backend this machine cannot run
(``BackendUnavailableError``) is a skipped column with the reason.

What one iteration is, per scenario (one producer, N consumer processes):

``floors``
    A small tuple sent down one ``multiprocessing.Pipe`` per consumer, or
    put N times on one ``multiprocessing.Queue`` read by N consumers; each
    consumer acks (on its pipe, or on one ack queue) and the producer
    waits for every ack. No handoff can cost less than this notification,
    so every other table is read as a ratio to the Queue floor (``ring``:
    to the Pipe floor, whose acks it shares).
``startup``
    Not an iteration: what a script meets before any buffer moves, each row timed in
    fresh interpreters against the stdlib's spawn start method, the systems of a row
    alternating. ``import gpushare`` against ``import multiprocessing`` (and ``pass``):
    whole interpreters, timed around ``subprocess.run``. In small scripts run as their own
    interpreters (their targets defined in the script, which a spawned child re-imports):
    ``mp.Process(target=target)`` start+join and ``mp.Manager()`` start+shutdown, several
    per script, each script's first pair its own row (``... first in a new
    interpreter``); the first 2 MiB host buffer from ``m.empty()`` to a consumer started
    before timing, against a small tuple on the stdlib's Queue. With a GPU,
    ``Process(device=0)`` start+join and the first device buffer (cold: the producer's
    context creation included) next to a CUDA context made alone with cuda.bindings.
    Targets, met / not met per row: import <= 1.5x, Process start+join <= 1.25x,
    Manager start+shutdown <= 1.5x the stdlib; none on the GPU rows.
``handoff_recycled`` / ``handoff_fresh``
    The Queue-floor pattern carrying a 1 MiB buffer instead of the tuple:
    the producer puts the buffer once per consumer; a consumer gets it,
    touches its device pointer, lets it go and acks. Systems: gpushare,
    one column per backend (``Manager.empty(..., backend=name)``;
    consumers ``buf.ptr`` then ``buf.release()``), ``torch.multiprocessing``
    (a CUDA tensor; ``t.data_ptr()`` then ``del t``) and cuda.core (a
    buffer of an IPC-enabled ``DeviceMemoryResource``, which cuda.core
    pickles itself; the memory resource is handed to each consumer at
    spawn). *recycled* puts the same buffer every iteration; *fresh*
    allocates one per iteration and drops it after the acks (each
    library's pool or caching allocator recycles the memory, as it would
    in a pipeline).
``handoff_per_queue``
    The recycled handoff with one Queue per consumer (what fan-out scripts
    often write): the producer puts the same buffer once on each
    consumer's own Queue and waits for every ack. Its floor is the same
    pattern carrying the small tuple (``mp.Queue per consumer``); every
    system (gpushare per backend, torch.multiprocessing, cuda.core) is
    read as a ratio to it.
``ring``
    Fan-out through a ring (``manager.ring(shape, "float32", device=...,
    slots=4, consumers=N, backend=name)``, 1 MiB float32 slots), one column
    per backend, made once per cell and passed to each consumer as its
    Process argument (each unpickling registers one consumer). One
    iteration: ``buf = ring.acquire()``, ``ring.publish(buf)``, then one ack
    from every consumer, each on its own spawn-context ``multiprocessing.Pipe``
    exactly like the Pipe floor's ack; a consumer takes the item with
    ``ring.get()``, reads ``item.ptr``, gives it back with ``item.release()``,
    then acks. Ratios are to the *Pipe* floor. Targets, printed per row
    with met / not met: 1 consumer <= 1.0x the Pipe floor; 4 consumers
    <= 60 us; 8 consumers <= 100 us.
``ring_roundtrip``
    The ring's fan-out with its own acks, no Pipe: a 1-slot ring to N
    consumers, so each ``ring.acquire()`` waits until every consumer
    released the item published before; plain and *spin* columns per
    backend, shown against the Pipe floor at the same N. The spin columns
    are judged: 10 us at 1 consumer, the fan-out targets (60 us, 100 us) at
    4 and 8.
``throughput``
    Pipelined handoffs per second to one consumer, the producer never
    waiting for each ack, for a 1 MiB and a 64 MiB buffer: the ring (4 slots;
    the producer acquires and publishes as fast as released slots allow, the
    consumer gets, touches, releases and acks only at the end of each timed
    repeat), gpushare through its Queue (the same recycled buffer put again
    and again), ``torch.multiprocessing`` through its Queue (a recycled CUDA
    tensor; GPU only) and the plain ``multiprocessing.Queue`` floor (a small
    tuple). The Queue systems keep at most 8 items put and not yet acked;
    their consumer acks every 4 items with its count on a Pipe. Items/s over
    a fixed count (2000 items, 1000 with ``--quick``) after a warm-up, per
    repeat (5, 3 with ``--quick``); the table shows the median repeat.
    Targets at 1 MiB: the ring >= 100,000 handoffs/s, gpushare's Queue >=
    30,000.
``first_share``
    Time from ``m.empty()`` of a fresh allocation through one consumer
    mapping it and acking, one column per backend. Between iterations (not
    timed) the producer waits for the consumer's lease to come back and
    calls ``m.trim()``, so every iteration allocates, exports and maps new
    memory. The ratios divide by the bare legacy IPC sequence (``raw
    driver``: cuMemAlloc, cuIpcGetMemHandle, the handle through a Queue,
    cuIpcOpenMemHandle, ack), which the target judges; each other mechanism's
    own bare sequence runs next to it (``raw driver, VMM fd``: create, map,
    export an fd, one SCM_RIGHTS message, import and map; ``raw driver, IPC
    pool``: allocate from an IPC pool imported before timing, export the
    pointer, import it), with a ratio column of its backend to it.
``peer_read``
    Only with two or more GPUs and torch. Per backend, the producer fills a
    1 GiB float32 buffer on cuda:0 and sends it to one consumer started
    with ``Process(device=1)``. The consumer views it with
    ``torch.as_tensor(buf, device="cuda:0")`` (the memory's own GPU; the
    view must alias the mapping, else the cell fails) and times
    ``dst.copy_(src)`` into a cuda:1 tensor with CUDA events on the
    destination's stream, median of 20 copies (5 with ``--quick``), as GB/s
    of bytes copied once. The reference, in the same consumer and
    interleaved copy by copy: the same copy from a plain torch tensor the
    consumer allocated on cuda:0 (the NVLink rate). Also a local copy
    (cuda:0 -> cuda:0) of both. The mapped buffer should read at >= 0.90 of
    the plain tensor's rate. The consumer checks the copies hold the
    producer's fill, releases the buffer and drops its tensors before it
    answers.
``kernel_read``
    Only with a GPU and torch. Per backend, the producer fills a 1 GiB
    float32 buffer on cuda:0 and sends it to one consumer on the same GPU
    (``Process(device=0)``), which views it with ``x = torch.from_dlpack(buf)``
    (checked to alias the mapping, float32, the buffer's shape) and times
    ``x.sum()`` with CUDA events on the current stream, interleaved with the
    same reduction over ``torch.empty_like(x)`` filled by the consumer
    itself: median of 10 after 3 warm-up rounds (5 after 2 with ``--quick``).
    Read bandwidth is bytes / median time, for both; the mapped buffer
    should read at >= 0.97 of the local tensor's rate. Both sums are checked
    against the 1.0 fills; the consumer drops its tensors and releases the
    buffer before it answers.
``weight_sync`` / ``weight_sync_8b``
    Only with a GPU and torch. A trainer hands a Llama-shaped bf16 state
    dict (TinyLlama-1.1B: 201 tensors, 2.2 GB; Llama-3-8B: 291 tensors,
    16 GB) to N engine processes on its GPU (rows: 1, 2, 4, 8 engines), one
    sync per iteration, every system counting the trainer's own packing or
    copying: ``local copy`` (the floor: each engine copies from a bucket of
    its own), ``torch per-tensor`` (``reduce_tensor`` per tensor per sync,
    ``ipc_collect``), ``torch flattened bucket`` (a new ``torch.cat`` bucket
    per sync), ``torch kept bucket`` (one bucket, its handle kept),
    ``gpushare copy`` (``publish_state_dict``, engines ``snap.copy_to``),
    ``gpushare zero-copy`` (until every engine holds the new snapshot) and
    ``gpushare in-place publish`` (draft, one small write, publish: the
    trainer's call). Engines ``copy_`` per tensor and synchronize before they
    ack. Cells whose estimated device memory does not fit in the free memory
    are skipped with that reason (never attempted); device memory per cell
    and its growth over the timed syncs go in a table below. Targets per row
    (``Goal``): copy <= 1.2x the floor, >= 4x faster than per-tensor and
    >= 1.1x faster than the best torch pattern; zero-copy <= the floor at
    1 engine; in-place publish <= 100 us. Engines' final weights are
    checksummed against the trainer's.
``dataloader_gpu_samples``
    Only with a GPU and torch. gpushare.torch.DataLoader against torch's,
    samples made on the GPU in the workers, 64 per batch; 4 and 8 workers,
    4 and 16 MiB batches, a new loader per epoch or one persistent loader.
    Time per batch (chunks of 10 timed whole), time to the first batch (a
    companion table, ``dataloader_gpu_samples_first``), batches/s, and the
    device's used memory at the end of each epoch (trainer and workers)
    with its growth; 20 new-loader epochs in the 4-worker, 4 MiB cell judge
    that memory stays flat. Targets: time per batch and first batch <=
    torch's, device memory <= torch's and flat.
``dataloader_cpu_samples``
    Only with a GPU and torch. 3x224x224 uint8 and float32 images made on
    the CPU in 4 or 8 workers, 64 per batch, for a GPU trainer: torch's
    ``pin_memory=True`` and ``.cuda(non_blocking=True)`` against
    gpushare.torch.DataLoader(device="cuda") (page-locked staging in the
    workers, asynchronous copies into GPU slots). Time per batch, time to
    the first batch (``dataloader_cpu_samples_first``), page-locked host
    memory and device memory; every batch checked on the GPU. Targets:
    >= 1.2x torch's batches/s, first batch <= torch's, staging <= torch's
    pinned buffers.
``torch_mp``
    Only with a GPU and torch. ``import torch.multiprocessing as mp`` against ``import
    gpushare.torch.multiprocessing as mp``: a 1 MiB and a 64 MiB float32 CUDA tensor through
    one Queue per consumer (``handoff_per_queue``'s pattern: the producer puts it on each
    consumer's Queue and waits for every ack; a consumer reads ``t.data_ptr()``, drops it,
    acks), *recycled* (the same tensor) and *fresh* (``torch.empty`` per iteration), to 1, 4
    and 8 consumers (``--consumers`` when given): one table per size and case
    (``torch_mp_1mib_recycled`` ... ``torch_mp_64mib_fresh``), torch's column as the floor.
    Targets: recycled <= 0.5x torch's time, fresh <= 1x. ``torch_mp_memory``: 1,000 sends
    of a fresh 1 MiB tensor to one consumer, the producer's ``memory_allocated()`` before,
    ``max_memory_allocated()`` over them, and the allocated memory at the last ack and 2 s
    later; target: gpushare's peak <= 16 MiB above its start. No ``ipc_collect()`` anywhere.
    Importing gpushare.torch.multiprocessing changes how the whole process pickles tensors, so
    each cell runs in a spawned producer process of its own that imports only its system's
    module, its consumers too, and each checks the reducer registered for ``torch.Tensor``.
``host``
    A 64 MiB float32 array on the host backend (always runs, GPU or not):
    a gpushare host buffer written in place, the same buffer refilled with
    ``copy_from`` every iteration, and a plain ``multiprocessing.Queue``
    carrying the NumPy array itself (a pickled copy per consumer).
    Consumers touch the first element.

How: everything uses the spawn start method. Consumers are module-level
functions, started once per (scenario, system, N), reused across
iterations, told to stop with a sentinel and always joined with a timeout
(then terminated, then killed). After a warm-up, each iteration is timed
with ``time.perf_counter_ns`` around "produce, put N times, collect N
acks", with the garbage collector off in the producer while timing.
Large transfers (64 MiB and up) run fewer iterations. A peer that cannot
run here (not importable, no GPU, one GPU for ``peer_read``) is recorded
as skipped with the reason; an error in one cell is recorded as that
cell's error and the run goes on. Every wait has a timeout: a consumer that
dies or stops answering fails its cell, not the run. ``throughput`` times
whole repeats (one sample per repeat: elapsed time / items) instead of
single iterations.

``--rounds N`` runs every cell N times, interleaved (all cells in the
planned order, then all again), and pools each cell's samples over its
rounds: a floor and the systems divided by it are then measured across
the same stretch of the run, so a drift of the machine (a neighbour, a
clock change) moves both sides of a ratio instead of one. The reports are
rewritten after every round, and ``--max-seconds`` starts no round that
would end past it at the pace of the rounds so far, so a run cut short
keeps the rounds it finished.

Layout (``bench/``): ``cli`` (the command line and ``main``), ``runner``
(``Bench``: probe, plan, run), ``scenarios/`` (the registry and one module per scenario
family), ``patterns`` (the handoff patterns scenarios are made of), ``peers`` (the
floors, torch.multiprocessing, cuda.core), ``consumers`` (the functions the spawned
consumers run), ``harness`` (timing, readiness, acks, stopping), ``results`` (series,
scenarios, tasks), ``stats`` (``Cell``, ``Target``), ``settings`` (every constant, ``Config``),
``fmt`` and the writers ``report_md``, ``report_json`` and ``report_plot``.

Beyond the per-row ``targets``, a scenario may list ``goals`` (``results.Goal``: one system at
one row, against the floor, the fastest of other systems, or in microseconds; several per row),
mark single cells skipped (``bench.task(..., skip, cell=True)``: the rest of the column runs) and
put figures per cell in ``details["memory"]``, which the markdown shows as a table.

Adding a scenario: write ``bench/scenarios/<name>.py`` with

- ``KEYS = ("<key>",)``: the scenario key(s) it adds (``--only`` accepts them);
- ``plan(bench)``: ``if bench.add(Scenario(key, title, row_label, rows, ...)):`` then one
  ``bench.task(key, system, row, _bind(run, bench, *args), skip)`` per cell, where
  ``run(bench, *args)`` returns the samples in ns (``list[int]``; or ``{system: samples}``
  for a task that fills a whole row with ``system=None``) and ``skip`` is None or the reason
  the cell cannot run here (``bench.gpu_reason``, ``peers.torch_skip(bench)``, ...);
- ``run`` built from ``patterns`` (``queue_fanout(bench, ctx, n, kind, produce)`` is the
  Queue fan-out: put one item N times, collect N acks) or from ``harness`` directly, its
  consumers module-level functions (in ``consumers`` or in the scenario module: spawn
  imports them by module name);
- optionally ``HOW``: a paragraph for the report's "How measured";

then add its name to ``MODULES`` in ``bench/scenarios/__init__.py``: that line
decides where it runs and where its table appears. A ``Scenario`` of kind ``latency``
(the default) needs nothing else: the markdown, JSON and plot writers lay it out.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
