/* The sidecar's fold of ring records (agent/sidecar.py reads it through reader.RingReader.read_folded):
 * in C so that the collectives that start and end within one drain, nearly all of them, cost the
 * reader no Python object each. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_record.h"

/* fold_run(data, record_type) -> (records, groups): the records of ``data`` (whole records as read_whole
 * copied them), where each START whose END with status ok follows in ``data``, with no other record of
 * its op_id there but at most one GPU_START between them and one NAN record of its input before it (its
 * flags without NAN_OUTPUT; none where ``data`` holds a LOSS_SCALE record, which must be read in order
 * with them), is folded away into one group per (op, pg, nbytes, sig, peer, timed on a GPU or not, the
 * NAN record's flags), in order of first appearance: (op, pg, nbytes, sig, seqs, seconds, records, gpu,
 * nan) where seqs are uint64, seconds float64 (end - start), records the collectives' own (START, END,
 * or START, GPU_START, END: 72 bytes each) and gpu, for a GPU's group, float64 pairs (queue, execution):
 * the GPU start, within [start, end], less start, and end less it; nan: the flags of their NAN records
 * (0: none). ``records``: every other record, in order, as ``record_type`` tuples. Most collectives
 * start and end within one drain: their counting then costs the reader no Python object each
 * (agent/sidecar.py). The kinds and codes are _record.h's. */
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
    const record_t *first; /* its key: op, pg, nbytes, sig, whether a GPU timed it, and nan */
    int gpu, width;        /* width: records a collective (2, or 3 with its GPU_START) */
    int nan;               /* the flags of its collectives' NAN records (0: none) */
    Py_ssize_t count;
    uint64_t *seqs;
    double *seconds, *gpu_seconds;
    record_t *records;
} group_t;

static PyObject *group_tuple(const group_t *g) {
    return Py_BuildValue("(iIKIy#y#y#y#i)", (int)g->first->op, (unsigned)g->first->pg,
                         (unsigned long long)g->first->nbytes, (unsigned)g->first->sig, (const char *)g->seqs,
                         g->count * (Py_ssize_t)sizeof(uint64_t), (const char *)g->seconds,
                         g->count * (Py_ssize_t)sizeof(double), (const char *)g->records,
                         g->width * g->count * (Py_ssize_t)RECORD_SIZE, (const char *)g->gpu_seconds,
                         g->gpu ? 2 * g->count * (Py_ssize_t)sizeof(double) : 0, g->nan);
}

static PyObject *fold_run(PyObject *module, PyObject *args) {
    Py_buffer view;
    PyTypeObject *record_type;
    int nan_kind = KIND_NAN; /* -1: no NAN record is folded */
    if (!PyArg_ParseTuple(args, "y*O!", &view, &PyType_Type, &record_type))
        return NULL;
    if (!PyType_IsSubtype(record_type, &PyTuple_Type) || view.len % RECORD_SIZE) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fold_run takes whole records and a tuple type");
        return NULL;
    }
    Py_ssize_t n = view.len / RECORD_SIZE, m = n ? n : 1, groups = 0;
    const record_t *records = (const record_t *)view.buf;
    table_t ends = {0}, gpus = {0}, others = {0}, shapes = {0}, nans = {0};
    Py_ssize_t *partner = calloc(m, sizeof(Py_ssize_t)); /* END index -> index + 1 of its START */
    Py_ssize_t *gpu_of = calloc(m, sizeof(Py_ssize_t));  /* END index -> index + 1 of its GPU_START, or 0 */
    group_t *group = calloc(m, sizeof(group_t));
    uint64_t *seqs = malloc(m * sizeof(uint64_t));
    double *seconds = malloc(m * sizeof(double)), *gpu_seconds = malloc(2 * m * sizeof(double));
    record_t *kept = malloc(m * sizeof(record_t));
    Py_ssize_t *member = malloc(m * sizeof(Py_ssize_t)); /* END index -> its group */
    char *folded_away = calloc(m, 1);                     /* a START, GPU_START or NAN folded with its END */
    PyObject *out = NULL, *rest = NULL, *folded = NULL;
    if (!table_init(&ends, n) || !table_init(&gpus, n) || !table_init(&others, n) || !table_init(&shapes, n) ||
        !table_init(&nans, n) ||
        partner == NULL || gpu_of == NULL || group == NULL || seqs == NULL || seconds == NULL ||
        gpu_seconds == NULL || kept == NULL || member == NULL || folded_away == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; nan_kind >= 0 && i < n; i++)
        if (records[i].kind == KIND_LOSS_SCALE)
            nan_kind = -1;
    for (Py_ssize_t i = 0; i < n; i++) { /* each op_id's ok END, GPU_START and NAN, and the op_ids with others */
        const record_t *r = &records[i];
        if (r->kind == KIND_END && r->flags == STATUS_OK) {
            Py_ssize_t *found = table_slot(&ends, r->op_id);
            if (!*found)
                *found = i + 1;
        } else if (r->kind == nan_kind && !(r->flags & NAN_OUTPUT)) {
            Py_ssize_t *found = table_slot(&nans, r->op_id);
            if (*found) /* a second tensor's: not the common case, left to the reader */
                *table_slot(&others, r->op_id) = 1;
            *found = i + 1;
        } else if (r->kind == KIND_GPU_START) {
            Py_ssize_t *found = table_slot(&gpus, r->op_id);
            if (*found) /* a second one: not the common case, left to the reader */
                *table_slot(&others, r->op_id) = 1;
            *found = i + 1;
        } else if (r->kind != KIND_START && r->kind != KIND_END) {
            *table_slot(&others, r->op_id) = 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* pair each START with its END, and count each pair's group */
        const record_t *r = &records[i];
        if (r->kind != KIND_START)
            continue;
        Py_ssize_t j = *table_slot(&ends, r->op_id) - 1, g_at = *table_slot(&gpus, r->op_id) - 1;
        Py_ssize_t n_at = *table_slot(&nans, r->op_id) - 1;
        if (j <= i || partner[j] || *table_slot(&others, r->op_id) || (g_at >= 0 && (g_at < i || g_at > j)) ||
            n_at > i || r->aux >> BUCKET_BITS) /* a bucket's START with its values' exponent: the reader tracks it */
            continue;
        int gpu = g_at >= 0, nan = n_at >= 0 ? records[n_at].flags : 0;
        partner[j] = i + 1;
        gpu_of[j] = g_at + 1;
        folded_away[i] = 1;
        if (gpu)
            folded_away[g_at] = 1;
        if (n_at >= 0)
            folded_away[n_at] = 1;
        uint64_t key = ((uint64_t)r->op << 56) ^ ((uint64_t)r->pg << 32) ^ r->sig ^ (r->nbytes * 0xC2B2AE3D27D4EB4Full) ^
                       ((uint64_t)gpu << 63) ^ ((uint64_t)nan << 40) ^ ((uint64_t)(uint32_t)r->peer << 16);
        Py_ssize_t *g = table_slot(&shapes, key);
        while (*g) { /* a key shared by two shapes: probe on past the other */
            const group_t *other = &group[*g - 1];
            const record_t *f = other->first;
            if (f->op == r->op && f->pg == r->pg && f->nbytes == r->nbytes && f->sig == r->sig && f->peer == r->peer &&
                other->gpu == gpu && other->nan == nan)
                break;
            g = table_slot(&shapes, ++key);
        }
        if (!*g) {
            group[groups].first = r;
            group[groups].gpu = gpu;
            group[groups].nan = nan;
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
    table_free(&nans);
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
    {"fold_run", fold_run, METH_VARARGS,
     "fold_run(data, record_type) -> (records, groups of STARTs "
     "folded with their ok ENDs)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fold", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__fold(void) { return PyModule_Create(&module); }
