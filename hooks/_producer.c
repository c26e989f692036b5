/* Both sides of the commlens ring's slot protocol (see ring.py for the layout): the producer, in C
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
 * byte there: the reader's signal to drain before the ring laps (ring.py, ``Ring.wake_reader``).
 * The capsule ``write_record`` is the same write for C++ callers, without the GIL (_ddp_hook.cpp).
 * fold_run (below) groups the collectives a reader copied whole.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <structmember.h>

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

/* The string table's two atomic steps (ring.py): claim(buffer, offset, n) adds n to the uint64 at
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

/* fold_run(data, record_type, start, end, gpu_start) -> (records, groups): the records of ``data``
 * (whole records as read_whole copied them), where each ``start`` record whose ``end`` record with
 * status ok (flags 0) follows in ``data``, with no other record of its op_id there (a NAN) but at most
 * one ``gpu_start`` between them, is folded away into one group per (op, pg, nbytes, sig, timed on a
 * GPU or not), in order of first appearance: (op, pg, nbytes, sig, seqs, seconds, records, gpu) where
 * seqs are uint64, seconds float64 (end - start), records the collectives' own (START, END, or START,
 * GPU_START, END: 72 bytes each) and gpu, for a GPU's group, float64 pairs (queue, execution): the GPU
 * start, within [start, end], less start, and end less it. ``records``: every other record, in
 * order, as ``record_type`` tuples. Most collectives start and end within one drain: their counting
 * then costs the reader no Python object each (agent/sidecar.py). */
typedef struct {
    uint64_t *keys;
    Py_ssize_t *values; /* index + 1; 0: empty */
    Py_ssize_t mask;
} table_t;

static int table_init(table_t *t, Py_ssize_t n) {
    Py_ssize_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    t->keys = malloc(cap * sizeof(uint64_t));
    t->values = calloc(cap, sizeof(Py_ssize_t));
    t->mask = cap - 1;
    return t->keys != NULL && t->values != NULL;
}

static Py_ssize_t *table_slot(table_t *t, uint64_t key) {
    Py_ssize_t slot = (Py_ssize_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & t->mask;
    while (t->values[slot] && t->keys[slot] != key)
        slot = (slot + 1) & t->mask;
    t->keys[slot] = key;
    return &t->values[slot];
}

static void table_free(table_t *t) {
    free(t->keys);
    free(t->values);
}

static PyObject *record_tuple(PyTypeObject *type, const record_t *r) {
    PyObject *t = type->tp_alloc(type, 15);
    if (t == NULL)
        return NULL;
    PyObject *items[15] = {PyLong_FromUnsignedLongLong(r->head), PyLong_FromLong(r->kind), PyLong_FromLong(r->op),
                           PyLong_FromLong(r->flags), PyLong_FromLong(r->phase), PyLong_FromUnsignedLong(r->pg),
                           PyLong_FromUnsignedLongLong(r->op_id), PyLong_FromUnsignedLongLong(r->seq),
                           PyLong_FromUnsignedLongLong(r->t_ns), PyLong_FromUnsignedLongLong(r->nbytes),
                           PyLong_FromUnsignedLong(r->sig), PyLong_FromLong(r->peer), PyLong_FromUnsignedLong(r->aux),
                           PyLong_FromUnsignedLong(r->module), PyLong_FromUnsignedLongLong(r->tail)};
    for (int i = 0; i < 15; i++) {
        if (items[i] == NULL) {
            for (int j = i; j < 15; j++)
                Py_XDECREF(items[j]);
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

typedef struct {
    const record_t *first; /* its key: op, pg, nbytes, sig, and whether a GPU timed it */
    int gpu, width;        /* width: records a collective (2, or 3 with its GPU_START) */
    Py_ssize_t count;
    uint64_t *seqs;
    double *seconds, *gpu_seconds;
    record_t *records;
} group_t;

static PyObject *group_tuple(const group_t *g) {
    return Py_BuildValue("(iIKIy#y#y#y#)", (int)g->first->op, (unsigned)g->first->pg,
                         (unsigned long long)g->first->nbytes, (unsigned)g->first->sig, (const char *)g->seqs,
                         g->count * (Py_ssize_t)sizeof(uint64_t), (const char *)g->seconds,
                         g->count * (Py_ssize_t)sizeof(double), (const char *)g->records,
                         g->width * g->count * (Py_ssize_t)RECORD_SIZE, (const char *)g->gpu_seconds,
                         g->gpu ? 2 * g->count * (Py_ssize_t)sizeof(double) : 0);
}

static PyObject *fold_run(PyObject *module, PyObject *args) {
    Py_buffer view;
    PyTypeObject *record_type;
    int start_kind, end_kind, gpu_kind;
    if (!PyArg_ParseTuple(args, "y*O!iii", &view, &PyType_Type, &record_type, &start_kind, &end_kind, &gpu_kind))
        return NULL;
    if (!PyType_IsSubtype(record_type, &PyTuple_Type) || view.len % RECORD_SIZE) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fold_run takes whole records and a tuple type");
        return NULL;
    }
    Py_ssize_t n = view.len / RECORD_SIZE, m = n ? n : 1, groups = 0;
    const record_t *records = (const record_t *)view.buf;
    table_t ends = {0}, gpus = {0}, others = {0}, shapes = {0};
    Py_ssize_t *partner = calloc(m, sizeof(Py_ssize_t)); /* END index -> index + 1 of its START */
    Py_ssize_t *gpu_of = calloc(m, sizeof(Py_ssize_t));  /* END index -> index + 1 of its GPU_START, or 0 */
    group_t *group = calloc(m, sizeof(group_t));
    uint64_t *seqs = malloc(m * sizeof(uint64_t));
    double *seconds = malloc(m * sizeof(double)), *gpu_seconds = malloc(2 * m * sizeof(double));
    record_t *kept = malloc(m * sizeof(record_t));
    Py_ssize_t *member = malloc(m * sizeof(Py_ssize_t)); /* END index -> its group */
    char *folded_away = calloc(m, 1);                     /* a START or GPU_START folded with its END */
    PyObject *out = NULL, *rest = NULL, *folded = NULL;
    if (!table_init(&ends, n) || !table_init(&gpus, n) || !table_init(&others, n) || !table_init(&shapes, n) ||
        partner == NULL || gpu_of == NULL || group == NULL || seqs == NULL || seconds == NULL ||
        gpu_seconds == NULL || kept == NULL || member == NULL || folded_away == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* each op_id's ok END and GPU_START, and the op_ids with others */
        const record_t *r = &records[i];
        if (r->kind == end_kind && r->flags == 0) {
            Py_ssize_t *found = table_slot(&ends, r->op_id);
            if (!*found)
                *found = i + 1;
        } else if (r->kind == gpu_kind) {
            Py_ssize_t *found = table_slot(&gpus, r->op_id);
            if (*found) /* a second one: not the common case, left to the reader */
                *table_slot(&others, r->op_id) = 1;
            *found = i + 1;
        } else if (r->kind != start_kind && r->kind != end_kind) {
            *table_slot(&others, r->op_id) = 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* pair each START with its END, and count each pair's group */
        const record_t *r = &records[i];
        if (r->kind != start_kind)
            continue;
        Py_ssize_t j = *table_slot(&ends, r->op_id) - 1, g_at = *table_slot(&gpus, r->op_id) - 1;
        if (j <= i || partner[j] || *table_slot(&others, r->op_id) || (g_at >= 0 && (g_at < i || g_at > j)))
            continue;
        int gpu = g_at >= 0;
        partner[j] = i + 1;
        gpu_of[j] = g_at + 1;
        folded_away[i] = 1;
        if (gpu)
            folded_away[g_at] = 1;
        uint64_t key = ((uint64_t)r->op << 56) ^ ((uint64_t)r->pg << 32) ^ r->sig ^ (r->nbytes * 0xC2B2AE3D27D4EB4Full) ^
                       ((uint64_t)gpu << 63);
        Py_ssize_t *g = table_slot(&shapes, key);
        while (*g) { /* a key shared by two shapes: probe on past the other */
            const group_t *other = &group[*g - 1];
            const record_t *f = other->first;
            if (f->op == r->op && f->pg == r->pg && f->nbytes == r->nbytes && f->sig == r->sig && other->gpu == gpu)
                break;
            g = table_slot(&shapes, ++key);
        }
        if (!*g) {
            group[groups].first = r;
            group[groups].gpu = gpu;
            group[groups].width = gpu ? 3 : 2;
            *g = ++groups;
        }
        member[j] = *g - 1;
        group[*g - 1].count++;
    }
    Py_ssize_t offset = 0, record_offset = 0;
    for (Py_ssize_t k = 0; k < groups; k++) { /* each group's slice of the arrays */
        group[k].seqs = seqs + offset;
        group[k].seconds = seconds + offset;
        group[k].gpu_seconds = gpu_seconds + 2 * offset;
        group[k].records = kept + record_offset;
        offset += group[k].count;
        record_offset += group[k].width * group[k].count;
        group[k].count = 0;
    }
    rest = PyList_New(0);
    if (rest == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        const record_t *r = &records[i];
        if (partner[i]) {
            const record_t *s = &records[partner[i] - 1];
            group_t *g = &group[member[i]];
            record_t *own = g->records + g->width * g->count;
            g->seqs[g->count] = s->seq;
            g->seconds[g->count] = (double)(int64_t)(r->t_ns - s->t_ns) / 1e9;
            own[0] = *s;
            own[g->width - 1] = *r;
            if (g->gpu) {
                const record_t *on_gpu = &records[gpu_of[i] - 1];
                int64_t from = (int64_t)s->t_ns, to = (int64_t)r->t_ns, at = (int64_t)on_gpu->t_ns;
                at = at < from ? from : at; /* within the clocks' alignment error, as the sidecar does */
                at = at > to ? to : at;
                g->gpu_seconds[2 * g->count] = at > from ? (double)(at - from) / 1e9 : 0.0;
                g->gpu_seconds[2 * g->count + 1] = to > at ? (double)(to - at) / 1e9 : 0.0;
                own[1] = *on_gpu;
            }
            g->count++;
            continue;
        }
        if (folded_away[i])
            continue;
        PyObject *item = record_tuple(record_type, r);
        if (item == NULL || PyList_Append(rest, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    folded = PyList_New(groups);
    if (folded == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < groups; k++) {
        PyObject *item = group_tuple(&group[k]);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(folded, k, item);
    }
    out = PyTuple_Pack(2, rest, folded);
done:
    Py_XDECREF(rest);
    Py_XDECREF(folded);
    table_free(&ends);
    table_free(&gpus);
    table_free(&others);
    table_free(&shapes);
    free(partner);
    free(gpu_of);
    free(group);
    free(seqs);
    free(seconds);
    free(gpu_seconds);
    free(kept);
    free(member);
    free(folded_away);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef module_methods[] = {
    {"claim", claim, METH_VARARGS, "claim(buffer, offset, n) -> the uint64 at offset before n was added"},
    {"publish", publish, METH_VARARGS, "publish(buffer, offset, length): a release store of a uint32"},
    {"published", published, METH_VARARGS, "published(buffer, offset) -> an acquire load of a uint32"},
    {"read_whole", read_whole, METH_VARARGS,
     "read_whole(buffer, slots, claim_offset, records_offset, cursor, limit) -> (bytes, head)"},
    {"fold_run", fold_run, METH_VARARGS,
     "fold_run(data, record_type, start, end, gpu_start) -> (records, groups of STARTs folded with their ok ENDs)"},
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
    .tp_name = "commlens.hooks._producer.Producer",
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
    PyObject *capsule = PyCapsule_New((void *)write_record, "commlens.hooks._producer.write_record", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "write_record", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
