/* A collective's result as one number, to compare across the ranks that must hold the same bytes (an
 * all_reduce's, a broadcast's, an all_gather's output): silent corruption shows as a rank whose number
 * differs from its group's.
 *
 * Over FINGERPRINT_HOLDING_THE_GIL bytes other threads run meanwhile (the caller holds the tensor).
 *
 *     fingerprint(t)  -> int (< 2^48), or None: t's memory cannot be read here
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_fingerprint.h"
#include "_tensor_memory.h"

static PyObject *fingerprint(PyObject *module, PyObject *t) {
    PyObject *size = PyObject_GetAttrString(t, "nbytes");
    Py_ssize_t nbytes = size == NULL ? -1 : PyLong_AsSsize_t(size);
    Py_XDECREF(size);
    if (nbytes < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "fingerprint(t) takes a tensor");
        return NULL;
    }
    long long address = nbytes == 0 ? 1 : readable_address(t);
    if (address < 0)
        return NULL;
    if (address == 0)
        Py_RETURN_NONE;
    uint64_t found = 0;
    if (nbytes > FINGERPRINT_HOLDING_THE_GIL) {
        Py_BEGIN_ALLOW_THREADS
        found = fingerprint_of((const unsigned char *)(uintptr_t)address, nbytes);
        Py_END_ALLOW_THREADS
    } else if (nbytes) {
        found = fingerprint_of((const unsigned char *)(uintptr_t)address, nbytes);
    }
    return PyLong_FromUnsignedLongLong(found);
}

static PyMethodDef methods[] = {
    {"fingerprint", fingerprint, METH_O, "fingerprint(t) -> t's bytes as a 48-bit number; None: t is not readable here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fingerprint", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fingerprint(void) { return PyModule_Create(&module); }
