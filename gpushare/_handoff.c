/* A buffer's handoff through a Queue in one C call at each end (in the compiled core,
 * ``gpushare._core``: _core.c; built with the package by setup.py, loaded by gpushare._native,
 * used by gpushare._buffer). Each call takes the steady state only, from a plan or an entry
 * the Python path left, and hands everything else back (None) with nothing changed: the
 * caller then takes the Python path, which handles it and says what is wrong. Layouts and
 * slot names come from Python, never restated here.
 *
 * Shares.share(buffer): queue_pickle for a buffer of this process's own Manager. Under the
 * owner's lock, in LeaseTable.take's order: hands back if deferred work is pending (the
 * Python path runs it first), the allocation is freed or recycled, or the owner stopped
 * sharing; else exports (as every lease does), records a CUDA buffer's ready event through
 * the owner's ReadyEvents, takes the lease (a Lease with every slot set as its __init__
 * sets them) and fills the descriptor's template into the Queue's pickle.
 *
 * Arrivals.arrive(message): from_queue_pickle for an allocation this process maps. An entry
 * is kept per descriptor less its lease id and checksum (the key). Under the link's lock,
 * as Link.attach does for a mapped allocation: hands back a lease held here already, a gone
 * owner, a mapping gone or replaced, no journal or records queued before this one; else
 * counts the mapping, claims the lease with a journal record, and makes the Memory, its
 * lease source, the Buffer and its finalizer without running their __init__, every slot
 * set as __init__ sets it. The slot names are checked against the classes' __slots__: a
 * slot added in Python turns these calls off rather than leaving it unset.
 *
 * Arrivals.release(link, lease, alloc): LeaseRecorder.note(RELEASE, ...) in one call, for
 * any lease claimed over a link. Never blocks (the lock is only tried; what cannot be
 * written now goes to the writer thread, as note sends it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xFF] ^ (crc_table[t - 1][i] >> 8);
}

/* zlib's crc32 (the descriptor's checksum), eight bytes a step (little-endian). */
static uint32_t crc32_of(const unsigned char *p, Py_ssize_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return ~c;
}

enum { M_VALUES = 12, M_SLOTS = 17, B_SLOTS = 6, D_SLOTS = 2, S_SLOTS = 2 };
/* Memory's slots in the order set here: the entry's 12 values, then _refs, exit_release,
 * pending, source, templates. Buffer: _memory, _offset, _shape, _dtype, _export,
 * _finalizer. _Drop: _held, alive. _LeaseSource: lease_id, link. */

typedef struct {
    PyObject_HEAD
    PyObject *table;                 /* key bytes -> entry tuple */
    PyTypeObject *memory_type, *buffer_type, *drop_type, *source_type;
    Py_ssize_t m_off[M_SLOTS], b_off[B_SLOTS], d_off[D_SLOTS], s_off[S_SLOTS];
    PyObject *head;                  /* the Queue pickle's head (bytes), up to the length */
    PyObject *tail;                  /* its tail (bytes) */
    Py_ssize_t lease_at;             /* where the lease id sits in a descriptor */
    Py_ssize_t min_size;             /* a descriptor's least size */
    uint64_t records_at, stride, capacity, nudge_at, k, salt, dropped_at;
    long claim, release;             /* the CLAIM and RELEASE record kinds */
    PyObject *nudge;                 /* what wakes the writer to nudge the owner */
    PyObject *one;
    PyObject *s_note, *s_defer, *s_request_retire, *s_lock, *s_held, *s_mappings, *s_client, *s_retired,
        *s_recorder, *release_kind;
    PyObject *s_ended, *s_journal, *s_backlog, *s_head, *s_limit, *s_mm, *s_nudged_at, *s_wake, *s_put,
        *s_acquire, *s_release, *s_refs, *s_confirm;
} Arrivals;

/* The offsets of ``names`` (a tuple of str) among ``type``'s slots; every slot that
 * ``type`` and its bases declare in __slots__ ("__weakref__" and "__dict__" aside) must be
 * named, and only those. */
static int slot_offsets(PyTypeObject *type, PyObject *names, Py_ssize_t *out, Py_ssize_t n)
{
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd slot names expected", type->tp_name, n);
        return -1;
    }
    Py_ssize_t counted = 0;
    PyObject *mro = type->tp_mro;
    for (Py_ssize_t c = 0; mro != NULL && c < PyTuple_GET_SIZE(mro); c++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, c);
        /* Classes only: a built-in type declares no __slots__ (and from 3.12 has no tp_dict here). */
        if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE) || base->tp_dict == NULL)
            continue;
        PyObject *slots = PyDict_GetItemString(base->tp_dict, "__slots__");
        if (slots == NULL)
            continue;
        if (PyUnicode_Check(slots) || !PyTuple_Check(slots)) {
            PyErr_Format(PyExc_ValueError, "%s: __slots__ is not a tuple", type->tp_name);
            return -1;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); i++) {
            PyObject *slot = PyTuple_GET_ITEM(slots, i);
            if (PyUnicode_Check(slot) && (PyUnicode_CompareWithASCIIString(slot, "__weakref__") == 0 ||
                                          PyUnicode_CompareWithASCIIString(slot, "__dict__") == 0))
                continue;
            counted++;
            int found = PySequence_Contains(names, slot);
            if (found < 0)
                return -1;
            if (!found) {
                PyErr_Format(PyExc_ValueError, "%s has a slot %R that is not set here", type->tp_name, slot);
                return -1;
            }
        }
    }
    if (counted != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd slots, %zd are set here", type->tp_name, counted, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *descr = _PyType_Lookup(type, PyTuple_GET_ITEM(names, i));  /* borrowed */
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
            PyErr_Format(PyExc_ValueError, "%s.%U is not a slot", type->tp_name, PyTuple_GET_ITEM(names, i));
            return -1;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_ValueError, "%s.%U is not an object slot", type->tp_name, PyTuple_GET_ITEM(names, i));
            return -1;
        }
        out[i] = member->offset;
    }
    return 0;
}

/* An attribute's truth: 1, 0, or -1 with an exception. */
static int attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Release ``lock`` (held), keeping an exception already set: 0, or -1 if the release itself
 * failed (its error replaces the one that was set). */
static int unlock(PyObject *lock, PyObject *release_name)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, release_name);
    if (r == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return 0;
}

static inline void set_slot(PyObject *obj, Py_ssize_t offset, PyObject *value)
{
    PyObject **at = (PyObject **)((char *)obj + offset);
    Py_INCREF(value);
    Py_XSETREF(*at, value);
}

static PyObject *new_of(PyTypeObject *type)
{
    return type->tp_alloc(type, 0);
}

static int Arrivals_init(Arrivals *self, PyObject *args, PyObject *kwds)
{
    if (self->table != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Arrivals is made once");
        return -1;
    }
    PyObject *memory_type, *m_names, *buffer_type, *b_names, *drop_type, *d_names, *source_type, *s_names;
    PyObject *head, *tail, *nudge;
    Py_ssize_t lease_at, min_size;
    unsigned long long records_at, stride, capacity, nudge_at, k, salt, dropped_at;
    long claim, release;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!SSnnKKKKKKKllO", &PyType_Type, &memory_type, &PyTuple_Type, &m_names,
                          &PyType_Type, &buffer_type, &PyTuple_Type, &b_names, &PyType_Type, &drop_type, &PyTuple_Type,
                          &d_names, &PyType_Type, &source_type, &PyTuple_Type, &s_names, &head, &tail, &lease_at,
                          &min_size, &records_at, &stride, &capacity, &nudge_at, &k, &salt, &dropped_at, &claim, &release,
                          &nudge))
        return -1;
    struct { PyObject *type, *names; Py_ssize_t *out, n; } kinds[4] = {
        {memory_type, m_names, self->m_off, M_SLOTS},
        {buffer_type, b_names, self->b_off, B_SLOTS},
        {drop_type, d_names, self->d_off, D_SLOTS},
        {source_type, s_names, self->s_off, S_SLOTS},
    };
    for (int i = 0; i < 4; i++)
        if (slot_offsets((PyTypeObject *)kinds[i].type, kinds[i].names, kinds[i].out, kinds[i].n) < 0)
            return -1;
    if (capacity == 0 || stride < 16 || dropped_at + 8 > records_at) {
        PyErr_SetString(PyExc_ValueError, "bad journal layout");
        return -1;
    }
    self->table = PyDict_New();
    if (self->table == NULL)
        return -1;
    self->memory_type = (PyTypeObject *)Py_NewRef(memory_type);
    self->buffer_type = (PyTypeObject *)Py_NewRef(buffer_type);
    self->drop_type = (PyTypeObject *)Py_NewRef(drop_type);
    self->source_type = (PyTypeObject *)Py_NewRef(source_type);
    self->head = Py_NewRef(head);
    self->tail = Py_NewRef(tail);
    self->nudge = Py_NewRef(nudge);
    self->lease_at = lease_at;
    self->min_size = min_size;
    self->records_at = records_at;
    self->stride = stride;
    self->capacity = capacity;
    self->nudge_at = nudge_at;
    self->dropped_at = dropped_at;
    self->k = k;
    self->salt = salt;
    self->claim = claim;
    self->release = release;
    if ((self->one = PyLong_FromLong(1)) == NULL)
        return -1;
#define NAME(field, text) if ((self->field = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_ended, "ended");
    NAME(s_journal, "_journal");
    NAME(s_backlog, "_backlog");
    NAME(s_head, "head");
    NAME(s_limit, "_limit");
    NAME(s_mm, "_mm");
    NAME(s_nudged_at, "_nudged_at");
    NAME(s_wake, "_wake");
    NAME(s_put, "put");
    NAME(s_acquire, "acquire");
    NAME(s_release, "release");
    NAME(s_refs, "refs");
    NAME(s_note, "note");
    NAME(s_confirm, "confirm");
    NAME(s_defer, "defer");
    NAME(s_request_retire, "request_retire");
    NAME(s_lock, "_lock");
    NAME(s_held, "_held");
    NAME(s_mappings, "_mappings");
    NAME(s_client, "client");
    NAME(s_retired, "_retired");
    NAME(s_recorder, "recorder");
    if ((self->release_kind = PyLong_FromLong(release)) == NULL)
        return -1;
#undef NAME
    return 0;
}

static void Arrivals_dealloc(Arrivals *self)
{
    Py_XDECREF(self->table);
    Py_XDECREF(self->memory_type);
    Py_XDECREF(self->buffer_type);
    Py_XDECREF(self->drop_type);
    Py_XDECREF(self->source_type);
    Py_XDECREF(self->head);
    Py_XDECREF(self->tail);
    Py_XDECREF(self->nudge);
    Py_XDECREF(self->s_ended);
    Py_XDECREF(self->s_journal);
    Py_XDECREF(self->s_backlog);
    Py_XDECREF(self->s_head);
    Py_XDECREF(self->s_limit);
    Py_XDECREF(self->s_mm);
    Py_XDECREF(self->s_nudged_at);
    Py_XDECREF(self->s_wake);
    Py_XDECREF(self->s_put);
    Py_XDECREF(self->s_acquire);
    Py_XDECREF(self->s_release);
    Py_XDECREF(self->s_refs);
    Py_XDECREF(self->s_note);
    Py_XDECREF(self->s_confirm);
    Py_XDECREF(self->s_defer);
    Py_XDECREF(self->s_request_retire);
    Py_XDECREF(self->s_lock);
    Py_XDECREF(self->s_held);
    Py_XDECREF(self->s_mappings);
    Py_XDECREF(self->s_client);
    Py_XDECREF(self->s_retired);
    Py_XDECREF(self->s_recorder);
    Py_XDECREF(self->release_kind);
    Py_XDECREF(self->one);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An int attribute as uint64; -1 with an exception set on failure. */
static int get_u64(PyObject *obj, PyObject *name, uint64_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

static int set_u64(PyObject *obj, PyObject *name, uint64_t value)
{
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return r;
}

/* Entry: (client, lock, held, mappings, mapping, recorder, alloc_id, values, offset, shape, dtype, link) */
enum { E_CLIENT, E_LOCK, E_HELD, E_MAPPINGS, E_MAPPING, E_RECORDER, E_ALLOC, E_VALUES, E_OFFSET, E_SHAPE, E_DTYPE,
       E_LINK, E_SIZE };

/* Lock held: write a ``kind`` record of ``lease`` into the journal, as
 * LeaseRecorder.append_locked does. 1 written; 2 a claim written of a lease the owner may
 * drop unread (LeaseRecorder.may_be_dropped: the claimer asks first); 0 not possible now
 * (no journal, records queued before, journal full): nothing written; -1 error. */
static int record_locked(Arrivals *self, PyObject *recorder, long kind, uint64_t lease)
{
    PyObject *journal = PyObject_GetAttr(recorder, self->s_journal);
    if (journal == NULL)
        return -1;
    if (journal == Py_None) {
        Py_DECREF(journal);
        return 0;
    }
    int result = -1;
    Py_buffer view = {0};
    PyObject *backlog = PyObject_GetAttr(recorder, self->s_backlog), *mm = NULL;
    if (backlog == NULL)
        goto done;
    Py_ssize_t queued = PyObject_Length(backlog);
    if (queued != 0) {
        result = queued < 0 ? -1 : 0;
        goto done;
    }
    uint64_t head, limit, tail;
    if (get_u64(journal, self->s_head, &head) < 0 || get_u64(journal, self->s_limit, &limit) < 0)
        goto done;
    mm = PyObject_GetAttr(journal, self->s_mm);
    if (mm == NULL || PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE) < 0)
        goto done;
    if ((uint64_t)view.len < self->records_at + self->capacity * self->stride) {
        PyErr_SetString(PyExc_ValueError, "the lease journal is smaller than its layout");
        goto done;
    }
    char *base = (char *)view.buf;
    memcpy(&tail, base, 8);  /* the owner's tail (it alone writes it) */
    if (head >= limit) {
        limit = tail + self->capacity;
        if (set_u64(journal, self->s_limit, limit) < 0)
            goto done;
        if (head >= limit) {
            result = 0;
            goto done;
        }
    }
    uint64_t value = lease << 1 | (uint64_t)kind;
    uint64_t check = value ^ ((head * self->k) ^ self->salt);
    char *at = base + self->records_at + (head % self->capacity) * self->stride;
    memcpy(at, &value, 8);
    __atomic_store_n((uint64_t *)(at + 8), check, __ATOMIC_RELEASE);  /* the check makes it count: last */
    head += 1;
    if (set_u64(journal, self->s_head, head) < 0)
        goto done;
    /* The owner reads journals when it needs to; a long unread run nudges it (as append_locked). */
    uint64_t nudged;
    if (get_u64(recorder, self->s_nudged_at, &nudged) < 0)
        goto done;
    if (head - nudged >= self->nudge_at && head - tail >= self->nudge_at) {
        if (set_u64(recorder, self->s_nudged_at, head) < 0)
            goto done;
        PyObject *wake = PyObject_GetAttr(recorder, self->s_wake);
        if (wake == NULL)
            goto done;
        PyObject *r = PyObject_CallMethodOneArg(wake, self->s_put, self->nudge);
        Py_DECREF(wake);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    result = 1;
    if (kind == self->claim) {  /* read after the record is out: see gpushare._lifetime._protocol, "dropped" */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (lease <= __atomic_load_n((uint64_t *)(base + self->dropped_at), __ATOMIC_ACQUIRE))
            result = 2;
    }
done:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    Py_XDECREF(mm);
    Py_XDECREF(backlog);
    Py_DECREF(journal);
    return result;
}

/* The Buffer for ``entry`` under ``lease`` (claimed): Memory, source, Buffer, finalizer. */
static PyObject *build(Arrivals *self, PyObject *entry, PyObject *lease_obj)
{
    PyObject *values = PyTuple_GET_ITEM(entry, E_VALUES);
    PyObject *memory = new_of(self->memory_type), *source = new_of(self->source_type);
    PyObject *buffer = new_of(self->buffer_type), *drop = new_of(self->drop_type);
    PyObject *refs = PyList_New(1), *held = PyList_New(1);
    if (memory == NULL || source == NULL || buffer == NULL || drop == NULL || refs == NULL || held == NULL) {
        Py_XDECREF(memory);
        Py_XDECREF(source);
        Py_XDECREF(buffer);
        Py_XDECREF(drop);
        Py_XDECREF(refs);
        Py_XDECREF(held);
        return NULL;
    }
    PyObject *event = PyTuple_GET_ITEM(values, 7);
    for (int i = 0; i < M_VALUES; i++)
        set_slot(memory, self->m_off[i], PyTuple_GET_ITEM(values, i));
    PyList_SET_ITEM(refs, 0, Py_NewRef(Py_True));  /* one Buffer, the first: Memory.acquire */
    set_slot(memory, self->m_off[12], refs);
    set_slot(memory, self->m_off[13], Py_False);  /* exit_release: the link's close releases */
    set_slot(memory, self->m_off[14], event == Py_None ? Py_False : Py_True);  /* pending */
    set_slot(memory, self->m_off[15], source);
    set_slot(memory, self->m_off[16], Py_None);  /* templates */
    set_slot(source, self->s_off[0], lease_obj);
    set_slot(source, self->s_off[1], PyTuple_GET_ITEM(entry, E_LINK));
    PyList_SET_ITEM(held, 0, Py_NewRef(memory));
    set_slot(drop, self->d_off[0], held);
    set_slot(drop, self->d_off[1], Py_True);
    set_slot(buffer, self->b_off[0], memory);
    set_slot(buffer, self->b_off[1], PyTuple_GET_ITEM(entry, E_OFFSET));
    set_slot(buffer, self->b_off[2], PyTuple_GET_ITEM(entry, E_SHAPE));
    set_slot(buffer, self->b_off[3], PyTuple_GET_ITEM(entry, E_DTYPE));
    set_slot(buffer, self->b_off[4], Py_None);
    set_slot(buffer, self->b_off[5], drop);
    Py_DECREF(refs);
    Py_DECREF(held);
    Py_DECREF(source);
    Py_DECREF(drop);
    Py_DECREF(memory);
    return buffer;
}

/* The descriptor inside a Queue message: its start and length, or -1 if ``msg`` is not one. */
static Py_ssize_t descriptor_in(Arrivals *self, PyObject *msg, const unsigned char **desc)
{
    Py_ssize_t n = PyBytes_GET_SIZE(msg), nh = PyBytes_GET_SIZE(self->head), nt = PyBytes_GET_SIZE(self->tail);
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(msg);
    if (n < nh + 4 + nt + self->min_size || memcmp(p, PyBytes_AS_STRING(self->head), nh) != 0 ||
        memcmp(p + n - nt, PyBytes_AS_STRING(self->tail), nt) != 0)
        return -1;
    uint32_t length;
    memcpy(&length, p + nh, 4);
    if ((Py_ssize_t)length != n - nh - 4 - nt)
        return -1;
    *desc = p + nh + 4;
    return length;
}

static PyObject *Arrivals_arrive(Arrivals *self, PyObject *msg)
{
    if (!PyBytes_CheckExact(msg) || PyDict_GET_SIZE(self->table) == 0)
        Py_RETURN_NONE;
    const unsigned char *d;
    Py_ssize_t size = descriptor_in(self, msg, &d);
    if (size < 0 || size < self->lease_at + 8 + 4)
        Py_RETURN_NONE;
    Py_ssize_t body = size - 4;
    uint32_t want;
    memcpy(&want, d + body, 4);
    if (crc32_of(d, body) != want)
        Py_RETURN_NONE;  /* the Python path says it is corrupt */
    PyObject *key = PyBytes_FromStringAndSize(NULL, body - 8);
    if (key == NULL)
        return NULL;
    memcpy(PyBytes_AS_STRING(key), d, self->lease_at);
    memcpy(PyBytes_AS_STRING(key) + self->lease_at, d + self->lease_at + 8, body - self->lease_at - 8);
    PyObject *entry = PyDict_GetItemWithError(self->table, key);  /* borrowed */
    Py_DECREF(key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != E_SIZE ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(entry, E_VALUES)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(entry, E_VALUES)) != M_VALUES) {
        PyErr_SetString(PyExc_TypeError, "a malformed arrival entry");
        return NULL;
    }
    Py_INCREF(entry);  /* the table may change while the lock is awaited */
    uint64_t lease;
    memcpy(&lease, d + self->lease_at, 8);
    PyObject *result = NULL, *lease_obj = PyLong_FromUnsignedLongLong(lease), *ended = NULL, *lock = NULL;
    if (lease_obj == NULL)
        goto out;
    ended = PyObject_GetAttr(PyTuple_GET_ITEM(entry, E_CLIENT), self->s_ended);
    if (ended == NULL)
        goto out;
    if (ended != Py_None) {  /* the owner is gone: the Python path says so */
        result = Py_NewRef(Py_None);
        goto out;
    }
    lock = PyTuple_GET_ITEM(entry, E_LOCK);
    PyObject *r = PyObject_CallMethodNoArgs(lock, self->s_acquire);
    if (r == NULL)
        goto out;
    Py_DECREF(r);
    /* Under the link's lock: what Link.attach checks and changes for a mapped allocation. */
    PyObject *held = PyTuple_GET_ITEM(entry, E_HELD), *mapping = PyTuple_GET_ITEM(entry, E_MAPPING);
    int claimed = -1;
    int is_held = PySet_Contains(held, lease_obj);
    PyObject *now = is_held == 0 ? PyDict_GetItemWithError(PyTuple_GET_ITEM(entry, E_MAPPINGS),
                                                           PyTuple_GET_ITEM(entry, E_ALLOC)) : NULL;
    if (is_held < 0 || (now == NULL && PyErr_Occurred())) {
        claimed = -1;
    } else if (is_held || now != mapping) {
        claimed = 0;  /* held here already (the Python path raises), or unmapped or remapped */
    } else {
        /* Counted before the claim, as Link.attach counts: an owner that reads the claim and
         * asks for an unmap finds the mapping in use. */
        PyObject *refs = PyObject_GetAttr(mapping, self->s_refs), *more = NULL;
        if (refs != NULL)
            more = PyNumber_Add(refs, self->one);
        Py_XDECREF(refs);
        if (more != NULL && PyObject_SetAttr(mapping, self->s_refs, more) == 0) {
            claimed = PySet_Add(held, lease_obj) < 0 ? -1 : record_locked(self, PyTuple_GET_ITEM(entry, E_RECORDER), self->claim, lease);
            if (claimed <= 0) {  /* not claimed: undo the count (the Python path takes it from here) */
                PyObject *et, *ev, *tb;
                PyErr_Fetch(&et, &ev, &tb);  /* an error already set is the one raised */
                PyObject *back = PyNumber_Subtract(more, self->one);
                int undone = back != NULL && PyObject_SetAttr(mapping, self->s_refs, back) == 0 &&
                             PySet_Discard(held, lease_obj) >= 0;
                Py_XDECREF(back);
                if (et != NULL) {
                    PyErr_Clear();
                    PyErr_Restore(et, ev, tb);
                } else if (!undone) {
                    claimed = -1;
                }
            }
        }
        Py_XDECREF(more);
    }
    if (unlock(lock, self->s_release) < 0)
        goto out;
    if (claimed == 2) {  /* the owner may have dropped it unclaimed: Link.confirm asks (gives it back if refused) */
        PyObject *asked = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(entry, E_LINK), self->s_confirm, lease_obj,
                                                     PyTuple_GET_ITEM(entry, E_ALLOC), NULL);
        if (asked == NULL)
            goto out;
        Py_DECREF(asked);
        claimed = 1;
    }
    if (claimed == 0) {
        result = Py_NewRef(Py_None);
    } else if (claimed == 1) {
        result = build(self, entry, lease_obj);
        if (result == NULL) {  /* claimed and no Buffer made: give the lease back, as a drop would */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *gave = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(entry, E_RECORDER), self->s_note,
                                                        self->release_kind, lease_obj, PyTuple_GET_ITEM(entry, E_ALLOC),
                                                        NULL);
            Py_XDECREF(gave);
            PyErr_Clear();
            PyErr_Restore(et, ev, tb);
        }
    }
out:
    Py_XDECREF(ended);
    Py_XDECREF(lease_obj);
    Py_DECREF(entry);
    return result;
}


/* Lock held: what Link._unhold_locked does for a released lease: not held, its mapping one
 * use less, and the link retired (by its writer) if the owner is gone and nothing here is held. */
static int unhold_locked(Arrivals *self, PyObject *link, PyObject *recorder, PyObject *lease, PyObject *alloc)
{
    int result = -1;
    PyObject *held = PyObject_GetAttr(link, self->s_held), *mappings = NULL, *client = NULL, *ended = NULL;
    if (held == NULL || PySet_Discard(held, lease) < 0)
        goto done;
    mappings = PyObject_GetAttr(link, self->s_mappings);
    if (mappings == NULL)
        goto done;
    PyObject *mapping = PyDict_GetItemWithError(mappings, alloc);  /* borrowed */
    if (mapping == NULL && PyErr_Occurred())
        goto done;
    if (mapping != NULL) {
        PyObject *refs = PyObject_GetAttr(mapping, self->s_refs);
        PyObject *less = refs == NULL ? NULL : PyNumber_Subtract(refs, self->one);
        Py_XDECREF(refs);
        int set = less == NULL ? -1 : PyObject_SetAttr(mapping, self->s_refs, less);
        Py_XDECREF(less);
        if (set < 0)
            goto done;
    }
    client = PyObject_GetAttr(link, self->s_client);
    ended = client == NULL ? NULL : PyObject_GetAttr(client, self->s_ended);
    if (ended == NULL)
        goto done;
    if (ended != Py_None && PySet_GET_SIZE(held) == 0) {
        int retired = attr_true(link, self->s_retired);
        if (retired < 0)
            goto done;
        if (!retired) {
            PyObject *r = PyObject_CallMethodNoArgs(recorder, self->s_request_retire);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    result = 0;
done:
    Py_XDECREF(ended);
    Py_XDECREF(client);
    Py_XDECREF(mappings);
    Py_XDECREF(held);
    return result;
}

/* release(link, lease_id, alloc_id): LeaseRecorder.note(RELEASE, ...) for a lease claimed
 * over ``link``, in one call. Never blocks: the link's lock only tried, as note tries it;
 * busy, or a record it cannot write now, goes to the writer thread (recorder.defer). */
static PyObject *Arrivals_release(Arrivals *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "release(link, lease_id, alloc_id)");
        return NULL;
    }
    PyObject *link = args[0], *lease_obj = args[1], *alloc = args[2];
    unsigned long long lease = PyLong_AsUnsignedLongLong(lease_obj);
    if (lease == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *lock = PyObject_GetAttr(link, self->s_lock), *recorder = PyObject_GetAttr(link, self->s_recorder);
    PyObject *result = NULL, *accounted = Py_False;
    if (lock == NULL || recorder == NULL)
        goto out;
    PyObject *got = PyObject_CallMethodOneArg(lock, self->s_acquire, Py_False);
    if (got == NULL)
        goto out;
    int locked = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (locked < 0)
        goto out;
    int written = 0;
    if (locked) {
        written = unhold_locked(self, link, recorder, lease_obj, alloc);
        if (written == 0) {
            accounted = Py_True;
            written = record_locked(self, recorder, self->release, lease);
        }
        if (unlock(lock, self->s_release) < 0 || written < 0)
            goto out;
    }
    if (written == 0) {  /* the lock was busy, or the journal cannot take it now: the writer thread's */
        PyObject *r = PyObject_CallMethodObjArgs(recorder, self->s_defer, self->release_kind, lease_obj, alloc,
                                                 accounted, NULL);
        if (r == NULL)
            goto out;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
out:
    Py_XDECREF(lock);
    Py_XDECREF(recorder);
    return result;
}

static PyObject *Arrivals_add(Arrivals *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) ||
        PyTuple_GET_SIZE(args[1]) != E_SIZE) {
        PyErr_SetString(PyExc_TypeError, "add(key: bytes, entry: tuple)");
        return NULL;
    }
    if (PyDict_SetItem(self->table, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Arrivals_clear(Arrivals *self, PyObject *unused)
{
    PyDict_Clear(self->table);
    Py_RETURN_NONE;
}

static Py_ssize_t Arrivals_len(Arrivals *self)
{
    return PyDict_GET_SIZE(self->table);
}

static PyMethodDef Arrivals_methods[] = {
    {"arrive", (PyCFunction)Arrivals_arrive, METH_O, "The Buffer a Queue message names, or None: the Python path's turn."},
    {"add", (PyCFunction)(void (*)(void))Arrivals_add, METH_FASTCALL, "Keep an entry for a descriptor key."},
    {"release", (PyCFunction)(void (*)(void))Arrivals_release, METH_FASTCALL, "Record a release; never blocks."},
    {"clear", (PyCFunction)Arrivals_clear, METH_NOARGS, "Forget every entry."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Arrivals_sequence = {.sq_length = (lenfunc)Arrivals_len};

static PyTypeObject ArrivalsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpushare._core.Arrivals",
    .tp_basicsize = sizeof(Arrivals),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Received buffers' arrivals in one call, for allocations this process maps.",
    .tp_methods = Arrivals_methods,
    .tp_as_sequence = &Arrivals_sequence,
    .tp_init = (initproc)Arrivals_init,
    .tp_dealloc = (destructor)Arrivals_dealloc,
    .tp_new = PyType_GenericNew,
};


/* -- the sending end: Shares ----------------------------------------------------------------- */

enum { L_SLOTS = 7 };
/* Lease's slots in the order set here: lease_id, record, generation, holder, created, keep, quiet. */

/* A plan (gpushare._buffer builds it, kept in the Memory's templates):
 * (lock, pending, table, leases, ids, record, record_leases, allocation, backend, ready, device,
 *  generation, handle, pre, mid, post, no_event) */
enum { P_LOCK, P_PENDING, P_TABLE, P_LEASES, P_IDS, P_RECORD, P_RECORD_LEASES, P_ALLOCATION, P_BACKEND, P_READY,
       P_DEVICE, P_GENERATION, P_HANDLE, P_PRE, P_MID, P_POST, P_NO_EVENT, P_SIZE };

typedef struct {
    PyObject_HEAD
    PyTypeObject *lease_type;
    PyObject *finalize_type, *registry;  /* weakref.finalize and its registry: a live one is in it */
    Py_ssize_t l_off[L_SLOTS];
    PyObject *head, *tail;
    PyObject *s_finalizer, *s_alive, *s_memory, *s_templates, *s_offset, *s_shape, *s_dtype, *s_acquire,
        *s_release, *s_empty, *s_dead, *s_sharing, *s_generation, *s_export, *s_handle, *s_record, *zero;
} Shares;

static int Shares_init(Shares *self, PyObject *args, PyObject *kwds)
{
    if (self->lease_type != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Shares is made once");
        return -1;
    }
    PyObject *lease_type, *l_names, *head, *tail, *finalize_type, *registry;
    if (!PyArg_ParseTuple(args, "O!O!SSO!O!", &PyType_Type, &lease_type, &PyTuple_Type, &l_names, &head, &tail,
                          &PyType_Type, &finalize_type, &PyDict_Type, &registry))
        return -1;
    self->finalize_type = Py_NewRef(finalize_type);
    self->registry = Py_NewRef(registry);
    if (slot_offsets((PyTypeObject *)lease_type, l_names, self->l_off, L_SLOTS) < 0)
        return -1;
    self->lease_type = (PyTypeObject *)Py_NewRef(lease_type);
    self->head = Py_NewRef(head);
    self->tail = Py_NewRef(tail);
    if ((self->zero = PyLong_FromLong(0)) == NULL)
        return -1;
#define NAME(field, text) if ((self->field = PyUnicode_InternFromString(text)) == NULL) return -1
    NAME(s_finalizer, "_finalizer");
    NAME(s_alive, "alive");
    NAME(s_memory, "_memory");
    NAME(s_templates, "templates");
    NAME(s_offset, "_offset");
    NAME(s_shape, "_shape");
    NAME(s_dtype, "_dtype");
    NAME(s_acquire, "acquire");
    NAME(s_release, "release");
    NAME(s_empty, "empty");
    NAME(s_dead, "dead");
    NAME(s_sharing, "_sharing");
    NAME(s_generation, "generation");
    NAME(s_export, "export");
    NAME(s_handle, "handle");
    NAME(s_record, "record");
#undef NAME
    return 0;
}

static void Shares_dealloc(Shares *self)
{
    PyObject **fields[] = {(PyObject **)&self->lease_type, &self->finalize_type, &self->registry, &self->head, &self->tail, &self->s_finalizer,
                           &self->s_alive, &self->s_memory, &self->s_templates, &self->s_offset, &self->s_shape,
                           &self->s_dtype, &self->s_acquire, &self->s_release, &self->s_empty, &self->s_dead,
                           &self->s_sharing, &self->s_generation, &self->s_export, &self->s_handle,
                           &self->s_record, &self->zero};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
        Py_CLEAR(*fields[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The plan for ``buf``'s view, borrowed from its Memory's templates (kept alive by the
 * caller's reference to ``memory``), or NULL: no plan (no exception) or an error. */
static PyObject *plan_of(Shares *self, PyObject *buf, PyObject *memory)
{
    PyObject *templates = PyObject_GetAttr(memory, self->s_templates), *plan = NULL;
    if (templates == NULL)
        return NULL;
    if (PyDict_CheckExact(templates)) {
        PyObject *offset = PyObject_GetAttr(buf, self->s_offset), *shape = PyObject_GetAttr(buf, self->s_shape);
        PyObject *dtype = PyObject_GetAttr(buf, self->s_dtype), *key = NULL;
        if (offset != NULL && shape != NULL && dtype != NULL)
            key = PyTuple_Pack(3, offset, shape, dtype);
        Py_XDECREF(offset);
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        if (key != NULL) {
            plan = PyDict_GetItemWithError(templates, key);
            Py_DECREF(key);
        }
        if (plan != NULL && (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != P_SIZE)) {
            PyErr_SetString(PyExc_TypeError, "a malformed share plan");
            plan = NULL;
        }
    }
    Py_DECREF(templates);
    return plan;
}

/* Lock held: take the lease as LeaseTable.take does. 1 taken (*lease_id, *event set), 0 the
 * Python path's turn (nothing changed), -1 error (nothing changed). */
static int take_locked(Shares *self, PyObject *plan, PyObject **lease_id, PyObject **event)
{
    PyObject *r = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(plan, P_PENDING), self->s_empty);
    if (r == NULL)
        return -1;
    int empty = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (empty <= 0)
        return empty;  /* deferred work first: the Python path runs it */
    PyObject *record = PyTuple_GET_ITEM(plan, P_RECORD);
    int dead = attr_true(record, self->s_dead);
    if (dead != 0)
        return dead < 0 ? -1 : 0;
    int sharing = attr_true(PyTuple_GET_ITEM(plan, P_TABLE), self->s_sharing);
    if (sharing <= 0)
        return sharing;
    PyObject *generation = PyObject_GetAttr(record, self->s_generation);
    if (generation == NULL)
        return -1;
    int same = PyObject_RichCompareBool(generation, PyTuple_GET_ITEM(plan, P_GENERATION), Py_EQ);
    Py_DECREF(generation);
    if (same <= 0)
        return same;
    PyObject *allocation = PyTuple_GET_ITEM(plan, P_ALLOCATION);
    PyObject *handle = PyObject_CallMethodOneArg(PyTuple_GET_ITEM(plan, P_BACKEND), self->s_export, allocation);
    if (handle == NULL)
        return -1;
    int set = PyObject_SetAttr(allocation, self->s_handle, handle);
    same = set < 0 ? -1 : PyObject_RichCompareBool(handle, PyTuple_GET_ITEM(plan, P_HANDLE), Py_EQ);
    Py_DECREF(handle);
    if (same <= 0)
        return same;  /* exported anew: the Python path makes the template */
    PyObject *ready = PyTuple_GET_ITEM(plan, P_READY);
    PyObject *ev = ready == Py_None ? PyBytes_FromStringAndSize(NULL, 0)
                                    : PyObject_CallMethod(ready, "record", "(OO)", PyTuple_GET_ITEM(plan, P_DEVICE),
                                                          self->zero);
    if (ev == NULL)
        return -1;
    if (!PyBytes_CheckExact(ev)) {
        Py_DECREF(ev);
        PyErr_SetString(PyExc_TypeError, "a ready event's handle is bytes");
        return -1;
    }
    PyObject *id = PyIter_Next(PyTuple_GET_ITEM(plan, P_IDS));
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic()'s clock on Linux */
    PyObject *created = id == NULL ? NULL : PyFloat_FromDouble((double)ts.tv_sec + ts.tv_nsec * 1e-9);
    PyObject *lease = created == NULL ? NULL : self->lease_type->tp_alloc(self->lease_type, 0);
    if (lease == NULL) {
        if (id == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the lease ids ran out");
        Py_XDECREF(created);
        Py_XDECREF(id);
        Py_DECREF(ev);
        return -1;
    }
    set_slot(lease, self->l_off[0], id);
    set_slot(lease, self->l_off[1], record);
    set_slot(lease, self->l_off[2], PyTuple_GET_ITEM(plan, P_GENERATION));
    set_slot(lease, self->l_off[3], Py_None);  /* holder: unclaimed */
    set_slot(lease, self->l_off[4], created);
    set_slot(lease, self->l_off[5], Py_None);  /* keep: none for a Manager's memory */
    set_slot(lease, self->l_off[6], Py_False);  /* quiet */
    Py_DECREF(created);
    if (PyDict_SetItem(PyTuple_GET_ITEM(plan, P_LEASES), id, lease) < 0) {
        Py_DECREF(lease);
        Py_DECREF(id);
        Py_DECREF(ev);
        return -1;
    }
    Py_DECREF(lease);
    if (PySet_Add(PyTuple_GET_ITEM(plan, P_RECORD_LEASES), id) < 0) {
        PyObject *et, *evv, *tb;
        PyErr_Fetch(&et, &evv, &tb);
        PyDict_DelItem(PyTuple_GET_ITEM(plan, P_LEASES), id);
        PyErr_Clear();
        PyErr_Restore(et, evv, tb);
        Py_DECREF(id);
        Py_DECREF(ev);
        return -1;
    }
    *lease_id = id;
    *event = ev;
    return 1;
}

/* The Queue's pickle of the plan's descriptor under ``lease_id`` with ``event``. */
static PyObject *frame(Shares *self, PyObject *plan, PyObject *lease_id, PyObject *event)
{
    unsigned long long lease = PyLong_AsUnsignedLongLong(lease_id);
    if (lease == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *pre = PyTuple_GET_ITEM(plan, P_PRE), *mid = PyTuple_GET_ITEM(plan, P_MID);
    PyObject *post = PyTuple_GET_ITEM(plan, P_POST), *no_event = PyTuple_GET_ITEM(plan, P_NO_EVENT);
    if (!PyBytes_CheckExact(pre) || !PyBytes_CheckExact(mid) || !PyBytes_CheckExact(post) ||
        !PyBytes_CheckExact(no_event)) {
        PyErr_SetString(PyExc_TypeError, "a malformed share plan");
        return NULL;
    }
    Py_ssize_t nev = PyBytes_GET_SIZE(event);
    if (nev > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "a ready event's handle is too long");
        return NULL;
    }
    Py_ssize_t rest = nev ? PyBytes_GET_SIZE(mid) + 2 + nev + PyBytes_GET_SIZE(post) : PyBytes_GET_SIZE(no_event);
    Py_ssize_t body = PyBytes_GET_SIZE(pre) + 8 + rest, nh = PyBytes_GET_SIZE(self->head);
    Py_ssize_t nt = PyBytes_GET_SIZE(self->tail);
    PyObject *out = PyBytes_FromStringAndSize(NULL, nh + 4 + body + 4 + nt);
    if (out == NULL)
        return NULL;
    char *o = PyBytes_AS_STRING(out);
    memcpy(o, PyBytes_AS_STRING(self->head), nh);
    uint32_t length = (uint32_t)(body + 4);
    memcpy(o + nh, &length, 4);
    char *b = o + nh + 4, *w = b;
    memcpy(w, PyBytes_AS_STRING(pre), PyBytes_GET_SIZE(pre));
    w += PyBytes_GET_SIZE(pre);
    memcpy(w, &lease, 8);
    w += 8;
    if (nev) {
        uint16_t n16 = (uint16_t)nev;
        memcpy(w, PyBytes_AS_STRING(mid), PyBytes_GET_SIZE(mid));
        w += PyBytes_GET_SIZE(mid);
        memcpy(w, &n16, 2);
        w += 2;
        memcpy(w, PyBytes_AS_STRING(event), nev);
        w += nev;
        memcpy(w, PyBytes_AS_STRING(post), PyBytes_GET_SIZE(post));
        w += PyBytes_GET_SIZE(post);
    } else {
        memcpy(w, PyBytes_AS_STRING(no_event), PyBytes_GET_SIZE(no_event));
        w += PyBytes_GET_SIZE(no_event);
    }
    uint32_t crc = crc32_of((const unsigned char *)b, body);
    memcpy(w, &crc, 4);
    memcpy(w + 4, PyBytes_AS_STRING(self->tail), nt);
    return out;
}

static PyObject *Shares_share(Shares *self, PyObject *buf)
{
    PyObject *finalizer = PyObject_GetAttr(buf, self->s_finalizer);
    if (finalizer == NULL)
        return NULL;
    /* weakref.finalize's alive is a property: "in its registry", asked directly here. */
    int alive = (PyObject *)Py_TYPE(finalizer) == self->finalize_type ? PyDict_Contains(self->registry, finalizer)
                                                                       : attr_true(finalizer, self->s_alive);
    Py_DECREF(finalizer);
    if (alive <= 0)
        return alive < 0 ? NULL : Py_NewRef(Py_None);  /* released: the Python path says so */
    PyObject *memory = PyObject_GetAttr(buf, self->s_memory);
    if (memory == NULL)
        return NULL;
    PyObject *result = NULL, *lease_id = NULL, *event = NULL;
    PyObject *plan = plan_of(self, buf, memory);
    if (plan == NULL) {
        if (!PyErr_Occurred())
            result = Py_NewRef(Py_None);
        goto out;
    }
    Py_INCREF(plan);
    PyObject *lock = PyTuple_GET_ITEM(plan, P_LOCK);
    PyObject *r = PyObject_CallMethodNoArgs(lock, self->s_acquire);
    if (r == NULL) {
        Py_DECREF(plan);
        goto out;
    }
    Py_DECREF(r);
    int taken = take_locked(self, plan, &lease_id, &event);
    if (unlock(lock, self->s_release) < 0)
        taken = -1;
    if (taken == 0)
        result = Py_NewRef(Py_None);
    else if (taken == 1)
        result = frame(self, plan, lease_id, event);  /* a failure leaves an unclaimed lease, which expires */
    Py_DECREF(plan);
out:
    Py_XDECREF(lease_id);
    Py_XDECREF(event);
    Py_DECREF(memory);
    return result;
}

static PyMethodDef Shares_methods[] = {
    {"share", (PyCFunction)Shares_share, METH_O, "The Queue's pickle of a buffer under a new lease, or None."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SharesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpushare._core.Shares",
    .tp_basicsize = sizeof(Shares),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A Manager's buffers put on a Queue in one call, from the plans the Python path leaves.",
    .tp_methods = Shares_methods,
    .tp_init = (initproc)Shares_init,
    .tp_dealloc = (destructor)Shares_dealloc,
    .tp_new = PyType_GenericNew,
};

/* Adds ``Arrivals`` and ``Shares`` to the compiled core's module (``_core.c``); -1 with an
 * exception set on failure. */
int gpushare_handoff_add(PyObject *module)
{
    crc_init();
    if (PyType_Ready(&ArrivalsType) < 0 || PyType_Ready(&SharesType) < 0)
        return -1;
    Py_INCREF(&ArrivalsType);
    if (PyModule_AddObject(module, "Arrivals", (PyObject *)&ArrivalsType) < 0) {
        Py_DECREF(&ArrivalsType);
        return -1;
    }
    Py_INCREF(&SharesType);
    if (PyModule_AddObject(module, "Shares", (PyObject *)&SharesType) < 0) {
        Py_DECREF(&SharesType);
        return -1;
    }
    return 0;
}
