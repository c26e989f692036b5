/* The hot path's state: what commlens' C code reads at each collective, in one object that Python
 * code sets where a value changes (registry.py: the hooks registered; ddp.py: its hooks running;
 * attribution.py: where(); process_ring.py: the ring) and reads as attributes. C reads the struct
 * (_state.h) through the capsule ``struct``: no module dictionary, no name looked up per call.
 *
 *     from commlens.hooks._state import state
 *     state.hooked = True          # bool fields take bools; the object fields None or a value
 *     state.ring                   # None until this process's ring is made
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

#include "_state.h"

static PyMemberDef state_members[] = {
    {"hooked", T_BOOL, offsetof(commlens_state, hooked), 0, "a pre- or post-hook must see every collective"},
    {"checking_inputs", T_BOOL, offsetof(commlens_state, checking_inputs), 0, "an input check is registered"},
    {"ddp_active", T_INT, offsetof(commlens_state, ddp_active), 0, "DDP communication hooks running now"},
    {"fingerprint_every", T_INT, offsetof(commlens_state, fingerprint_every), 0,
     "a group's every Nth collective's result is fingerprinted (0: none)"},
    {"reporting", T_OBJECT, offsetof(commlens_state, reporting), 0, "the one input check's report, or None"},
    {"reporting_found", T_OBJECT, offsetof(commlens_state, reporting_found), 0, "its found, or None"},
    {"where", T_OBJECT, offsetof(commlens_state, where), 0, "module attribution's where(), or None"},
    {"ring", T_OBJECT, offsetof(commlens_state, ring), 0, "this process's ring, or None"},
    {NULL},
};

static void state_dealloc(commlens_state *self) {
    Py_XDECREF(self->reporting);
    Py_XDECREF(self->reporting_found);
    Py_XDECREF(self->where);
    Py_XDECREF(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commlens.hooks._state.State",
    .tp_basicsize = sizeof(commlens_state),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What the hot path's C code reads at each collective.",
    .tp_members = state_members,
    .tp_dealloc = (destructor)state_dealloc,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_state", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__state(void) {
    if (PyType_Ready(&StateType) < 0)
        return NULL;
    commlens_state *state = PyObject_New(commlens_state, &StateType);
    if (state == NULL)
        return NULL;
    state->hooked = state->checking_inputs = 0;
    state->ddp_active = state->fingerprint_every = 0;
    PyObject **objects[] = {&state->reporting, &state->reporting_found, &state->where, &state->ring};
    for (size_t i = 0; i < sizeof(objects) / sizeof(objects[0]); i++)
        *objects[i] = Py_NewRef(Py_None);
    PyObject *m = PyModule_Create(&module);
    PyObject *capsule = m == NULL ? NULL : PyCapsule_New((void *)state, COMMLENS_STATE_CAPSULE, NULL);
    int added = capsule != NULL && PyModule_AddObjectRef(m, "state", (PyObject *)state) == 0 &&
                PyModule_AddObjectRef(m, "struct", capsule) == 0;
    Py_XDECREF(capsule);
    Py_DECREF(state); /* the module holds it, and the capsule points into it as long as the module lives */
    if (!added) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
