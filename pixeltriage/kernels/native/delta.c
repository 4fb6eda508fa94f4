/* The chunked gated delta rule in float32: pt_delta_chunked, one pass per head (conv + SiLU, L2 norms, each
 * chunk's decays, UT inverse, products and the recurrence), and pt_chunk_gather, the torch path's chunk layout. */
#define _DEFAULT_SOURCE              /* clock_gettime(), for the profiler's split */
#include "delta.h"
#include "matmul.h"

/* Gather token-major rows into the delta rule's chunk-major layout, scaling each (token, head) vector (the torch
 * path's layout where `pt_delta_chunked` declines the shapes):
 *   dst[row[t] / C][h][row[t] % C][:] = src[t][h][:] * s(t, h) * mult[t][h]
 *   dst2 (if not NULL): the same vector times s(t, h) * mult2[t][h] (k and k * beta from one read)
 * with s = 1 / sqrt(sum(src[t][h][:]^2) + eps) when l2norm, else 1; mult/mult2 NULL means 1. src: float32 with
 * strides (src_t, src_h, 1); mult, mult2: [T, H] float32 contiguous; dst, dst2: [N, H, C, D] float32. Rows of dst
 * that no token maps to are left as they are (the caller zeroes chunk padding). */
PT_API int pt_chunk_gather(const pt_gather_args *a, float *dst, float *dst2, int nthreads) {
    const float *src = a->src, *mult = a->mult, *mult2 = a->mult2;
    int64_t src_t = a->src_t, src_h = a->src_h, T = a->T, H = a->H, D = a->D, C = a->C;
    const int64_t *row = a->row;
    int l2norm = a->l2norm;
    float eps = a->eps;
    if (T < 0 || H < 0 || D < 0 || C < 1)
        return PT_DECLINE_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t n = row[t] / C, i = row[t] % C;
        for (int64_t h = 0; h < H; h++) {
            const float *restrict x = src + t * src_t + h * src_h;
            float s = 1.0f;
            if (l2norm) {
                float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
                for (int64_t d = 0; d < D; d++)
                    sq += x[d] * x[d];
                s = 1.0f / __builtin_sqrtf(sq + eps);
            }
            int64_t at = ((n * H + h) * C + i) * D;
            float a = mult ? s * mult[t * H + h] : s;
            float *restrict o = dst + at;
            for (int64_t d = 0; d < D; d++)
                o[d] = x[d] * a;
            if (dst2) {
                float b = mult2 ? s * mult2[t * H + h] : s;
                float *restrict o2 = dst2 + at;
                for (int64_t d = 0; d < D; d++)
                    o2[d] = x[d] * b;
            }
        }
    }
    return PT_OK;
}

PT_CONTRACT_BEGIN
/* One chunk's prep for head h: its rows gathered straight into the outputs (q into qm, kb into kbm, vb into vbm,
 * k^T into kt) and transformed in place: u (over vbm) and w (over kbm) bottom-up, so that row block i reads only
 * rows <= i of the input it overwrites. Triangular products run over their nonzero blocks only. dec: 2 C^2 floats.
 * Returns the chunk's total decay. */
static float delta_prep_chunk(const delta_args *a, int64_t t0, int64_t len, int64_t seg0, int64_t h, const float *g,
                              float *qm, float *kbm, float *vbm, float *im, float *kt, float *dec, float *kn) {
    int64_t C = a->C, K = a->K, V = a->V;
    float scale = a->scale, cutoff = a->cutoff, tiny = a->tiny;
    float *t = dec + C * C;
    delta_gather_rows(a, t0, len, seg0, h, qm, kbm, vbm, kn, K, V);
    for (int64_t i0 = 0; i0 < C; i0 += VL)                  /* k^T (normalised, undecayed) */
        for (int64_t d = 0; d < K; d++)
            for (int64_t i = i0; i < i0 + VL; i++)
                kt[d * C + i] = kn[i * K + d];
    float gexp[MAX_DELTA_CHUNK], kend[MAX_DELTA_CHUNK];
    chunk_decays(g, C, cutoff, gexp, kend, dec);
    /* t <- kb k^T and intra <- q k^T on their lower blocks (the rest of each 16-column vector is masked below) */
    for (int64_t i0 = 0; i0 < C; i0 += 4) {
        int64_t ncols = round16(i0 + 4);
        mm4_cols(kbm + i0 * K, K, kt, C, K, t + i0 * C, C, ncols, 1.0f, 0.0f, 0);
        mm4_cols(qm + i0 * K, K, kt, C, K, im + i0 * C, C, ncols, 1.0f, 0.0f, 0);
    }
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < C; j++)
            im[i * C + j] = j <= i ? im[i * C + j] * (dec[i * C + j] * scale) : 0.0f;
    /* L = strictly_lower(t * dec) into dec's lower triangle (dec is not read after this), then the inverse */
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < i; j++)
            dec[i * C + j] *= t[i * C + j];
    ut_inverse(t, dec, C, tiny);
    /* u = T vb over vb and, with T's columns scaled by exp(gamma_j), w = T diag(exp(gamma)) kb over kb;
     * bottom-up */
    for (int64_t i0 = C - 4; i0 >= 0; i0 -= 4)
        mm4_cols(t + i0 * C, C, vbm, V, i0 + 4, vbm + i0 * V, V, V, 1.0f, 0.0f, 0);
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j <= i; j++)
            t[i * C + j] *= gexp[j];
    for (int64_t i0 = C - 4; i0 >= 0; i0 -= 4)
        mm4_cols(t + i0 * C, C, kbm, K, i0 + 4, kbm + i0 * K, K, K, 1.0f, 0.0f, 0);
    for (int64_t i = 0; i < C; i++) {
        float a = gexp[i] * scale;
        for (int64_t d = 0; d < K; d++)
            qm[i * K + d] *= a;
    }
    for (int64_t d = 0; d < K; d++)
        for (int64_t i = 0; i < C; i++)
            kt[d * C + i] *= kend[i];
    return gexp[C - 1];
}

/* One chunk's step of the recurrence for one head (see pt_delta_chunked); vn holds u and becomes v_new; o: the
 * chunk's first output row for this head, rows ldo apart. */
static void delta_loop_chunk(float *vn, const float *wm, const float *qm, const float *im, const float *ktm, float cd,
                             float *S, float *o, int64_t ldo, int64_t C, int64_t K, int64_t V) {
    for (int64_t i0 = 0; i0 < C; i0 += 4)
        mm4_cols(wm + i0 * K, K, S, V, K, vn + i0 * V, V, V, -1.0f, 1.0f, 1);
    for (int64_t i0 = 0; i0 < C; i0 += 4) {
        mm4_cols(qm + i0 * K, K, S, V, K, o + i0 * ldo, ldo, V, 1.0f, 0.0f, 0);
        mm4_cols(im + i0 * C, C, vn, V, i0 + 4, o + i0 * ldo, ldo, V, 1.0f, 1.0f, 1);
    }
    for (int64_t r0 = 0; r0 < K; r0 += 4)
        mm4_cols(ktm + r0 * C, C, vn, V, C, S + r0 * V, V, V, 1.0f, cd, 1);   /* 0 * inf stays NaN */
}

PT_API int pt_delta_chunked(const pt_delta_args *args, float *out, float *state, float *scratch, double *prof,
                            int nthreads) {
    int64_t N = args->N, H = args->H, C = args->C, K = args->K, V = args->V;
    const int64_t *chunk_start = args->chunk_start, *chunk_len = args->chunk_len, *seg_start = args->seg_start;
    const uint8_t *restart = args->restart;
    const float *gamma = args->gamma, *taps = args->taps;
    if (N < 0 || H < 0 || C < VL || C % VL || C > MAX_DELTA_CHUNK || K < VL || K % VL || V < VL || V % VL
        || !delta_conv_ok(taps, args->W, args->group, H, K, V, args->conv_dim)
        || !delta_chunks_ok(N, C, chunk_start, chunk_len, taps, seg_start))
        return PT_DECLINE_SHAPE;
    if (!dtype_flag_ok(args->x_bf16))
        return PT_DECLINE_DTYPE;
    delta_args a = delta_args_of(args, prof, 0);
#pragma omp parallel num_threads(nthreads)
    {
        double start = prof ? delta_seconds() : 0.0;
        /* a contiguous block of heads per thread, chunk by chunk across them, so that a chunk's input rows (one
         * page each: their stride is 12-24 KB) are read by all of the thread's heads while their translations are
         * cached, instead of each head walking every page of the sequence on its own (conv + chunk rule at
         * bench-small: ~60% of the conv's time was its first read of each row); a block rather than every nth
         * head, so that the thread's spans of each row adjoin (3 streams for the prefetcher where there were 24 at
         * bench-small: 8 heads' q, k and v; the pass 3-7% faster) */
        int tid = THREAD_NUM(), nth = NUM_THREADS();
        int64_t h0 = H * tid / nth, h1 = H * (tid + 1) / nth;
        float *dec = scratch + (int64_t)tid * DELTA_SCRATCH(C, K, V);
        float *qm = dec + 2 * C * C, *wm = qm + C * K, *um = wm + C * K, *im = um + C * V, *kt = im + C * C;
        float *kn = kt + K * C;
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = h0; h < h1; h++) {
                float *S = state + h * K * V;
                if (n == 0 || restart[n])
                    memset(S, 0, (size_t)(K * V) * sizeof(float));
                float cd = delta_prep_chunk(&a, chunk_start[n], chunk_len[n], taps ? seg_start[n] : 0, h,
                                            gamma + (n * H + h) * C, qm, wm, um, im, kt, dec, kn);
                delta_loop_chunk(um, wm, qm, im, kt, cd, S, out + (n * C * H + h) * V, H * V, C, K, V);
            }
        if (prof)
            prof[2 * tid + 1] += delta_seconds() - start;
    }
    return PT_OK;
}
PT_CONTRACT_END
