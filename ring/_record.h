/* The layout of one ring record, shared by the producer and reader (_producer.c) and the sidecar's
 * fold (_fold.c); layout.py's RECORD is the same layout for Python. */
#ifndef COMMLENS_RECORD_H
#define COMMLENS_RECORD_H

#include <stdint.h>

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

#endif
