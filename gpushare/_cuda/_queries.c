/* The per-handoff driver calls that keep the GIL, in C: the same four calls and answers
 * as gpushare._cuda._queries._Queries (its ctypes path), each one call of the extension
 * type ``Queries`` with no ctypes objects made per call (the module ``gpushare._cuda._cqueries``,
 * built with the package: setup.py; gpushare._native loads it).
 *
 * ``Queries(library)`` binds cuCtxGetCurrent, cuStreamQuery, cuEventQuery and
 * cuEventRecord of a driver library already loaded in this process (RTLD_NOLOAD: never
 * a second copy), and raises ImportError where it is not loaded or lacks one of them.
 * Each method first checks that the caller's primary context (its handle as an int) is
 * current on this thread; where it is not, or the driver answers with an error, it
 * answers None (or False for a record) and the caller asks cuda-bindings, which sets the
 * context or reports the error by name. No CUDA header is needed: the four signatures
 * take only pointers and return an int.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_READY = 600 };

typedef int (*ctx_get_fn)(void **);
typedef int (*query_fn)(void *);
typedef int (*record_fn)(void *, void *);

typedef struct {
    PyObject_HEAD
    void *lib;
    ctx_get_fn ctx_get;
    query_fn stream_query, event_query;
    record_fn event_record;
} Queries;

static int Queries_init(Queries *self, PyObject *args, PyObject *kwargs)
{
    const char *library;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Queries(library) takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "s", &library))
        return -1;
    void *lib = dlopen(library, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "%s is not loaded in this process", library);
        return -1;
    }
    self->ctx_get = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
    self->stream_query = (query_fn)dlsym(lib, "cuStreamQuery");
    self->event_query = (query_fn)dlsym(lib, "cuEventQuery");
    self->event_record = (record_fn)dlsym(lib, "cuEventRecord");
    if (!self->ctx_get || !self->stream_query || !self->event_query || !self->event_record) {
        dlclose(lib);
        PyErr_Format(PyExc_ImportError, "%s lacks one of the CUDA driver's query functions", library);
        return -1;
    }
    if (self->lib != NULL)
        dlclose(self->lib);
    self->lib = lib;
    return 0;
}

static void Queries_dealloc(Queries *self)
{
    if (self->lib != NULL)
        dlclose(self->lib);  /* only drops the count RTLD_NOLOAD took: the library stays */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1 when ``key`` (None: this process has no primary context yet) is the current context. */
static int current(Queries *self, PyObject *key, int *is)
{
    *is = 0;
    if (self->lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Queries was not initialised");
        return -1;
    }
    if (key == Py_None)
        return 0;
    void *want = PyLong_AsVoidPtr(key);
    if (want == NULL && PyErr_Occurred())
        return -1;
    void *ctx = NULL;
    *is = self->ctx_get(&ctx) == CUDA_SUCCESS && ctx == want;
    return 0;
}

static PyObject *answer(int err)
{
    if (err == CUDA_SUCCESS)
        Py_RETURN_TRUE;
    if (err == CUDA_ERROR_NOT_READY)
        Py_RETURN_FALSE;
    Py_RETURN_NONE;
}

static int handles(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, void **out)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        out[i - 1] = PyLong_AsVoidPtr(args[i]);
        if (out[i - 1] == NULL && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* query(handle) in the primary context key: True when done, False when not yet, None when
 * this cannot answer. query is NULL in an uninitialised object, which current() refuses first. */
static PyObject *done(Queries *self, PyObject *const *args, Py_ssize_t nargs, query_fn query)
{
    void *h[1];
    int is;
    if (handles(args, nargs, 2, h) < 0 || current(self, args[0], &is) < 0)
        return NULL;
    if (!is)
        Py_RETURN_NONE;
    return answer(query(h[0]));
}

/* stream_done(key, stream) */
static PyObject *Queries_stream_done(Queries *self, PyObject *const *args, Py_ssize_t nargs)
{
    return done(self, args, nargs, self->stream_query);
}

/* event_done(key, event): for the work before the event's last record. */
static PyObject *Queries_event_done(Queries *self, PyObject *const *args, Py_ssize_t nargs)
{
    return done(self, args, nargs, self->event_query);
}

/* record(key, event, stream): True when recorded; False when not (nothing was recorded). */
static PyObject *Queries_record(Queries *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *h[2];
    int is;
    if (handles(args, nargs, 3, h) < 0 || current(self, args[0], &is) < 0)
        return NULL;
    if (is && self->event_record(h[0], h[1]) == CUDA_SUCCESS)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyMethodDef Queries_methods[] = {
    {"stream_done", (PyCFunction)(void (*)(void))Queries_stream_done, METH_FASTCALL,
     "stream_done(key, stream): cuStreamQuery in the primary context key."},
    {"event_done", (PyCFunction)(void (*)(void))Queries_event_done, METH_FASTCALL,
     "event_done(key, event): cuEventQuery in the primary context key."},
    {"record", (PyCFunction)(void (*)(void))Queries_record, METH_FASTCALL,
     "record(key, event, stream): cuEventRecord in the primary context key."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QueriesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpushare._cuda._cqueries.Queries",
    .tp_basicsize = sizeof(Queries),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The driver's four per-handoff calls, keeping the GIL.",
    .tp_methods = Queries_methods,
    .tp_init = (initproc)Queries_init,
    .tp_dealloc = (destructor)Queries_dealloc,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpushare._cuda._cqueries", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cqueries(void)
{
    if (PyType_Ready(&QueriesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&QueriesType);
    if (PyModule_AddObject(m, "Queries", (PyObject *)&QueriesType) < 0) {
        Py_DECREF(&QueriesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
