/* The thread's issuing flag: true while one of commlens' wrappers issues a collective it records, so
 * that PyTorch's own process-group hooks step aside (native.py). In C so that the C++ forwarder of
 * those hooks (_pg_hooks.cpp) reads it without the GIL, through the capsule ``now``, and the C++ DDP
 * hook (_ddp_hook.cpp) sets it through ``set``.
 *
 *     was = set_issuing(True)   # -> the flag before
 *     issuing()                 # -> True on this thread
 *     set_issuing(was)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static _Thread_local int flag;

static int now(void) { return flag; }

static int set(int on) {
    int was = flag;
    flag = on;
    return was;
}

static PyObject *issuing(PyObject *module, PyObject *unused) { return PyBool_FromLong(flag); }

static PyObject *set_issuing(PyObject *module, PyObject *value) {
    int on = PyObject_IsTrue(value);
    if (on < 0)
        return NULL;
    return PyBool_FromLong(set(on));
}

static PyMethodDef methods[] = {
    {"issuing", issuing, METH_NOARGS, "issuing() -> whether this thread is issuing a recorded collective"},
    {"set_issuing", set_issuing, METH_O, "set_issuing(on) -> the flag before"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_issuing", NULL, -1, methods};

PyMODINIT_FUNC PyInit__issuing(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New((void *)now, "commlens.hooks._issuing.now", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "now", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    capsule = PyCapsule_New((void *)set, "commlens.hooks._issuing.set", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "set", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
