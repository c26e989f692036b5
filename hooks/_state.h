/* What the hot path's C code reads at each call (_state.c): one struct, set from Python where a value
 * changes, read here without a dictionary lookup. The C all_reduce (_all_reduce.c) gets it through the
 * capsule COMMLENS_STATE_CAPSULE. */
#ifndef COMMLENS_STATE_H
#define COMMLENS_STATE_H

#include <Python.h>

typedef struct {
    PyObject_HEAD
    char hooked;              /* a pre- or post-hook that must see every collective is registered */
    char checking_inputs;     /* an input check (the NaN check) is registered */
    int ddp_active;           /* DDP communication hooks running now, in any thread */
    int fingerprint_every;    /* a group's every Nth collective's result is fingerprinted (0: none) */
    PyObject *reporting;      /* the one input check's report (a CPU tensor's NAN record), or None */
    PyObject *reporting_found;/* the same check's found (a CUDA tensor's, written by the GPU's poll), or None */
    PyObject *where;          /* module attribution's where() -> (module string id << 8) | phase, or None */
    PyObject *ring;           /* this process's ring once made, or None */
} commlens_state;

#define COMMLENS_STATE_CAPSULE "commlens.hooks._state.struct"

#endif
