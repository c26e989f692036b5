/* The producer side of the commlens ring (see ring.py for the layout), in C because it runs twice
 * per collective on the training thread.
 *
 * Producer(buffer, slots, claim_offset, records_offset).write(kind, op, flags, pg, op_id, seq,
 * nbytes, sig, peer, aux, where=0, t_ns=now) claims an index with an atomic add on the counter at claim_offset
 * (in the shared header, so producers in several processes may share one ring), writes the head
 * sequence, the payload and the tail sequence with release ordering, and returns the record's
 * timestamp: CLOCK_MONOTONIC in ns, the clock of time.monotonic_ns(), unless t_ns is given.
 * ``where`` is the module attribution: (module string id << 8) | phase.
 * It never waits, takes no lock and allocates nothing but the returned int.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define RECORD_SIZE 72

#pragma pack(push, 1)
typedef struct {
    uint64_t head;
    uint8_t kind, op, flags, phase;
    uint32_t pg;
    uint64_t op_id, seq, t_ns, nbytes;
    uint32_t sig;
    int32_t peer;
    uint32_t aux;
    uint32_t module;
    uint64_t tail;
} record_t;
#pragma pack(pop)

_Static_assert(sizeof(record_t) == RECORD_SIZE, "record layout must match ring.RECORD");

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *claim;
    char *records;
    uint64_t mask;
} Producer;

static int producer_init(Producer *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "slots", "claim_offset", "records_offset", NULL};
    PyObject *buffer;
    unsigned long long slots;
    Py_ssize_t claim_offset, records_offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKnn", names, &buffer, &slots, &claim_offset,
                                     &records_offset))
        return -1;
    if (slots < 2 || (slots & (slots - 1))) {
        PyErr_Format(PyExc_ValueError, "slots=%llu is not accepted: it must be a power of two >= 2", slots);
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    if (claim_offset < 0 || claim_offset % 8 || records_offset < claim_offset + 8 ||
        records_offset + (Py_ssize_t)slots * RECORD_SIZE > self->view.len) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "the buffer is too small for the ring, or the offsets are wrong");
        return -1;
    }
    self->claim = (uint64_t *)((char *)self->view.buf + claim_offset);
    self->records = (char *)self->view.buf + records_offset;
    self->mask = slots - 1;
    return 0;
}

static void producer_dealloc(Producer *self) {
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *producer_write(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 10 || nargs > 12) {
        PyErr_Format(PyExc_TypeError, "write() takes 10 to 12 arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long long v[12] = {0};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (i == 8) {  /* peer is signed */
            long long peer = PyLong_AsLongLong(args[i]);
            if (peer == -1 && PyErr_Occurred())
                return NULL;
            v[i] = (unsigned long long)peer;
        } else {
            v[i] = PyLong_AsUnsignedLongLong(args[i]);
            if (v[i] == (unsigned long long)-1 && PyErr_Occurred())
                return NULL;
        }
    }
    uint64_t t_ns;
    if (nargs == 12) {
        t_ns = v[11];
    } else {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        t_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
    }
    uint64_t index = __atomic_fetch_add(self->claim, 1, __ATOMIC_RELAXED);
    record_t *slot = (record_t *)(self->records + (index & self->mask) * RECORD_SIZE);
    record_t r = {0};
    r.head = index + 1;
    r.kind = (uint8_t)v[0];
    r.op = (uint8_t)v[1];
    r.flags = (uint8_t)v[2];
    r.pg = (uint32_t)v[3];
    r.op_id = v[4];
    r.seq = v[5];
    r.t_ns = t_ns;
    r.nbytes = v[6];
    r.sig = (uint32_t)v[7];
    r.peer = (int32_t)v[8];
    r.aux = (uint32_t)v[9];
    r.phase = (uint8_t)(v[10] & 0xFF);
    r.module = (uint32_t)(v[10] >> 8);
    r.tail = index + 1;
    /* head first, then the payload, then tail: a reader that finds head == tail == index + 1 after
     * reading the payload read it whole. */
    __atomic_store_n(&slot->head, r.head, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy((char *)slot + 8, (char *)&r + 8, RECORD_SIZE - 16);
    __atomic_store_n(&slot->tail, r.tail, __ATOMIC_RELEASE);
    return PyLong_FromUnsignedLongLong(t_ns);
}

static PyMethodDef producer_methods[] = {
    {"write", (PyCFunction)(void (*)(void))producer_write, METH_FASTCALL,
     "write(kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, where=0, t_ns=now) -> t_ns"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ProducerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlens.hooks._producer.Producer",
    .tp_basicsize = sizeof(Producer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writes records into a commlens ring; never waits, never locks.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)producer_init,
    .tp_dealloc = (destructor)producer_dealloc,
    .tp_methods = producer_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_producer", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__producer(void) {
    if (PyType_Ready(&ProducerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ProducerType);
    if (PyModule_AddObject(m, "Producer", (PyObject *)&ProducerType) < 0) {
        Py_DECREF(&ProducerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
