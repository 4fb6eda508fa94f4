/* What the two chunked delta rule passes share (delta.c, delta_bf16.c): their arguments, a chunk's rows gathered
 * (or made by the conv), its decays, the UT transform's inverse, their checks. */
#ifndef PT_DELTA_H
#define PT_DELTA_H

#include <time.h>

#include "conv.h"

PT_CONTRACT_BEGIN
/* exp(e) for a log decay e (<= 0 up to rounding), 0 below the cut-off (the torch path's `_decay`); NaN stays NaN. */
static inline float decay_exp(float e, float cutoff) { return e < cutoff ? 0.0f : exp_f32(e > 0.0f ? 0.0f : e); }

#define MAX_DELTA_CHUNK 256

/* The chunked gated delta rule over token-major inputs, in one pass per head that keeps its state and the current
 * chunk's matrices in cache. Inputs: q, k, v [T, H, K|V] float32 with strides (x_t, x_h, 1); beta [T, H] contiguous;
 * gamma [N, H, C] the log decays cumulated from each chunk's start. Chunk n holds tokens chunk_start[n] + i for
 * i < chunk_len[n] (<= C), zero rows after (a packed sequence's last chunk); the state restarts from zero at chunks
 * where restart[n] is set. With q and k L2-normalised if l2norm (x / sqrt(sum x^2 + eps)), kb = k * beta and
 * vb = v * beta, per chunk (the torch path's `_torch_prep`):
 *   decay[i, j] = exp(gamma_i - gamma_j) (j <= i), g[i] = exp(gamma_i), both cut as in `decay_exp`;
 *   T = (I + strictly_lower((kb k^T) * decay))^-1, entries under `tiny` zeroed (the UT transform);
 *   u = T vb, w = T diag(g) kb, intra = (q k^T) * decay * scale (causal), q_start = q * g[i] * scale,
 *   k_end_t = (k * exp(gamma_{C-1} - gamma_i))^T, chunk_decay = g[C - 1];
 * then, with S the [K, V] state entering the chunk (`_torch_loop`):
 *   v_new = u - w S;  out = q_start S + intra v_new;  S = chunk_decay S + k_end_t v_new.
 * out: [N * C, H, V] token-major (row n * C + i, head h). Heads are split over threads; state: [H, K, V] floats;
 * scratch holds DELTA_SCRATCH(C, K, V) floats per thread. C, K and V multiples of 16, C <= MAX_DELTA_CHUNK.
 * Conv mode (taps != NULL; q, k, v unused): each token's q, k and v come from the Gated DeltaNet's projection x
 * [T, conv_dim] = [q heads | k heads | v heads] through the causal conv1d + SiLU (`conv_silu_span`), with
 * seg_start[n] the first token of chunk n's packed sequence (earlier rows read as zeros) and value head h reading
 * key head h / group: the conv's float32 output is never materialised. prof: NULL, or [nthreads, 2] doubles to
 * which each thread adds the seconds it spent in the conv + SiLU and in the whole pass (a profiler's split of the
 * pass; two clock reads per chunk and head when given). */
#define DELTA_SCRATCH(C, K, V) (3 * (C) * (C) + 4 * (C) * (K) + (C) * (V))

typedef struct {
    const float *q, *k, *v, *beta;
    int64_t q_t, q_h, k_t, k_h, v_t, v_h, H, C, K, V;
    int l2norm;
    float eps, scale, cutoff, tiny;
    /* conv mode (conv.taps != NULL): q, k and v are made here from the projection by the causal conv1d + SiLU;
     * value head h reads key head h / group */
    conv_source conv;
    int64_t group;
    /* NULL, or per thread [conv + SiLU seconds, the thread's whole pass seconds] added to (`delta_seconds`) */
    double *prof;
} delta_args;

static inline double delta_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One chunk's rows for head h, gathered (or, in conv mode, made from the projection) into C-row blocks: q and k
 * L2-normalised if asked (qm, kn), kb = k * beta (kbm), vb = v * beta (vbm); rows from len on zeroed. Rows are ldk
 * (qm, kbm, kn) and ldv (vbm) floats apart, of which the first K (V) are written. */
static void delta_gather_rows(const delta_args *a, int64_t t0, int64_t len, int64_t seg0, int64_t h, float *qm,
                              float *kbm, float *vbm, float *kn, int64_t ldk, int64_t ldv) {
    const float *q = a->q, *k = a->k, *v = a->v, *beta = a->beta;
    int64_t q_t = a->q_t, q_h = a->q_h, k_t = a->k_t, k_h = a->k_h, v_t = a->v_t, v_h = a->v_h;
    int64_t H = a->H, C = a->C, K = a->K, V = a->V;
    int l2norm = a->l2norm;
    float eps = a->eps;
    int64_t hk = a->conv.taps ? h / a->group : h, nk = H / (a->conv.taps ? a->group : 1);
    if (a->conv.taps) {                    /* conv mode: the chunk's q, k and v into qm, kn and vbm, then in place */
        double start = a->prof ? delta_seconds() : 0.0;
        conv_silu_chunk(&a->conv, t0, len, seg0, hk * K, K, qm, ldk);
        conv_silu_chunk(&a->conv, t0, len, seg0, (nk + hk) * K, K, kn, ldk);
        conv_silu_chunk(&a->conv, t0, len, seg0, 2 * nk * K + h * V, V, vbm, ldv);
        if (a->prof)
            a->prof[2 * THREAD_NUM()] += delta_seconds() - start;
    }
    for (int64_t i = 0; i < C; i++) {
        float *qo = qm + i * ldk, *kbo = kbm + i * ldk, *vbo = vbm + i * ldv, *kno = kn + i * ldk;
        if (i >= len) {
            memset(qo, 0, (size_t)K * sizeof(float));
            memset(kbo, 0, (size_t)K * sizeof(float));
            memset(vbo, 0, (size_t)V * sizeof(float));
            memset(kno, 0, (size_t)K * sizeof(float));
            continue;
        }
        const float *qr, *kr, *vr;                    /* conv mode: qo, kno and vbo themselves (read, then written) */
        if (a->conv.taps) {
            qr = qo, kr = kno, vr = vbo;
        } else {
            qr = q + (t0 + i) * q_t + h * q_h, kr = k + (t0 + i) * k_t + h * k_h, vr = v + (t0 + i) * v_t + h * v_h;
        }
        float sq = 1.0f, sk = 1.0f, b = beta[(t0 + i) * H + h];
        if (l2norm) {
            float aq = 0.0f, ak = 0.0f;
#pragma omp simd reduction(+ : aq, ak)
            for (int64_t d = 0; d < K; d++) {
                aq += qr[d] * qr[d];
                ak += kr[d] * kr[d];
            }
            sq = 1.0f / __builtin_sqrtf(aq + eps);
            sk = 1.0f / __builtin_sqrtf(ak + eps);
        }
        float skb = sk * b;
        for (int64_t d = 0; d < K; d++) {
            qo[d] = qr[d] * sq;
            kbo[d] = kr[d] * skb;
            kno[d] = kr[d] * sk;
        }
        for (int64_t d = 0; d < V; d++)
            vbo[d] = vr[d] * b;
    }
}

/* The UT transform's inverse by forward substitution, row by row over t: T[i, :] = e_i - sum_{j < i} L[i, j] T[j, :]
 * with L the strictly lower triangle of l ([C, C]; the rest not read), where T[j, :] is zero right of column j, so a
 * 64-column slab starting at s takes j from s on; the slab's row is accumulated in registers. Entries under `tiny`
 * are zeroed (products of decays underflow). t: [C, C], written whole. */
static void ut_inverse(float *t, const float *l_all, int64_t C, float tiny) {
    for (int64_t i = 0; i < C; i++) {
        float *restrict row = t + i * C;
        const float *restrict l = l_all + i * C;
        for (int64_t s0 = 0; s0 < C; s0 += 4 * VL) {
            int nv = C - s0 >= 4 * VL ? 4 * VL / VRL : (int)((C - s0) / VRL);
            vr acc[4 * VL / VRL];
            for (int v = 0; v < 4 * VL / VRL; v++)
                acc[v] = (vr){0};
            for (int64_t j = s0; j < i; j++) {
                float lj = l[j];
                if (lj == 0.0f)
                    continue;
                const float *prev = t + j * C + s0;
                for (int v = 0; v < 4 * VL / VRL; v++)
                    if (v < nv)
                        acc[v] -= lj * *(const vr *)(prev + v * VRL);
            }
            for (int v = 0; v < nv; v++)
                *(vr *)(row + s0 + v * VRL) = acc[v];
        }
        for (int64_t j = 0; j < i; j++)
            row[j] = __builtin_fabsf(row[j]) <= tiny ? 0.0f : row[j];      /* hardshrink's: NaN stays NaN */
        row[i] = 1.0f;
        for (int64_t j = i + 1; j < C; j++)
            row[j] = 0.0f;
    }
}

/* A chunk's decays from its cumulative log decays g[C]: gexp[i] = exp(gamma_i), kend[i] = exp(gamma_{C-1} - gamma_i)
 * and dec[i, j] = exp(gamma_i - gamma_j) ([C, C]) on the lower triangle, in whole 16-float vectors (the entries right
 * of the diagonal in row i's last vector are written too: callers mask them). */
static void chunk_decays(const float *g, int64_t C, float cutoff, float *gexp, float *kend, float *dec) {
    for (int64_t i = 0; i < C; i++) {
        gexp[i] = decay_exp(g[i], cutoff);
        kend[i] = decay_exp(g[C - 1] - g[i], cutoff);
    }
    for (int64_t i = 0; i < C; i++) {
        float gi = g[i];
        int64_t n = round16(i + 1);
        for (int64_t j = 0; j < n; j++)
            dec[i * C + j] = decay_exp(gi - g[j], cutoff);
    }
}

/* The checks pt_delta_chunked and pt_delta_chunked_bf16 share. Conv mode (taps): a width of 1..MAX_CONV_WIDTH
 * and a projection of 2 (H / group) K + H V columns. */
static int delta_conv_ok(const float *taps, int W, int64_t group, int64_t H, int64_t K, int64_t V, int64_t conv_dim) {
    return !taps || (W >= 1 && W <= MAX_CONV_WIDTH && group >= 1 && H % group == 0
                     && conv_dim == 2 * (H / group) * K + H * V);
}

/* Every chunk's length in 0..C and, in conv mode, its segment starting at or before it. */
static int delta_chunks_ok(int64_t N, int64_t C, const int64_t *chunk_start, const int64_t *chunk_len,
                           const float *taps, const int64_t *seg_start) {
    for (int64_t n = 0; n < N; n++)
        if (chunk_len[n] < 0 || chunk_len[n] > C || (taps && seg_start[n] > chunk_start[n]))
            return 0;
    return 1;
}

/* pt_delta_args -> the passes' delta_args (prof: the profiler's array or NULL; silu_bf16: the bf16 pass's SiLU) */
static delta_args delta_args_of(const pt_delta_args *p, double *prof, int silu_bf16) {
    delta_args a = {p->q, p->k, p->v, p->beta, p->q_t, p->q_h, p->k_t, p->k_h, p->v_t, p->v_h, p->H, p->C, p->K,
                    p->V, p->l2norm, p->eps, p->scale, p->cutoff, p->tiny,
                    {p->x, p->x_bf16, p->W, p->x_t, p->conv_dim, p->taps, silu_bf16}, p->group, prof};
    return a;
}
PT_CONTRACT_END

#endif
