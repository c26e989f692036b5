/* Both sides of the commlens ring's slot protocol (layout.py and _record.h: the layout): the producer, in C
 * because it runs twice per collective on the training thread, and the reader's copy of whole records,
 * in C because the ordering that makes a copy safe across processes and CPUs needs explicit acquire
 * and release (read_whole, below).
 *
 * Producer(buffer, slots, claim_offset, records_offset).write(kind, op, flags, pg, op_id, seq,
 * nbytes, sig, peer, aux, where=0, t_ns=now) claims an index with an atomic add on the counter at claim_offset
 * (in the shared header, so producers in several processes may share one ring), writes the head
 * sequence, the payload and the tail sequence with release ordering, and returns the record's
 * timestamp: CLOCK_MONOTONIC in ns, the clock of time.monotonic_ns(), unless t_ns is given.
 * ``where`` is the module attribution: (module string id << 8) | phase.
 * It never waits, takes no lock and allocates nothing but the returned int. With ``wake_fd`` set (a
 * non-blocking pipe's write end, -1 by default), each quarter of the ring it claims also writes one
 * byte there: the reader's signal to drain before the ring laps (memory.py, ``Ring.wake_reader``).
 * The capsule ``write_record`` is the same write for C++ callers, without the GIL (_ddp_hook.cpp), and
 * ``write_record_at`` the same at a given time (the GPU's, on this clock: _gpu.cpp).
 * The sidecar's fold of what a reader copied is _fold.c's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <structmember.h>

#include "_record.h"

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    uint64_t *claim;
    char *records;
    uint64_t mask;
    uint64_t quarter_mask;
    int wake_fd;
} Producer;

static int producer_init(Producer *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "slots", "claim_offset", "records_offset", NULL};
    PyObject *buffer;
    unsigned long long slots;
    Py_ssize_t claim_offset, records_offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKnn", names, &buffer, &slots, &claim_offset,
                                     &records_offset))
        return -1;
    if (self->view.obj != NULL) {  /* __init__ again: let go of the buffer held so far */
        PyBuffer_Release(&self->view);
        self->claim = NULL;
        self->records = NULL;
    }
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
    self->quarter_mask = (slots >> 2 ? slots >> 2 : 1) - 1;
    self->wake_fd = -1;
    return 0;
}

static void producer_dealloc(Producer *self) {
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static uint64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
}

/* One record claimed, written and published: v = kind, op, flags, pg, op_id, seq, nbytes, sig, peer,
 * aux, where. */
static void put(Producer *self, const unsigned long long *v, uint64_t t_ns) {
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
    if (self->wake_fd >= 0 && ((index + 1) & self->quarter_mask) == 0) {
        char byte = 1;  /* a full pipe already holds a wake-up: nothing is lost by a failed write */
        (void)!write(self->wake_fd, &byte, 1);
    }
}

/* write() for C and C++ callers through the capsule ``write_record``, without the GIL: v as for put(),
 * timestamped now; returns the timestamp. The caller keeps ``producer`` alive (an initialised Producer). */
static uint64_t write_record(PyObject *producer, const unsigned long long *v) {
    uint64_t t_ns = now_ns();
    put((Producer *)producer, v, t_ns);
    return t_ns;
}

/* write_record at the time t_ns: a time the caller converted to CLOCK_MONOTONIC (a GPU event's). */
static void write_record_at(PyObject *producer, const unsigned long long *v, uint64_t t_ns) {
    put((Producer *)producer, v, t_ns);
}

static PyObject *producer_write(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->claim == NULL) {
        PyErr_SetString(PyExc_ValueError, "write() on a Producer that was not initialised: create it as "
                        "Producer(buffer, slots, claim_offset, records_offset)");
        return NULL;
    }
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
    uint64_t t_ns = nargs == 12 ? v[11] : now_ns();
    put(self, v, t_ns);
    return PyLong_FromUnsignedLongLong(t_ns);
}

/* read_whole(buffer, slots, claim_offset, records_offset, cursor, limit) -> (bytes, head): the records
 * of indices cursor, cursor + 1, ... that are whole, copied out, up to limit or the first that is not
 * (not yet published, or overwritten: ``head`` is then what that slot's head held, 0 when the run
 * stopped at what producers have claimed).
 *
 * What guarantees a record is whole, on any CPU (x86-64's TSO and aarch64's weaker order alike): the
 * producer stores head, then a release fence, then the payload, then tail with release. The reader
 * loads tail with acquire, copies the slot, issues an acquire fence, then loads head. If the copy
 * saw any store of a later producer of that slot, the producer's release fence (before its payload
 * stores) and the reader's acquire fence (after the loads that saw them) order the later producer's
 * head store before the reader's head load, so head differs and the copy is refused; if tail held
 * index + 1, its acquire orders every store of that record's payload before the copy. A record is
 * accepted only when head == tail == index + 1. */
static PyObject *read_whole(PyObject *module, PyObject *args) {
    Py_buffer view;
    unsigned long long slots, cursor, limit;
    Py_ssize_t claim_offset, records_offset;
    if (!PyArg_ParseTuple(args, "y*KnnKK", &view, &slots, &claim_offset, &records_offset, &cursor, &limit))
        return NULL;
    if (slots < 2 || (slots & (slots - 1)) || claim_offset < 0 || claim_offset % 8 ||
        records_offset < claim_offset + 8 || records_offset + (Py_ssize_t)slots * RECORD_SIZE > view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the buffer is too small for the ring, or the offsets are wrong");
        return NULL;
    }
    const char *records = (const char *)view.buf + records_offset;
    uint64_t claimed = __atomic_load_n((uint64_t *)((char *)view.buf + claim_offset), __ATOMIC_ACQUIRE);
    uint64_t count = claimed > cursor ? claimed - cursor : 0;
    if (count > limit)
        count = limit;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * RECORD_SIZE));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *into = PyBytes_AS_STRING(out);
    uint64_t done = 0, head = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; done < count; done++) {
        uint64_t index = cursor + done;
        record_t *slot = (record_t *)(records + (index & (slots - 1)) * RECORD_SIZE);
        uint64_t tail = __atomic_load_n(&slot->tail, __ATOMIC_ACQUIRE);
        memcpy(into + done * RECORD_SIZE, (const void *)slot, RECORD_SIZE);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        head = __atomic_load_n(&slot->head, __ATOMIC_RELAXED);
        if (head != index + 1 || tail != index + 1)
            break;
        head = 0;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (done < count && _PyBytes_Resize(&out, (Py_ssize_t)(done * RECORD_SIZE)) < 0)
        return NULL;
    return Py_BuildValue("(NK)", out, (unsigned long long)head);
}

/* The string table's two atomic steps (memory.py): claim(buffer, offset, n) adds n to the uint64 at
 * offset and returns what it held (a producer's share of the arena, in any process); publish(buffer,
 * offset, length) stores a string's uint32 length with release ordering once its bytes are written,
 * and published(buffer, offset) loads it with acquire ordering: 0 until then. */
static int u64_at(Py_buffer *view, Py_ssize_t offset, Py_ssize_t width) {
    if (offset < 0 || offset % width || offset + width > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "offset outside the ring's memory, or not aligned");
        return -1;
    }
    return 0;
}

static PyObject *claim(PyObject *module, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &n) || u64_at(&view, offset, 8) < 0)
        return NULL;
    uint64_t old = __atomic_fetch_add((uint64_t *)((char *)view.buf + offset), (uint64_t)n, __ATOMIC_RELAXED);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

static PyObject *publish(PyObject *module, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    unsigned int length;
    if (!PyArg_ParseTuple(args, "w*nI", &view, &offset, &length) || u64_at(&view, offset, 4) < 0)
        return NULL;
    __atomic_store_n((uint32_t *)((char *)view.buf + offset), (uint32_t)length, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *published(PyObject *module, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "y*n", &view, &offset) || u64_at(&view, offset, 4) < 0)
        return NULL;
    uint32_t length = __atomic_load_n((uint32_t *)((char *)view.buf + offset), __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(length);
}

static PyMethodDef module_methods[] = {
    {"claim", claim, METH_VARARGS, "claim(buffer, offset, n) -> the uint64 at offset before n was added"},
    {"publish", publish, METH_VARARGS, "publish(buffer, offset, length): a release store of a uint32"},
    {"published", published, METH_VARARGS, "published(buffer, offset) -> an acquire load of a uint32"},
    {"read_whole", read_whole, METH_VARARGS,
     "read_whole(buffer, slots, claim_offset, records_offset, cursor, limit) -> (bytes, head)"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef producer_methods[] = {
    {"write", (PyCFunction)(void (*)(void))producer_write, METH_FASTCALL,
     "write(kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, where=0, t_ns=now) -> t_ns"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef producer_members[] = {
    {"wake_fd", T_INT, offsetof(Producer, wake_fd), 0,
     "a non-blocking pipe's write end: one byte each quarter of the ring claimed; -1: none"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ProducerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "commlens.ring._producer.Producer",
    .tp_basicsize = sizeof(Producer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writes records into a commlens ring; never waits, never locks.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)producer_init,
    .tp_dealloc = (destructor)producer_dealloc,
    .tp_methods = producer_methods,
    .tp_members = producer_members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_producer", NULL, -1, module_methods};

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
    PyObject *capsule = PyCapsule_New((void *)write_record, "commlens.ring._producer.write_record", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "write_record", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    capsule = PyCapsule_New((void *)write_record_at, "commlens.ring._producer.write_record_at", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "write_record_at", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
