/* What the attention kernels share (attention.c, attention_bf16.c): the query block and the segments' check. */
#ifndef PT_ATTENTION_H
#define PT_ATTENTION_H

#include "vec.h"

#define QUERY_BLOCK 64

/* The longest of nseg segments, or -1 where a start or a length is negative (the attention kernels' check) */
static int64_t longest_segment(const int64_t *seg_start, const int64_t *seg_len, int64_t nseg) {
    int64_t longest = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg_len[s] < 0 || seg_start[s] < 0)
            return -1;
        longest = seg_len[s] > longest ? seg_len[s] : longest;
    }
    return longest;
}

#endif
