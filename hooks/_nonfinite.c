/* One pass over a CPU tensor's contiguous memory: whether every element of it is finite.
 *
 * The test is _finite.h's: an AND, an ADD and an OR per element in unsigned integers: no rounding, no
 * overflow (a sum can overflow on finite values), no temporary, and a loop the compiler vectorises. It is the NaN check's common case on
 * the CPU (hooks/nan_check.py); a tensor it finds non-finite is then counted, NaN and Inf apart, by a
 * second pass (an all-ones exponent with a zero mantissa is Inf, with any other a NaN), so that a job
 * whose every collective holds Inf (a diverged job, an overflow storm) pays two passes, not torch's
 * reductions. The caller keeps it to tensors small enough to scan within a few µs holding the GIL.
 * In C to the tensor (no Python frame), since the hot path calls it for every collective it records.
 *
 *     scanned(t, (t.numel(), KIND_FLOAT32))  -> True / False, or None: t's memory cannot be read here
 *     counted(t, (t.numel(), KIND_FLOAT32))  -> (NaNs, Infs), or None
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_finite.h"
#include "_tensor_memory.h"

enum { KIND_FLOAT32, KIND_FLOAT64, KIND_FLOAT16, KIND_BFLOAT16, KINDS };

/* A block's worth of accumulators (256 bytes: four AVX-512 or eight AVX2 registers) lets the ORs of
 * consecutive vectors run side by side: one accumulator chains every OR to the one before, and halves
 * the speed of a scan of data in cache (bench/nan_check.py: 1 MiB of float32 in 17 µs, now ~8). */
#define SCAN(NAME, UINT, CARRY, SIGN)                                                               \
    WITH_SIMD_CLONES                                                                                \
    static int NAME(const UINT *x, Py_ssize_t n) {                                                  \
        enum { BLOCK = 256 / sizeof(UINT) };                                                        \
        UINT block[BLOCK] = {0}, carried = 0;                                                       \
        Py_ssize_t i = 0;                                                                           \
        for (; i + BLOCK <= n; i += BLOCK)                                                          \
            for (int k = 0; k < BLOCK; k++)                                                         \
                block[k] |= CARRY(x[i + k]);                                                        \
        for (; i < n; i++)                                                                          \
            carried |= CARRY(x[i]);                                                                 \
        for (int k = 0; k < BLOCK; k++)                                                             \
            carried |= block[k];                                                                    \
        return !(carried & (UINT)(SIGN));                                                           \
    }

SCAN(finite32, uint32_t, CARRY32, NONFINITE32)
SCAN(finite64, uint64_t, CARRY64, NONFINITE64)
SCAN(finite16, uint16_t, CARRY16, NONFINITE16)
SCAN(finite_bf16, uint16_t, CARRY_BF16, NONFINITE16)

static int scan(const void *x, Py_ssize_t n, int kind) {
    switch (kind) {
    case KIND_FLOAT32: return finite32(x, n);
    case KIND_FLOAT64: return finite64(x, n);
    case KIND_FLOAT16: return finite16(x, n);
    default: return finite_bf16(x, n);
    }
}

/* Branch-free, so that it vectorises: each element adds 1 to the non-finite count when its exponent is
 * all ones, and 1 to the NaN count when its mantissa is not zero as well. */
#define COUNT(NAME, UINT, EXPONENT, MANTISSA)                                                       \
    WITH_SIMD_CLONES                                                                                \
    static void NAME(const UINT *x, Py_ssize_t n, Py_ssize_t *nans, Py_ssize_t *infs) {             \
        UINT nonfinite = 0, nan = 0; /* per chunk, in the element's width: no overflow within one */ \
        enum { CHUNK = (1 << (sizeof(UINT) * 8 - 1 < 24 ? sizeof(UINT) * 8 - 1 : 24)) };            \
        for (Py_ssize_t i = 0; i < n; i += CHUNK) {                                                 \
            Py_ssize_t end = i + CHUNK < n ? i + CHUNK : n;                                         \
            nonfinite = 0, nan = 0;                                                                 \
            for (Py_ssize_t k = i; k < end; k++) {                                                  \
                UINT all_ones = (UINT)((x[k] & (UINT)(EXPONENT)) == (UINT)(EXPONENT));              \
                nonfinite += all_ones;                                                              \
                nan += all_ones & (UINT)((x[k] & (UINT)(MANTISSA)) != 0);                           \
            }                                                                                       \
            *nans += nan;                                                                           \
            *infs += nonfinite - nan;                                                               \
        }                                                                                           \
    }

COUNT(count32, uint32_t, 0x7f800000u, 0x007fffffu)
COUNT(count64, uint64_t, 0x7ff0000000000000ull, 0x000fffffffffffffull)
COUNT(count16, uint16_t, 0x7c00u, 0x03ffu)
COUNT(count_bf16, uint16_t, 0x7f80u, 0x007fu)

static void count(const void *x, Py_ssize_t n, int kind, Py_ssize_t *nans, Py_ssize_t *infs) {
    switch (kind) {
    case KIND_FLOAT32: count32(x, n, nans, infs); break;
    case KIND_FLOAT64: count64(x, n, nans, infs); break;
    case KIND_FLOAT16: count16(x, n, nans, infs); break;
    default: count_bf16(x, n, nans, infs);
    }
}

/* The arguments (t, (floats, kind)) of ``name``; 0 when they are accepted, -1 with an exception set. */
static int parse(const char *name, PyObject *const *args, Py_ssize_t nargs, unsigned long long *floats, int *kind) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(t, (floats, kind)) takes 2 arguments (%zd given)", name, nargs);
        return -1;
    }
    if (!PyArg_ParseTuple(args[1], "Ki", floats, kind))
        return -1;
    if (*kind < 0 || *kind >= KINDS) {
        PyErr_Format(PyExc_ValueError, "%s: kind %d is not accepted (0 to %d)", name, *kind, KINDS - 1);
        return -1;
    }
    return 0;
}

/* scanned(t, (floats, kind)): finite.py's ``scanned``. None when t's memory cannot be read here. */
static PyObject *scanned(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long floats;
    int kind;
    if (parse("scanned", args, nargs, &floats, &kind) < 0)
        return NULL;
    if (floats == 0)
        Py_RETURN_TRUE;
    long long address = readable_address(args[0]);
    if (address < 0)
        return NULL;
    if (address == 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(scan((const void *)(uintptr_t)address, (Py_ssize_t)floats, kind));
}

/* counted(t, (floats, kind)): finite.py's ``counted``: (NaNs, Infs) among t's first floats of the kind;
 * None when t's memory cannot be read here. A count of over COUNT_HOLDING_THE_GIL floats lets other
 * threads run (the caller holds t; writing to a collective's input meanwhile is the caller's race). */
#define COUNT_HOLDING_THE_GIL (1 << 18)
static PyObject *counted(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long floats;
    int kind;
    if (parse("counted", args, nargs, &floats, &kind) < 0)
        return NULL;
    long long address = floats == 0 ? 1 : readable_address(args[0]);
    if (address < 0)
        return NULL;
    if (address == 0)
        Py_RETURN_NONE;
    Py_ssize_t nans = 0, infs = 0;
    if (floats > COUNT_HOLDING_THE_GIL) {  /* ~4 ms for 64 MiB of float32: other threads run meanwhile */
        Py_BEGIN_ALLOW_THREADS
        count((const void *)(uintptr_t)address, (Py_ssize_t)floats, kind, &nans, &infs);
        Py_END_ALLOW_THREADS
    } else if (floats) {
        count((const void *)(uintptr_t)address, (Py_ssize_t)floats, kind, &nans, &infs);
    }
    return Py_BuildValue("nn", nans, infs);
}

static PyMethodDef methods[] = {
    {"scanned", (PyCFunction)(void (*)(void))scanned, METH_FASTCALL,
     "scanned(t, (floats, kind)) -> whether t's first floats of the kind are all finite; None: not readable here"},
    {"counted", (PyCFunction)(void (*)(void))counted, METH_FASTCALL,
     "counted(t, (floats, kind)) -> (NaNs, Infs) among t's first floats of the kind; None: not readable here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nonfinite", NULL, -1, methods};

PyMODINIT_FUNC PyInit__nonfinite(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "KIND_FLOAT32", KIND_FLOAT32) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT64", KIND_FLOAT64) < 0 ||
        PyModule_AddIntConstant(m, "KIND_FLOAT16", KIND_FLOAT16) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BFLOAT16", KIND_BFLOAT16) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
