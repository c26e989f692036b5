/* A collective's result as one number, to compare across the ranks that must hold the same bytes (an
 * all_reduce's, a broadcast's, an all_gather's output): silent corruption shows as a rank whose number
 * differs from its group's.
 *
 * Over FINGERPRINT_HOLDING_THE_GIL bytes other threads run meanwhile (the caller holds the tensor).
 *
 *     fingerprint(t, nbytes)  -> int (< 2^48), or None: t's memory cannot be read here
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_fingerprint.h"
#include "_tensor_memory.h"

#define FINGERPRINT_HOLDING_THE_GIL (1 << 20)

static PyObject *fingerprint(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t nbytes;
    if (nargs != 2 || (nbytes = PyLong_AsSsize_t(args[1])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "fingerprint(t, nbytes) takes a tensor and its size in bytes, >= 0");
        return NULL;
    }
    long long address = nbytes == 0 ? 1 : readable_address(args[0]);
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
    {"fingerprint", (PyCFunction)(void (*)(void))fingerprint, METH_FASTCALL,
     "fingerprint(t, nbytes) -> t's first nbytes as a 48-bit number; None: t is not readable here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fingerprint", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fingerprint(void) { return PyModule_Create(&module); }
