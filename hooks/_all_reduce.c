/* all_reduce's common case recorded and issued in one C call, with no Python frame of commlens' own
 * (but the NaN check's report of an input holding NaN or Inf): synchronous, one tensor, a known group, no
 * pre- or post-hook but the NaN check's (which the scan of _nonfinite.c stands in for, and, in report
 * mode, its NAN record where the scan finds NaN or Inf: ``state.reporting``), outside a DDP bucket
 * and outside another wrapper's collective. It writes START and END through the ring's producer, as
 * recorder.run_unhooked does, sets the issuing flag around the call as issuing.issue does, and hands
 * every other call, unchanged, to ``general`` (distributed.py's wrapper). On two ranks the training
 * thread meets the wrapper's code with cold caches at every collective, so each frame left out there
 * saves several times its isolated cost. On a CUDA tensor (``gpu``: _gpu.h's API, and what tells a
 * graph capture and a dense tensor; None: general's) the check is the device's sum and END is written
 * by the GPU's poll at the GPU's times, as cuda.py does for the other ops; a capture is general's.
 *
 *     all_reduce = AllReduce(original, general, default_op, code, steps_aside, known, not_member, in_place,
 *                            describe_in_place, scanned, new_op_id, failed, internal_error, count_error,
 *                            gpu=(api_capsule, torch._C._cuda_isCurrentStreamCapturing, torch.strided))
 *     all_reduce(tensor, op=default_op, group=None, async_op=False)   # torch.distributed.all_reduce's
 *
 * What it reads at each call (the hooks registered, DDP's hooks running, module attribution, the ring)
 * is the hot path's state (_state.h); the records it writes are built by _record.h's builders.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>
#include <time.h>

#include "_fingerprint.h"
#include "_gpu.h"
#include "_record.h"
#include "_state.h"
#include "_tensor_memory.h"

static int (*issuing_now)(void);
static int (*issuing_set)(int);
static uint64_t (*write_record)(PyObject *, const unsigned long long *);
static void (*write_record_at)(PyObject *, const unsigned long long *, uint64_t);
static commlens_state *state;

static PyObject *s_producer, *s_is_cuda, *s_shape, *s_dtype, *s_sid, *s_next_collective_seq, *s_start, *s_get_device,
    *s_layout, *s_pool_exhausted, *s_gpu_check, *s_end, *s_fingerprint, *s_fingerprint_unread;
static PyObject *s_parameters[4]; /* tensor, op, group, async_op */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original, *general, *default_op, *known, *not_member, *in_place, *describe_in_place, *scanned,
        *new_op_id, *failed, *internal_error, *count_error;
    unsigned long long code;
    int steps_aside;
    PyObject *ring, *producer; /* the ring last written to, and its producer */
    const commlens_gpu_api *gpu; /* NULL: CUDA tensors are general's */
    PyObject *capturing, *strided;
} AllReduce;

/* What the common case found: new references to the group and the producer, START's fields, the
 * NaN check's NAN record (flags 0: none), and for a CUDA tensor its device (-1: a CPU tensor) and the
 * check's ``found`` (NULL: no check). */
typedef struct {
    PyObject *info, *producer, *found;
    unsigned long long sig, nbytes, where, nan_flags, nan_count;
    int device;
} Common;

/* After a failed test of the common case: 1 when ``general`` decides (an Exception: a caller's mistake
 * is general's to report), 0 when the error must propagate (KeyboardInterrupt). */
static int general_decides(void) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return 0;
    PyErr_Clear();
    return 1;
}

/* Whether one of the state's objects is set (NULL: deleted, as None). */
static int set(PyObject *value) { return value != NULL && value != Py_None; }

/* The NaN check's NAN record for an input its scan found non-finite, from the one input check's
 * ``report`` (state.reporting, a Python call: the check counts its finding): 1 with ``c``'s nan
 * fields set, 0 when the check must run itself (general's), -1 on error. */
static int reported(AllReduce *self, PyObject *tensor, Common *c) {
    PyObject *report = state->reporting;
    if (!set(report))
        return 0;
    Py_INCREF(report);
    PyObject *found = PyObject_CallOneArg(report, tensor);
    Py_DECREF(report);
    if (found == NULL)
        return -1;
    int known = found != Py_None && PyArg_ParseTuple(found, "KK", &c->nan_flags, &c->nan_count);
    Py_DECREF(found);
    return PyErr_Occurred() ? -1 : known;
}

/* signatures.in_place's entry for ``tensor`` (a new reference), made on first use; NULL on error. */
static PyObject *lookup_in_place(AllReduce *self, PyObject *tensor) {
    PyObject *shape = PyObject_GetAttr(tensor, s_shape), *dtype = shape ? PyObject_GetAttr(tensor, s_dtype) : NULL;
    PyObject *key = dtype ? PyTuple_Pack(2, shape, dtype) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->in_place, key);
    if (entry != NULL)
        Py_INCREF(entry);
    else if (!PyErr_Occurred())
        entry = PyObject_CallFunctionObjArgs(self->describe_in_place, tensor, key, NULL);
    Py_DECREF(key);
    return entry;
}

static int on_gpu(AllReduce *self, PyObject *tensor, Common *c);

/* The op's signature, payload and scan (signatures.in_place's entry), and the NaN check's scan of its
 * input: 1 when commlens may record it without the check's hook, 0 when not, -1 on error. */
static int described(AllReduce *self, PyObject *tensor, Common *c) {
    c->nan_flags = 0;
    c->device = -1;
    c->found = NULL;
    PyObject *cuda = PyObject_GetAttr(tensor, s_is_cuda);
    if (cuda == NULL)
        return -1;
    Py_DECREF(cuda);
    if (cuda != Py_False)
        return self->gpu == NULL ? 0 : on_gpu(self, tensor, c);
    PyObject *entry = lookup_in_place(self, tensor);
    if (entry == NULL)
        return -1;
    PyObject *scan = NULL;
    int found = PyArg_ParseTuple(entry, "KKO", &c->sig, &c->nbytes, &scan) ? 1 : -1;
    int checking = found < 0 ? -1 : state->checking_inputs;
    if (checking > 0) {
        PyObject *finite = scan == Py_None ? NULL : PyObject_CallFunctionObjArgs(self->scanned, tensor, scan, NULL);
        found = scan == Py_None ? 0 : finite == NULL ? -1 : finite == Py_True;
        if (finite == Py_False) { /* the check's report decides, once the rest of the common case holds */
            c->nan_flags = 1;
            found = 1;
        }
        Py_XDECREF(finite);
    }
    Py_DECREF(entry);
    return checking < 0 ? -1 : found;
}

/* described() for a CUDA tensor: its device, and the NaN check's sum where a check is registered. */
static int on_gpu(AllReduce *self, PyObject *tensor, Common *c) {
    PyObject *layout = PyObject_GetAttr(tensor, s_layout);
    Py_XDECREF(layout);
    if (layout != self->strided) /* a sparse tensor: general's */
        return layout == NULL ? -1 : 0;
    PyObject *capturing = PyObject_CallNoArgs(self->capturing);
    Py_XDECREF(capturing);
    if (capturing != Py_False) /* a CUDA graph: general's, which counts it */
        return capturing == NULL ? -1 : 0;
    PyObject *entry = lookup_in_place(self, tensor);
    PyObject *scan = NULL;
    int found = entry == NULL ? -1 : PyArg_ParseTuple(entry, "KKO", &c->sig, &c->nbytes, &scan) ? 1 : -1;
    int checking = found < 0 ? -1 : state->checking_inputs;
    if (checking > 0 && !(PyTuple_Check(scan) && PyTuple_GET_SIZE(scan) == 2 &&
                          PyLong_AsLong(PyTuple_GET_ITEM(scan, 0)) == 0)) { /* it holds floats to check */
        PyObject *check = state->reporting_found;
        if (!set(check)) /* not the NaN check in report mode alone: general's */
            found = 0;
        else {  /* held until issued: the calls below may run Python, and another thread unregister the check */
            Py_INCREF(check);
            c->found = check;
        }
    }
    Py_XDECREF(entry);
    PyObject *device = found > 0 && checking >= 0 ? PyObject_CallMethodNoArgs(tensor, s_get_device) : NULL;
    if (device != NULL) {
        c->device = (int)PyLong_AsLong(device);
        Py_DECREF(device);
    }
    return checking < 0 || PyErr_Occurred() ? -1 : found > 0 && c->device >= 0;
}

/* Whether this call is the common case (1: ``c`` filled), general's (0), or an error to raise (-1). */
static int common_case(AllReduce *self, PyObject *const a[4], Common *c) {
    c->found = NULL;
    c->device = -1;
    PyObject *info = PyDict_GetItemWithError(self->known, a[2]);
    if (info == NULL || info == self->not_member)
        return PyErr_Occurred() ? (general_decides() ? 0 : -1) : 0;
    Py_INCREF(info); /* the calls below may run Python, and another thread clear ``known`` */
    int other = PyObject_IsTrue(a[3]);
    if (other == 0)
        other = state->hooked || state->ddp_active;
    if (other == 0 && self->steps_aside)
        other = issuing_now();
    int common = other != 0 ? (other > 0 ? 0 : -1) : described(self, a[0], c);
    PyObject *where = common > 0 ? state->where : NULL;
    c->where = 0;
    if (set(where)) {
        Py_INCREF(where);
        PyObject *at = PyObject_CallNoArgs(where);
        Py_DECREF(where);
        c->where = at == NULL ? 0 : PyLong_AsUnsignedLongLong(at);
        Py_XDECREF(at);
        common = PyErr_Occurred() ? -1 : 1;
    }
    PyObject *ring = common > 0 ? state->ring : NULL;
    if (common > 0 && !set(ring))  /* no ring yet: general creates it */
        common = 0;
    if (common > 0 && ring != self->ring) {
        Py_INCREF(ring);
        PyObject *producer = PyObject_GetAttr(ring, s_producer);
        if (producer == NULL) {
            Py_DECREF(ring);
            common = -1;
        } else {
            Py_XSETREF(self->ring, ring);
            Py_XSETREF(self->producer, producer);
        }
    }
    if (common > 0 && c->nan_flags)
        common = reported(self, a[0], c);
    if (common <= 0) {
        Py_DECREF(info);
        Py_CLEAR(c->found);
        return common < 0 ? (general_decides() ? 0 : -1) : 0;
    }
    Py_INCREF(self->producer);
    c->info = info;
    c->producer = self->producer;
    return 1;
}

/* The exception set, counted as commlens' own (process_ring.internal_error) under ``label``: 0, or -1
 * where the error must propagate (not an Exception) or counting it failed. */
static int counted(AllReduce *self, PyObject *label) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyObject *type, *error, *traceback;
    PyErr_Fetch(&type, &error, &traceback);
    PyErr_NormalizeException(&type, &error, &traceback);
    PyObject *result = PyObject_CallFunctionObjArgs(self->internal_error, label, error, NULL);
    Py_XDECREF(type);
    Py_XDECREF(error);
    Py_XDECREF(traceback);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* process_ring.count_error(kind): "gpu_pool_exhausted" (the op goes untimed on the GPU, or unchecked), or
 * "fingerprint_unread" (a result due a fingerprint not readable here). */
static int count_lost(AllReduce *self, PyObject *kind) {
    PyObject *result = PyObject_CallOneArg(self->count_error, kind);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

/* On a CUDA tensor, the NaN check's sum (before START, as the check's hook issues it), then ``start``
 * after START: the pair, -1 where there is none (timed on the CPU); -2 on an error to raise before START
 * was written, -3 after it (the caller ends the op as failed). Errors of commlens' own are counted. */
static int64_t gpu_started(AllReduce *self, PyObject *tensor, Common *c, const unsigned long long *start) {
    if (c->found != NULL) {
        record_fields n; /* its NAN_HAS_* bit and count the GPU's poll adds */
        nan_fields(n, self->code, start[3], start[4], start[5], c->sig, -1, 0, 0, 0);
        int issued = self->gpu->check(tensor, c->producer, n, c->found);
        if ((issued < 0 || (issued == 0 && count_lost(self, s_pool_exhausted) < 0)) && counted(self, s_gpu_check) < 0)
            return -2;
    }
    write_record(c->producer, start);
    int64_t pair = self->gpu->start(c->device);
    if ((pair == -2 || (pair == -1 && count_lost(self, s_pool_exhausted) < 0)) && counted(self, s_start) < 0)
        return -3;
    return pair < 0 ? -1 : pair;
}

/* FINGERPRINT of the result, a CPU tensor reduced in place, for a collective whose fingerprint is due (the
 * group's every ``every``th: state.fingerprint_every, as fingerprints.due), before its END (the sidecar
 * keeps its span by it). 0, or -1 where an error must propagate (an error of commlens' own is counted).
 * Over a MiB the hash lets other threads run (the caller holds the tensor). */
static int fingerprinted(AllReduce *self, PyObject *tensor, Common *c, unsigned long long sid,
                         unsigned long long op_id, unsigned long long seq, int every) {
    long long address = c->nbytes == 0 ? 1 : readable_address(tensor);  /* empty: 0, as _fingerprint.c's */
    if (address <= 0)
        return address == 0 ? count_lost(self, s_fingerprint_unread) : counted(self, s_fingerprint);
    const unsigned char *bytes = (const unsigned char *)(uintptr_t)address;
    uint64_t value;
    if (c->nbytes > FINGERPRINT_HOLDING_THE_GIL) {
        Py_BEGIN_ALLOW_THREADS
        value = fingerprint_of(bytes, (int64_t)c->nbytes);
        Py_END_ALLOW_THREADS
    } else {
        value = fingerprint_of(bytes, (int64_t)c->nbytes);
    }
    record_fields f;
    fingerprint_fields(f, self->code, sid, op_id, seq, c->sig, value, (unsigned long long)every);
    write_record(c->producer, f);
    return 0;
}

static int unsigned_of(PyObject *number, unsigned long long *out) {
    *out = number == NULL ? 0 : PyLong_AsUnsignedLongLong(number);
    Py_XDECREF(number);
    return !PyErr_Occurred();
}

/* START, the call, END (or recorder.failed_unhooked with the call's error, which then propagates). */
static PyObject *issue(AllReduce *self, PyObject *const a[4], Common *c) {
    unsigned long long op_id, seq, sid;
    if (!unsigned_of(PyObject_CallNoArgs(self->new_op_id), &op_id) ||
        !unsigned_of(PyObject_CallMethodNoArgs(c->info, s_next_collective_seq), &seq) ||
        !unsigned_of(PyObject_GetAttr(c->info, s_sid), &sid)) {
        if (counted(self, s_start) < 0)  /* a failing ring: the collective goes on unrecorded, counted */
            return NULL;
        return PyObject_Vectorcall(self->original, a, 4, NULL);
    }
    record_fields v;
    if (c->nan_flags) { /* before START, as the check's hook writes it: tensor 0 held nan_count of them */
        nan_fields(v, self->code, sid, op_id, seq, c->sig, -1, 0, c->nan_flags, c->nan_count);
        write_record(c->producer, v);
    }
    start_fields(v, self->code, sid, op_id, seq, c->nbytes, c->sig, -1, 0, 0, c->where);
    int64_t pair = -1;
    if (c->device < 0)
        write_record(c->producer, v);
    else if ((pair = gpu_started(self, a[0], c, v)) == -2)
        return NULL;
    PyObject *result = pair == -3 ? NULL : PyObject_Vectorcall(self->original, a, 4, NULL);
    if (result == NULL) {
        if (pair >= 0)
            self->gpu->release(pair);
        PyObject *type, *error, *traceback, *tensors = PyTuple_Pack(1, a[0]);
        PyErr_Fetch(&type, &error, &traceback);
        PyErr_NormalizeException(&type, &error, &traceback);
        if (traceback != NULL)
            PyException_SetTraceback(error, traceback);
        PyObject *ended = tensors == NULL ? NULL : PyObject_CallFunction(
            self->failed, "KOKKKKiOOO", self->code, c->info, op_id, seq, c->nbytes, c->sig, -1, tensors, tensors, error);
        if (ended == NULL)  /* failed_unhooked counts its own errors: this is one it could not */
            PyErr_WriteUnraisable(self->failed);
        Py_XDECREF(ended);
        Py_XDECREF(tensors);
        PyErr_Restore(type, error, traceback);
        return NULL;
    }
    end_fields(v, self->code, sid, op_id, seq, c->nbytes, c->sig, -1, STATUS_OK, 0);
    if (pair >= 0 && self->gpu->end(pair, c->producer, v) == 0)
        return result;  /* the GPU's poll writes GPU_START and END */
    int every = state->fingerprint_every;
    if (pair < 0 && every > 0 && seq % (unsigned long long)every == 0) { /* FINGERPRINT, then END at its own time */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        int raised = fingerprinted(self, a[0], c, sid, op_id, seq, every) < 0;
        write_record_at(c->producer, v, (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec);
        if (raised)
            Py_CLEAR(result);
        return result;
    }
    write_record(c->producer, v);
    if (pair >= 0) {
        self->gpu->release(pair);
        if (counted(self, s_end) < 0) {
            Py_DECREF(result);
            return NULL;
        }
    }
    return result;
}

static PyObject *all_reduce_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    AllReduce *self = (AllReduce *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *a[4] = {NULL, self->default_op, Py_None, Py_False};
    int ours = nargs <= 4;
    for (Py_ssize_t i = 0; ours && i < nargs; i++)
        a[i] = args[i];
    for (Py_ssize_t k = 0; ours && k < keywords; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < 4 && name != s_parameters[j] && PyUnicode_Compare(name, s_parameters[j]) != 0)
            j++;
        ours = j < 4 && j >= nargs;
        if (ours)
            a[j] = args[nargs + k];
    }
    Common c;
    int common = ours && a[0] != NULL ? common_case(self, a, &c) : 0;
    if (common < 0)
        return NULL;
    if (common == 0)
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    if (self->steps_aside)  /* PyTorch's own process-group hooks step aside meanwhile (native.py) */
        issuing_set(1);
    PyObject *result = issue(self, a, &c);
    if (self->steps_aside)
        issuing_set(0);
    Py_DECREF(c.info);
    Py_DECREF(c.producer);
    Py_XDECREF(c.found);
    return result;
}

static int all_reduce_init(AllReduce *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"original", "general", "default_op", "code", "steps_aside", "known", "not_member",
                            "in_place", "describe_in_place", "scanned", "new_op_id", "failed", "internal_error",
                            "count_error", "gpu", NULL};
    PyObject *o[12], *gpu = Py_None;
    if (self->original != NULL) {
        PyErr_SetString(PyExc_TypeError, "an AllReduce is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOKpO!OO!OOOOOO|O", names, &o[0], &o[1], &o[2], &self->code,
                                     &self->steps_aside, &PyDict_Type, &o[3], &o[4], &PyDict_Type, &o[5], &o[6],
                                     &o[7], &o[8], &o[9], &o[10], &o[11], &gpu))
        return -1;
    if (gpu != Py_None) {
        PyObject *api;
        if (!PyArg_ParseTuple(gpu, "OOO;gpu must be (api capsule, capturing, strided) or None", &api, &self->capturing,
                              &self->strided) ||
            (self->gpu = (const commlens_gpu_api *)PyCapsule_GetPointer(api, COMMLENS_GPU_API)) == NULL) {
            self->capturing = self->strided = NULL;
            return -1;
        }
        Py_INCREF(self->capturing);
        Py_INCREF(self->strided);
    }
    PyObject **fields[] = {&self->original, &self->general, &self->default_op, &self->known, &self->not_member,
                           &self->in_place, &self->describe_in_place, &self->scanned, &self->new_op_id,
                           &self->failed, &self->internal_error, &self->count_error};
    for (int i = 0; i < 12; i++) {
        Py_INCREF(o[i]);
        *fields[i] = o[i];
    }
    self->vectorcall = all_reduce_call;
    return 0;
}

static void all_reduce_dealloc(AllReduce *self) {
    PyObject *held[] = {self->original, self->general, self->default_op, self->known, self->not_member,
                        self->in_place, self->describe_in_place, self->scanned, self->new_op_id, self->failed,
                        self->internal_error, self->count_error, self->ring, self->producer, self->capturing, self->strided};
    for (size_t i = 0; i < sizeof(held) / sizeof(held[0]); i++)
        Py_XDECREF(held[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Called before initialisation (no vectorcall yet): an error, not a crash. */
static PyObject *all_reduce_call_uninitialised(PyObject *self, PyObject *args, PyObject *kwds) {
    if (((AllReduce *)self)->original == NULL) {
        PyErr_SetString(PyExc_TypeError, "an AllReduce must be initialised before it is called");
        return NULL;
    }
    return PyVectorcall_Call(self, args, kwds);
}

/* Any attribute it lacks is the original's (``__name__``, ``__doc__``, ...), as functools.wraps would
 * copy them: c10d's exception logger reads ``__name__`` when the call raises. */
static PyObject *all_reduce_getattro(PyObject *self, PyObject *name) {
    PyObject *found = PyObject_GenericGetAttr(self, name);
    PyObject *original = ((AllReduce *)self)->original;
    if (found != NULL || original == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return found;
    PyErr_Clear();
    return PyObject_GetAttr(original, name);
}

static PyMemberDef all_reduce_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(AllReduce, original), READONLY, "torch.distributed's all_reduce"},
    {NULL},
};

static PyTypeObject AllReduceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commlens.hooks._all_reduce.AllReduce",
    .tp_basicsize = sizeof(AllReduce),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "torch.distributed.all_reduce recorded, its common case in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)all_reduce_init,
    .tp_dealloc = (destructor)all_reduce_dealloc,
    .tp_call = all_reduce_call_uninitialised,
    .tp_vectorcall_offset = offsetof(AllReduce, vectorcall),
    .tp_members = all_reduce_members,
    .tp_getattro = all_reduce_getattro,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_all_reduce", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__all_reduce(void) {
    issuing_now = (int (*)(void))PyCapsule_Import("commlens.hooks._issuing.now", 0);
    issuing_set = (int (*)(int))PyCapsule_Import("commlens.hooks._issuing.set", 0);
    write_record = (uint64_t(*)(PyObject *, const unsigned long long *))PyCapsule_Import(
        "commlens.ring._producer.write_record", 0);
    write_record_at = (void (*)(PyObject *, const unsigned long long *, uint64_t))PyCapsule_Import(
        "commlens.ring._producer.write_record_at", 0);
    state = (commlens_state *)PyCapsule_Import(COMMLENS_STATE_CAPSULE, 0);
    if (issuing_now == NULL || issuing_set == NULL || write_record == NULL || write_record_at == NULL || state == NULL)
        return NULL;
    const char *strings[] = {"producer", "is_cuda", "shape", "dtype", "sid", "next_collective_seq", "START", "tensor",
                             "op", "group", "async_op", "get_device", "layout", "gpu_pool_exhausted", "GPU check",
                             "END", "FINGERPRINT", "fingerprint_unread"};
    PyObject **interned[] = {&s_producer, &s_is_cuda, &s_shape, &s_dtype, &s_sid, &s_next_collective_seq, &s_start,
                             &s_parameters[0], &s_parameters[1], &s_parameters[2], &s_parameters[3], &s_get_device,
                             &s_layout, &s_pool_exhausted, &s_gpu_check, &s_end, &s_fingerprint,
                             &s_fingerprint_unread};
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++)
        if ((*interned[i] = PyUnicode_InternFromString(strings[i])) == NULL)
            return NULL;
    if (PyType_Ready(&AllReduceType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AllReduceType);
    if (PyModule_AddObject(m, "AllReduce", (PyObject *)&AllReduceType) < 0) {
        Py_DECREF(&AllReduceType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
