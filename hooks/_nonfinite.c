/* One pass over a CPU tensor's contiguous memory: whether every element of it is finite.
 *
 * An IEEE float is NaN or Inf exactly when all its exponent bits are set: adding one to the exponent
 * field of such an element carries into the sign bit, and of no other. So the pass is an AND, an ADD
 * and an OR per element in unsigned integers: no rounding, no overflow (a sum can overflow on finite
 * values), no temporary, and a loop the compiler vectorises. It is the NaN check's common case on
 * the CPU (hooks/nan_check.py); a tensor it finds non-finite is then counted element by element by
 * torch. The caller keeps it to tensors small enough to scan within a few µs holding the GIL.
 *
 *     all_finite(t.data_ptr(), t.numel(), KIND_FLOAT32) -> True / False   (a null address: ValueError)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { KIND_FLOAT32, KIND_FLOAT64, KIND_FLOAT16, KIND_BFLOAT16, KINDS };

/* On x86-64 Linux, copies of each scan for CPUs with AVX-512 (64 bytes an instruction) and AVX2 (32),
 * chosen when the module loads; elsewhere (aarch64's NEON, macOS) the one the compiler vectorises. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WITH_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WITH_SIMD_CLONES
#define WITH_SIMD_CLONES
#endif

/* A block's worth of accumulators (256 bytes: four AVX-512 or eight AVX2 registers) lets the ORs of
 * consecutive vectors run side by side: one accumulator chains every OR to the one before, and halves
 * the speed of a scan of data in cache (bench/nan_check.py: 1 MiB of float32 in 17 µs, now ~8). */
#define SCAN(NAME, UINT, EXPONENT, LOWEST_EXPONENT_BIT, SIGN)                                      \
    WITH_SIMD_CLONES                                                                                \
    static int NAME(const UINT *x, Py_ssize_t n) {                                                  \
        enum { BLOCK = 256 / sizeof(UINT) };                                                        \
        UINT block[BLOCK] = {0}, carried = 0;                                                       \
        Py_ssize_t i = 0;                                                                           \
        for (; i + BLOCK <= n; i += BLOCK)                                                          \
            for (int k = 0; k < BLOCK; k++)                                                         \
                block[k] |= (UINT)((x[i + k] & (UINT)(EXPONENT)) + (UINT)(LOWEST_EXPONENT_BIT));    \
        for (; i < n; i++)                                                                          \
            carried |= (UINT)((x[i] & (UINT)(EXPONENT)) + (UINT)(LOWEST_EXPONENT_BIT));             \
        for (int k = 0; k < BLOCK; k++)                                                             \
            carried |= block[k];                                                                    \
        return !(carried & (UINT)(SIGN));                                                           \
    }

SCAN(finite32, uint32_t, 0x7f800000u, 0x00800000u, 0x80000000u)
SCAN(finite64, uint64_t, 0x7ff0000000000000ull, 0x0010000000000000ull, 0x8000000000000000ull)
SCAN(finite16, uint16_t, 0x7c00u, 0x0400u, 0x8000u)
SCAN(finite_bf16, uint16_t, 0x7f80u, 0x0080u, 0x8000u)

static int scan(const void *x, Py_ssize_t n, int kind) {
    switch (kind) {
    case KIND_FLOAT32: return finite32(x, n);
    case KIND_FLOAT64: return finite64(x, n);
    case KIND_FLOAT16: return finite16(x, n);
    default: return finite_bf16(x, n);
    }
}

static PyObject *all_finite(PyObject *module, PyObject *args) {
    unsigned long long address;
    Py_ssize_t n;
    int kind;
    if (!PyArg_ParseTuple(args, "Kni", &address, &n, &kind))
        return NULL;
    if (kind < 0 || kind >= KINDS || n < 0 || (address == 0 && n > 0)) {
        PyErr_Format(PyExc_ValueError, "all_finite: kind %d, count %zd at address %llu is not accepted", kind, n,
                     address);
        return NULL;
    }
    return PyBool_FromLong(scan((const void *)(uintptr_t)address, n, kind));
}

static PyMethodDef methods[] = {
    {"all_finite", all_finite, METH_VARARGS,
     "all_finite(address, count, kind) -> whether none of the count floats of the kind at address is NaN or Inf"},
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
