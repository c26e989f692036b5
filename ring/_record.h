/* The ring's contract for C: one record's layout, its codes, and the named builders of the fields a
 * writer hands to the producer (_producer.c's write_record). layout.py is the same contract for Python;
 * tests/test_layout.py checks that the two agree, field for field and code for code. */
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

_Static_assert(sizeof(record_t) == RECORD_SIZE, "record layout must match layout.RECORD");

enum { KIND_START = 1, KIND_END = 2, KIND_NAN = 3, KIND_GPU_START = 4, KIND_SNAPSHOT = 5, KIND_LOSS_SCALE = 6,
       KIND_FINGERPRINT = 7 };
enum { STATUS_OK = 0, STATUS_ERROR = 1, STATUS_TIMEOUT = 2, STATUS_NOT_ISSUED = 3 }; /* END's flags */
enum { NAN_OUTPUT = 1, NAN_HAS_NAN = 2, NAN_HAS_INF = 4 };                         /* NAN's flags */
enum { FLAG_ASYNC = 1, FLAG_LAST_BUCKET = 2 };                                    /* START's flags */
enum { BUCKET_BITS = 16 }; /* START's aux: a bucket's index + 1 below, its values' exponent above (layout.start_aux) */

/* What a writer hands to write_record: kind, op, flags, pg, op_id, seq, nbytes, sig, peer, aux, where
 * (Ring.write's arguments, the time aside; a peer of -1 as its two's complement). */
typedef unsigned long long record_fields[11];

/* START: the op is about to be issued (``bucket``: a DDP bucket's index + 1, in aux: layout.start_aux; ``where``:
 * module attribution's (module string id << 8) | phase). */
static inline void start_fields(record_fields v, unsigned long long op, unsigned long long pg, unsigned long long op_id,
                                unsigned long long seq, unsigned long long nbytes, unsigned long long sig, long long peer,
                                unsigned long long flags, unsigned long long bucket, unsigned long long where) {
    v[0] = KIND_START, v[1] = op, v[2] = flags, v[3] = pg, v[4] = op_id, v[5] = seq;
    v[6] = nbytes, v[7] = sig, v[8] = (unsigned long long)peer, v[9] = bucket, v[10] = where;
}

/* END: the op completed with ``status`` (``wire_bytes``: what a DDP bucket's hook sent, in aux). */
static inline void end_fields(record_fields v, unsigned long long op, unsigned long long pg, unsigned long long op_id,
                              unsigned long long seq, unsigned long long nbytes, unsigned long long sig, long long peer,
                              unsigned long long status, unsigned long long wire_bytes) {
    v[0] = KIND_END, v[1] = op, v[2] = status, v[3] = pg, v[4] = op_id, v[5] = seq;
    v[6] = nbytes, v[7] = sig, v[8] = (unsigned long long)peer, v[9] = wire_bytes, v[10] = 0;
}

/* NAN: tensor ``index`` of the op held ``count`` non-finite elements (``flags``: NAN_*; the count in nbytes). */
static inline void nan_fields(record_fields v, unsigned long long op, unsigned long long pg, unsigned long long op_id,
                              unsigned long long seq, unsigned long long sig, long long peer, unsigned long long index,
                              unsigned long long flags, unsigned long long count) {
    v[0] = KIND_NAN, v[1] = op, v[2] = flags, v[3] = pg, v[4] = op_id, v[5] = seq;
    v[6] = count, v[7] = sig, v[8] = (unsigned long long)peer, v[9] = index, v[10] = 0;
}

/* FINGERPRINT: the op's result, alike on every member of its group, as one number (in nbytes); one of
 * every ``every`` collectives of the group (in aux). */
static inline void fingerprint_fields(record_fields v, unsigned long long op, unsigned long long pg,
                                      unsigned long long op_id, unsigned long long seq, unsigned long long sig,
                                      unsigned long long fingerprint, unsigned long long every) {
    v[0] = KIND_FINGERPRINT, v[1] = op, v[2] = 0, v[3] = pg, v[4] = op_id, v[5] = seq;
    v[6] = fingerprint, v[7] = sig, v[8] = (unsigned long long)-1LL, v[9] = every, v[10] = 0;
}

#endif
