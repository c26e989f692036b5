/* The GPU path's C API (_gpu.cpp), for the C all_reduce (_all_reduce.c): the capsule ``_gpu.api``.
 * Every call with the GIL held. The poll writes the records given here itself, without the GIL, through
 * the ring's producer (``producer``: a ring's Producer, kept alive until then). */
#ifndef COMMLENS_GPU_H
#define COMMLENS_GPU_H

#include <Python.h>
#include <stdint.h>

#define COMMLENS_GPU_API "commlens.hooks._gpu.api"

typedef struct {
    /* A pair of timing events with ``start`` recorded on the device's current stream; -1: none free, -2
     * with an exception. */
    int64_t (*start)(int device);
    /* ``end`` recorded on the current stream; once the GPU has passed it, the poll writes GPU_START and END
     * at the GPU's times (``end``: END's 11 fields, as Ring.write takes them). 0, or -1 with an exception. */
    int (*end)(int64_t pair, PyObject *producer, const unsigned long long *end);
    /* The NaN/Inf check's sum of ``tensor`` on the current stream; where it is not finite, the poll writes
     * ``nan`` (NAN's 11 fields, the finding's NAN_HAS_* bit added to its flags) and calls ``found(bits)``
     * with the GIL (None: nobody). 1 issued, 0 no free slot, -1 with an exception. */
    int (*check)(PyObject *tensor, PyObject *producer, const unsigned long long *nan, PyObject *found);
    /* Give back a pair whose op failed. */
    void (*release)(int64_t pair);
} commlens_gpu_api;

#endif
