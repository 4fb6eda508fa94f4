/* The Gated DeltaNet's depthwise causal conv1d + SiLU on its own (the delta passes run it inside, conv mode). */
#include "conv.h"

PT_CONTRACT_BEGIN
/* Depthwise causal conv1d + SiLU over tokens-major rows: `conv_silu_chunk` (so `conv_silu_span`'s values) over all
 * C channels, in blocks of CONV_ROWS rows split at packed sequences' starts, rows before seg_start[t] read as zeros.
 * x: [T, C] (bf16 if x_bf16) with row stride x_t; taps: [W, C] float32; out: [T, C] float32, contiguous.
 * Blocks are independent: split over threads. */
#define CONV_ROWS 64
PT_API int pt_causal_conv1d_silu(const pt_conv_args *args, float *out, int nthreads) {
    int64_t T = args->T, C = args->C;
    const int64_t *seg_start = args->seg_start;
    if (args->W < 1 || args->W > MAX_CONV_WIDTH || T < 0 || C < 0)
        return PT_DECLINE_SHAPE;
    if (!dtype_flag_ok(args->x_bf16))
        return PT_DECLINE_DTYPE;
    conv_source a = {args->x, args->x_bf16, args->W, args->x_t, C, args->taps, 0};
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < (T + CONV_ROWS - 1) / CONV_ROWS; b++) {
        int64_t t = b * CONV_ROWS, end = t + CONV_ROWS < T ? t + CONV_ROWS : T;
        while (t < end) {                                /* a run of rows of one packed sequence */
            int64_t r = t + 1;
            while (r < end && seg_start[r] == seg_start[t])
                r++;
            conv_silu_chunk(&a, t, r - t, seg_start[t], 0, C, out + t * C, C);
            t = r;
        }
    }
    return PT_OK;
}
PT_CONTRACT_END
