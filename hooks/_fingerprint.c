/* A collective's result as one number, to compare across the ranks that must hold the same bytes (an
 * all_reduce's, a broadcast's, an all_gather's output): silent corruption shows as a rank whose number
 * differs from its group's.
 *
 * The number is two sums over the bytes as uint32 words w_i, in one pass the compiler vectorises: the
 * weighted sum of w_i * (2i + 1) mod 2^32, which any flipped bit changes (each weight is odd, so a
 * change of +-2^b in one word is never 0 mod 2^32) and which two words swapped change unless their
 * difference is 0 mod 2^31 / (j - i); and the plain sum's low 16 bits beside it: 48 bits in all, so that
 * a Prometheus sample (a float64) holds it exactly. The tail (nbytes % 4) is added as a last word.
 * Over FINGERPRINT_HOLDING_THE_GIL bytes other threads run meanwhile (the caller holds the tensor).
 *
 *     fingerprint(t, nbytes)  -> int (< 2^48), or None: t's memory cannot be read here
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_finite.h"
#include "_tensor_memory.h"

#define FINGERPRINT_HOLDING_THE_GIL (1 << 20)

WITH_SIMD_CLONES
static uint64_t sums(const uint32_t *w, Py_ssize_t n, uint32_t *plain) {
    uint32_t weighted = 0, sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        weighted += w[i] * (uint32_t)(2 * i + 1);
        sum += w[i];
    }
    *plain = sum;
    return weighted;
}

static uint64_t hash(const unsigned char *bytes, Py_ssize_t nbytes) {
    Py_ssize_t words = nbytes / 4;
    uint32_t plain, tail = 0;
    uint64_t weighted = sums((const uint32_t *)bytes, words, &plain);
    if (nbytes % 4) {
        memcpy(&tail, bytes + 4 * words, (size_t)(nbytes % 4));
        weighted = (uint32_t)(weighted + tail * (uint32_t)(2 * words + 1));
        plain += tail;
    }
    return weighted | (uint64_t)(plain & 0xffffu) << 32;
}

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
        found = hash((const unsigned char *)(uintptr_t)address, nbytes);
        Py_END_ALLOW_THREADS
    } else if (nbytes) {
        found = hash((const unsigned char *)(uintptr_t)address, nbytes);
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
