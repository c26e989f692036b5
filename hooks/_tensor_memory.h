/* A CPU tensor's memory as C reads it (_nonfinite.c's scan, _fingerprint.c's hash), through the tensor's
 * Python attributes: no torch headers, no build against torch. */
#ifndef COMMLENS_TENSOR_MEMORY_H
#define COMMLENS_TENSOR_MEMORY_H

#include <Python.h>

/* The address of t's data when it is a contiguous CPU tensor with data; 0 when its memory cannot be
 * read here (a CUDA, sparse, strided, fake or wrapper tensor); -1 with an exception set. */
static inline long long readable_address(PyObject *t) {
    unsigned long long address = 0;
    PyObject *cpu = PyObject_GetAttrString(t, "is_cpu");
    int readable = cpu == NULL ? -1 : PyObject_IsTrue(cpu);
    Py_XDECREF(cpu);
    if (readable > 0) {
        PyObject *contiguous = PyObject_CallMethod(t, "is_contiguous", NULL);
        readable = contiguous == NULL ? -1 : PyObject_IsTrue(contiguous);
        Py_XDECREF(contiguous);
    }
    if (readable > 0) {
        PyObject *pointer = PyObject_CallMethod(t, "data_ptr", NULL);
        address = pointer == NULL ? 0 : PyLong_AsUnsignedLongLong(pointer);
        Py_XDECREF(pointer);
        readable = PyErr_Occurred() ? -1 : address != 0;
    }
    if (readable < 0) {  /* no storage (sparse, fake), or no notion of contiguity (sparse CSR) */
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))
            return -1;
        PyErr_Clear();
    }
    return readable > 0 ? (long long)address : 0;
}

#endif
