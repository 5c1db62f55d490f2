/* The Queue region's two hot operations in C: one put and one get of a message that fits
 * the ring, each a single call of the extension type ``Ring`` (in the compiled core,
 * ``gpushare._core``: _core.c; built with the package by setup.py, loaded by gpushare._native).
 *
 * Same layout and commit protocol as gpushare._queues.Region (its constants are passed in,
 * never restated here): a record "length, kind, payload" written into the byte ring, then
 * the side's state written into its inactive copy, then the 4-byte commit word. Anything
 * but the plain case (the lock busy, a payload to spill) returns at once with nothing
 * changed, and the caller takes the Python path, which handles it; a lock left by a dead
 * holder is taken over as the Python path takes it. The lock is held only inside one call,
 * with the GIL: no Python code (no signal handler, no other thread of this process) runs
 * while it is held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct gsq_layout {          /* one region as mapped in this process */
    char *base;              /* the mapping */
    uint64_t cap;            /* the ring's bytes */
    uint64_t spill_over;     /* a payload over this is spilled: Python's path */
    uint64_t header;         /* where the ring starts */
    uint64_t pseq, cseq;     /* commit words */
    uint64_t get_waiters, put_waiters;
    uint64_t backlogged;     /* messages counted in processes' backlogs (8 bytes, under the producers' lock) */
    uint64_t p_at[2], c_at[2];
    uint64_t plock, clock;   /* the producers' and consumers' mutexes (the same one in one-lock mode) */
};

/* A put's answers are Region.try_put's (0 written, 1 FULL, 2 NO_ROOM); then the two of
 * gpushare._native: EMPTY (a get found nothing) and PYTHON (the Python path's turn). */
enum { GSQ_FULL = 1, GSQ_NO_ROOM = 2, GSQ_EMPTY = -1, GSQ_PYTHON = -2 };

static inline uint32_t load32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
static inline uint64_t load64(const char *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
static inline void store64(char *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }

/* The other side's state, read without its lock: the copy's closing seq, the three fields,
 * then its opening seq, until both agree. The writer stores them in the other order (opening,
 * fields, closing), so a copy rewritten under the reader shows two seqs that differ. */
static void snapshot(const struct gsq_layout *r, uint64_t seq_at, const uint64_t at[2], uint64_t out[3])
{
    for (;;) {
        const char *copy = r->base + at[load32(r->base + seq_at) & 1];
        uint64_t last = load64(copy + 32);
        out[0] = load64(copy + 8);
        out[1] = load64(copy + 16);
        out[2] = load64(copy + 24);
        if (load64(copy) == last)
            return;
    }
}

/* Write a side's new state into its inactive copy, then commit (the one store readers key on). */
static void commit(const struct gsq_layout *r, uint64_t seq_at, const uint64_t at[2], uint32_t seq,
                   uint64_t a, uint64_t b, uint64_t c)
{
    uint32_t next = seq + 1;
    char *copy = r->base + at[next & 1];
    store64(copy, next);
    store64(copy + 8, a);
    store64(copy + 16, b);
    store64(copy + 24, c);
    store64(copy + 32, next);
    __atomic_store_n((uint32_t *)(r->base + seq_at), next, __ATOMIC_RELEASE);
}

/* The lock if it is free at once (1), else 0 with it not held. A dead holder's lock comes
 * back held (EOWNERDEAD): what it left is the last commit, so it is marked consistent and
 * used, as the Python path does. */
static int take(pthread_mutex_t *lock)
{
    int err = pthread_mutex_trylock(lock);
    if (err == EOWNERDEAD) {
        pthread_mutex_consistent(lock);
        return 1;
    }
    return err == 0;
}

static void wake(const struct gsq_layout *r, uint64_t word_at, uint64_t waiters_at, int count, uint64_t lock_at)
{
    /* Read after the unlock (a full barrier on x86-64), so after the commit: a waiter that
     * counted itself before this read is woken; one that counts itself later sees the commit. */
    if (load32(r->base + waiters_at)) {
        long woken = syscall(SYS_futex, (uint32_t *)(r->base + word_at), FUTEX_WAKE, count, NULL, NULL, 0);
        if (woken == 0) {
            /* Nobody asleep: a counted waiter not asleep yet sees the commit and does not sleep,
             * so the count is stale (a waiter killed asleep) and goes, under the lock it is kept
             * under, if that is free at once. */
            pthread_mutex_t *lock = (pthread_mutex_t *)(r->base + lock_at);
            if (take(lock)) {
                __atomic_store_n((uint32_t *)(r->base + waiters_at), 0, __ATOMIC_RELEASE);
                pthread_mutex_unlock(lock);
            }
        }
    }
}

/* Put one record: 0 when written and committed; GSQ_FULL (maxsize messages, counting those
 * in every process's backlog), GSQ_NO_ROOM (not in the ring now) or GSQ_PYTHON (the lock not
 * free at once, or a payload to spill) with nothing written. */
static int gsq_put(const struct gsq_layout *r, const char *payload, uint32_t size, uint32_t kind, uint32_t task,
            uint64_t maxsize)
{
    if (size > r->spill_over)
        return GSQ_PYTHON;
    pthread_mutex_t *lock = (pthread_mutex_t *)(r->base + r->plock);
    if (!take(lock))
        return GSQ_PYTHON;
    uint32_t seq = load32(r->base + r->pseq);
    const char *mine = r->base + r->p_at[seq & 1];   /* only lock holders write it */
    uint64_t tail = load64(mine + 8), nput = load64(mine + 16), tasks = load64(mine + 24);
    uint64_t theirs[3];
    snapshot(r, r->cseq, r->c_at, theirs);           /* head, messages taken, tasks done */
    if (maxsize && nput + load64(r->base + r->backlogged) - theirs[1] >= maxsize) {
        pthread_mutex_unlock(lock);
        return GSQ_FULL;
    }
    uint64_t need = ((uint64_t)size + 15) & ~(uint64_t)7;
    uint64_t at = tail % r->cap;
    uint64_t skip = r->cap - at < need ? r->cap - at : 0;
    if ((tail - theirs[0]) + skip + need > r->cap) {
        pthread_mutex_unlock(lock);
        return GSQ_NO_ROOM;
    }
    char *ring = r->base + r->header;
    if (skip) {
        uint32_t wrap[2] = {0, 1};                   /* length 0, KIND_WRAP */
        memcpy(ring + at, wrap, 8);
        at = 0;
    }
    uint32_t record[2] = {size, kind};
    memcpy(ring + at, record, 8);
    memcpy(ring + at + 8, payload, size);
    commit(r, r->pseq, r->p_at, seq, tail + skip + need, nput + 1, tasks + task);
    pthread_mutex_unlock(lock);
    wake(r, r->pseq, r->get_waiters, 1, r->clock);
    return 0;
}

/* Take the oldest record: its payload as a new bytes object (kind in *kind, with 4 (DRAINED)
 * added when it was the last one committed), or NULL with *code GSQ_EMPTY or GSQ_PYTHON (the
 * lock not free at once, or a spilled record, which the Python path takes) and nothing taken; NULL with
 * *code 0 when the bytes could not be made (a Python error is set, nothing taken). */
static PyObject *gsq_get(const struct gsq_layout *r, uint32_t *kind, int *code)
{
    uint64_t theirs[3], ours[3];
    snapshot(r, r->pseq, r->p_at, theirs);           /* tail, messages put, tasks put */
    snapshot(r, r->cseq, r->c_at, ours);
    *code = GSQ_EMPTY;
    if (ours[0] >= theirs[0])
        return NULL;                                 /* as far as can be seen without the lock */
    pthread_mutex_t *lock = (pthread_mutex_t *)(r->base + r->clock);
    *code = GSQ_PYTHON;
    if (!take(lock))
        return NULL;
    uint32_t seq = load32(r->base + r->cseq);
    const char *mine = r->base + r->c_at[seq & 1];
    uint64_t head = load64(mine + 8), nget = load64(mine + 16), done = load64(mine + 24);
    snapshot(r, r->pseq, r->p_at, theirs);
    if (head >= theirs[0]) {
        pthread_mutex_unlock(lock);
        *code = GSQ_EMPTY;
        return NULL;
    }
    const char *ring = r->base + r->header;
    uint64_t at = head % r->cap;
    uint32_t record[2];
    memcpy(record, ring + at, 8);
    if (record[1] == 1) {                            /* KIND_WRAP: the record starts the ring */
        head += r->cap - at;
        at = 0;
        memcpy(record, ring, 8);
    }
    if (record[1] == 2) {                            /* KIND_SPILL: its reader locks its pages first */
        pthread_mutex_unlock(lock);
        return NULL;                                 /* GSQ_PYTHON */
    }
    PyObject *payload = PyBytes_FromStringAndSize(ring + at + 8, record[0]);
    if (payload == NULL) {
        pthread_mutex_unlock(lock);
        *code = 0;
        return NULL;
    }
    head += ((uint64_t)record[0] + 15) & ~(uint64_t)7;
    commit(r, r->cseq, r->c_at, seq, head, nget + 1, done);
    pthread_mutex_unlock(lock);
    wake(r, r->cseq, r->put_waiters, 0x7FFFFFFF, r->plock);
    *kind = record[1] | (head >= theirs[0] ? 4 : 0); /* DRAINED: nothing more was committed */
    return payload;
}

/* -- the extension type ------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *keep;          /* what keeps the mapping in place (an export of it) */
    struct gsq_layout layout;
} Ring;

/* Ring(keep, base, cap, spill_over, header, pseq, cseq, get_waiters, put_waiters, backlogged,
 *      p_at0, p_at1, c_at0, c_at1, plock, clock) */
static int Ring_init(Ring *self, PyObject *args, PyObject *kwds)
{
    PyObject *keep;
    unsigned long long v[15];
    if (!PyArg_ParseTuple(args, "OKKKKKKKKKKKKKKK", &keep, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                          &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14]))
        return -1;
    Py_INCREF(keep);
    Py_XSETREF(self->keep, keep);
    struct gsq_layout *r = &self->layout;
    r->base = (char *)(uintptr_t)v[0];
    r->cap = v[1];
    r->spill_over = v[2];
    r->header = v[3];
    r->pseq = v[4];
    r->cseq = v[5];
    r->get_waiters = v[6];
    r->put_waiters = v[7];
    r->backlogged = v[8];
    r->p_at[0] = v[9];
    r->p_at[1] = v[10];
    r->c_at[0] = v[11];
    r->c_at[1] = v[12];
    r->plock = v[13];
    r->clock = v[14];
    (void)kwds;
    return 0;
}

/* put(payload, kind, task, maxsize) -> 0, FULL, NO_ROOM or PYTHON */
static PyObject *Ring_put(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "put(payload: bytes, kind, task, maxsize)");
        return NULL;
    }
    unsigned long kind = PyLong_AsUnsignedLong(args[1]);
    unsigned long task = PyLong_AsUnsignedLong(args[2]);
    unsigned long long maxsize = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    if ((uint64_t)size > UINT32_MAX)
        return PyLong_FromLong(GSQ_PYTHON);
    return PyLong_FromLong(gsq_put(&self->layout, PyBytes_AS_STRING(args[0]), (uint32_t)size, (uint32_t)kind,
                                   (uint32_t)task, maxsize));
}

/* get() -> (kind, payload), or EMPTY or PYTHON */
static PyObject *Ring_get(Ring *self, PyObject *unused)
{
    uint32_t kind;
    int code;
    (void)unused;
    PyObject *pair = PyTuple_New(2);                 /* made first: nothing can fail once a message is taken */
    if (pair == NULL)
        return NULL;
    PyObject *payload = gsq_get(&self->layout, &kind, &code);
    if (payload == NULL) {
        Py_DECREF(pair);
        return code ? PyLong_FromLong(code) : NULL;
    }
    PyTuple_SET_ITEM(pair, 0, PyLong_FromUnsignedLong(kind));   /* 0 or 4: a cached small int */
    PyTuple_SET_ITEM(pair, 1, payload);
    return pair;
}

static void Ring_dealloc(Ring *self)
{
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL, "Put one message (see gsq_put)."},
    {"get", (PyCFunction)Ring_get, METH_NOARGS, "Take one message (see gsq_get)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpushare._core.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One queue region's put and get, as mapped in this process.",
    .tp_methods = Ring_methods,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_new = PyType_GenericNew,
};

/* Adds ``Ring`` to the compiled core's module (``_core.c``); -1 with an exception set on failure. */
int gpushare_region_add(PyObject *module)
{
    if (PyType_Ready(&RingType) < 0)
        return -1;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(module, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        return -1;
    }
    return 0;
}
