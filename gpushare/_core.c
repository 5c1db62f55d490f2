/* gpushare's compiled core, one extension module (``gpushare._core``) built with the package
 * (setup.py) from three files: this one, which makes the module, ``_region.c`` (``Ring``: the
 * Queue region's put and get) and ``_handoff.c`` (``Arrivals`` and ``Shares``: a buffer's
 * handoff at both ends of a Queue). gpushare._native imports it at first use; the Python path
 * runs the same protocol where it was not built. The driver's per-handoff queries are an
 * extension of the CUDA layer's own (``gpushare._cuda._cqueries``), loaded only with CUDA.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int gpushare_region_add(PyObject *module);
int gpushare_handoff_add(PyObject *module);

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpushare._core", NULL, -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (gpushare_region_add(m) < 0 || gpushare_handoff_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
