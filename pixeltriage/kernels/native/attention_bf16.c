/* Attention within segments in bf16 on AMX, AVX512-BF16 or float32 multiply-adds: the vision tower's images
 * (pt_segment_attention_bf16) and the decoder's packed questions, causal (pt_causal_attention_bf16). */
#include "attention.h"
#include "matmul_bf16.h"

PT_CONTRACT_BEGIN
/* rows t0 .. t0 + n of one head of a token-major bf16 tensor (row stride x_t, the head at offset off) into dst
 * [count, D] contiguous, rows from n on zeros */
static void segment_rows(const uint16_t *x, int64_t x_t, int64_t off, int64_t t0, int64_t n, int64_t count,
                         int64_t D, uint16_t *dst) {
    for (int64_t i = 0; i < count; i++) {
        if (i < n)
            memcpy(dst + i * D, x + (t0 + i) * x_t + off, (size_t)D * sizeof(uint16_t));
        else
            memset(dst + i * D, 0, (size_t)D * sizeof(uint16_t));
    }
}

/* K^T in the pair layout, kt[p, 2n + e] = K[n, 2p + e] for n < L, zero up to Lp (a multiple of 16): 16 keys by 16
 * pairs at a time, read from K's rows and transposed as 32-bit words (`transpose16_epi32`); without AVX-512, K's rows
 * copied contiguous (into rows, [Lp, D]) then transposed a word at a time */
static void segment_kt(const uint16_t *k, int64_t k_t, int64_t off, int64_t t0, int64_t L, int64_t Lp, int64_t D,
                       uint16_t *kt, uint16_t *rows) {
    uint32_t *dst = (uint32_t *)kt;
#ifdef PT_AVX512F
    static const uint16_t zeros[256] = {0};
    (void)rows;
    for (int64_t n0 = 0; n0 < Lp; n0 += 16)
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
            __m512i x[16];
            for (int64_t i = 0; i < 16; i++)
                x[i] = _mm512_loadu_si512((n0 + i < L ? k + (t0 + n0 + i) * k_t + off : zeros) + 2 * p0);
            transpose16_epi32(x);
            for (int64_t j = 0; j < 16; j++)
                _mm512_storeu_si512(dst + (p0 + j) * Lp + n0, x[j]);
        }
#else
    segment_rows(k, k_t, off, t0, L, Lp, D, rows);
    const uint32_t *pairs = (const uint32_t *)rows;
    for (int64_t n = 0; n < Lp; n++)
        for (int64_t p = 0; p < D / 2; p++)
            dst[p * Lp + n] = pairs[n * (D / 2) + p];
#endif
}

/* V in the pair layout, vv[p, 2n + e] = V[2p + e, n] for rows < L, zero rows up to Lp */
static void segment_vv(const uint16_t *v, int64_t v_t, int64_t off, int64_t t0, int64_t L, int64_t Lp, int64_t D,
                       uint16_t *vv) {
    static const uint16_t zeros[256] = {0};
#ifdef PT_AVX512BW
    uint16_t lo_idx[32], hi_idx[32];
    for (int i = 0; i < 32; i++) {
        lo_idx[i] = (uint16_t)((i % 2 ? 32 : 0) + i / 2);
        hi_idx[i] = (uint16_t)((i % 2 ? 32 : 0) + 16 + i / 2);
    }
    __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx);
#endif
    for (int64_t pr = 0; pr < Lp / 2; pr++) {
        const uint16_t *r0 = 2 * pr < L ? v + (t0 + 2 * pr) * v_t + off : zeros;
        const uint16_t *r1 = 2 * pr + 1 < L ? v + (t0 + 2 * pr + 1) * v_t + off : zeros;
        uint16_t *o = vv + pr * 2 * D;
#ifdef PT_AVX512BW
        for (int64_t n = 0; n < D; n += 32) {
            __m512i a = _mm512_loadu_si512(r0 + n), b = _mm512_loadu_si512(r1 + n);
            _mm512_storeu_si512(o + 2 * n, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(o + 2 * n + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
#else
        for (int64_t n = 0; n < D; n++) {
            o[2 * n] = r0[n];
            o[2 * n + 1] = r1[n];
        }
#endif
    }
}

/* One row of scores (row[0, L) live, Lp a multiple of 32): e = exp(scale (row - max)) in two bf16 parts with
 * zeros past L, pb = e's top 16 bits (e truncated to bf16) and pl = bf16(e - pb) (e - pb exact in float), so that
 * pb + pl is e within 2^-16 of it; returns the float32 sum of e. Truncating pb rather than rounding it takes 4 of
 * the 10 vector operations that made the two parts (ViT attention 0.974x, 61 pairs) for twice the residual (2^-17
 * with rounding), 2^-7 of the output's own rounding step. */
#if defined(PT_AVX512F) && defined(PT_AVX512BF16)
/* 32 values of e (e0 then e1) as their two bf16 parts: pb their top 16 bits, pl what that left, rounded */
static inline void e_parts32(__m512 e0, __m512 e1, uint16_t *pb, uint16_t *pl) {
    __m512i top16 = _mm512_set1_epi32((int)0xffff0000u);
    __m512 t0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e0), top16));
    __m512 t1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e1), top16));
    _mm512_storeu_si512(pb, bf16x32(t0, t1));
    _mm512_storeu_si512(pl, bf16x32(_mm512_sub_ps(e0, t0), _mm512_sub_ps(e1, t1)));
}
#endif

static float segment_softmax_row(float *row, int64_t L, int64_t Lp, float scale, uint16_t *pb, uint16_t *pl) {
    float m = row[0], sum = 0.0f;
#if defined(PT_AVX512F) && defined(PT_AVX512BF16)
    {                                              /* the row's max in four chains (one waits on its own latency) */
        __m512 a0 = _mm512_set1_ps(m), a1 = a0, a2 = a0, a3 = a0;
        int64_t j = 0;
        for (; j + 64 <= L; j += 64) {
            a0 = _mm512_max_ps(a0, _mm512_loadu_ps(row + j));
            a1 = _mm512_max_ps(a1, _mm512_loadu_ps(row + j + 16));
            a2 = _mm512_max_ps(a2, _mm512_loadu_ps(row + j + 32));
            a3 = _mm512_max_ps(a3, _mm512_loadu_ps(row + j + 48));
        }
        for (; j < L; j += 16)
            a0 = _mm512_max_ps(a0, _mm512_mask_loadu_ps(a0, lanes16(L - j), row + j));
        m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
    }
#else
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < L; j++)
        m = row[j] > m ? row[j] : m;
#endif
#if defined(PT_AVX512F) && defined(PT_AVX512BF16)
    /* e = 2^(c s - c m) with c = scale log2(e), the exponent in one multiply-add; a NaN score (or an infinite one,
     * through inf - inf) stays NaN through exp2_16_bf16 and makes the row's sum, so its output, NaN. Whole blocks of
     * 32 keys unmasked, then the masked tail up to Lp with zeros past L. */
    float c = scale * 1.44269504088896341f;
    __m512 vcm = _mm512_set1_ps(c * m), vc = _mm512_set1_ps(c), acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t j = 0;
    for (; j + 32 <= L; j += 32) {
        __m512 e0 = exp2_16_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vc, vcm));
        __m512 e1 = exp2_16_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j + 16), vc, vcm));
        acc0 = _mm512_add_ps(acc0, e0);
        acc1 = _mm512_add_ps(acc1, e1);
        e_parts32(e0, e1, pb + j, pl + j);
    }
    for (; j < Lp; j += 32) {
        __mmask16 m0 = j >= L ? 0 : lanes16(L - j), m1 = j + 16 >= L ? 0 : lanes16(L - j - 16);
        __m512 e0 = _mm512_maskz_mov_ps(m0, exp2_16_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), vc, vcm)));
        __m512 e1 = _mm512_maskz_mov_ps(m1, exp2_16_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(row + j + 16), vc, vcm)));
        acc0 = _mm512_add_ps(acc0, e0);
        acc1 = _mm512_add_ps(acc1, e1);
        e_parts32(e0, e1, pb + j, pl + j);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < L; j++) {
        row[j] = exp_f32(scale * (row[j] - m));
        sum += row[j];
    }
    for (int64_t j = L; j < Lp; j++)
        row[j] = 0.0f;
    for (int64_t j = 0; j < Lp; j++) {
        uint32_t bits;
        memcpy(&bits, row + j, sizeof bits);
        pb[j] = (uint16_t)(bits >> 16);
        row[j] -= bf16_to_float(pb[j]);
    }
    bf16_row(row, pl, Lp);
#endif
    return sum;
}

/* V's bytes per block of e V's products (see query_block_out): the causal kernel at 2296 tokens, 8 heads of 256 over
 * 2, 2 threads, AVX512-BF16: 0.945x the time of one product over all keys with 128 KB (256 keys), 0.947x with 64
 * KB, 0.992x with 256 KB */
#define EV_BYTES (128 * 1024)

/* The rest of a block of m query rows once its scores are in sf (rows ld floats apart): row i's softmax over its
 * first seen + (causal ? i : 0) keys (zeros up to ld), e V over `rows` rows (m or more, a multiple of 32: the rows
 * past m are products whose outputs are not kept), each kept row divided by its sum into out (bf16, rows ldo
 * apart). The two attention kernels' common tail, inlined into each (their products' shapes stay what each was
 * compiled for). */
static inline __attribute__((always_inline)) void query_block_out(
    int engine, float *sf, uint16_t *pb, uint16_t *pl, int64_t ld, const uint16_t *vv, int64_t m, int64_t rows,
    int64_t D, int64_t seen, int causal, float scale, float *inv, float *of, uint16_t *out, int64_t ldo) {
    for (int64_t i = 0; i < m; i++)
        inv[i] = 1.0f / segment_softmax_row(sf + i * ld, seen + (causal ? i : 0), ld, scale, pb + i * ld,
                                            pl + i * ld);
    /* e V = pb V + pl V (V is bf16 already): the second product adds back what e's top bits left out. V's
     * pair rows EV_BYTES at a time (256 keys of a head of 256), so that each block stays in L2 while every tile of
     * the output reads it (a decoder question's V, 2296 keys x 256, is 1.2 MB); every pb block before the first pl
     * block: the sums in the order of one product over all keys, stored and reloaded in float32 (the same bits) */
    int64_t kb = EV_BYTES / (2 * D) / 32 * 32;
    const uint16_t *parts[2] = {pb, pl};
    for (int p = 0; p < 2; p++)
        for (int64_t k0 = 0; k0 < ld; k0 += kb) {
            int64_t n = ld - k0 < kb ? ld - k0 : kb;
            mm_bf16(engine, parts[p] + k0, ld, vv + k0 * D, rows, D, n, of, D, p || k0, NULL, 0);
        }
    to_bf16_rows(of, D, m, D, inv, out, ldo);
}

/* ---- Attention within segments (the vision tower's images) in bf16 on the matrix units -------------------------
 * For each segment s (tokens seg_start[s] .. + seg_len[s]) and head h, non-causal softmax attention, QUERY_BLOCK
 * query rows at a time, each block's scores over the segment's keys materialised (64 rows of a 1024-patch image are
 * 256 KB of floats, in L2):
 *   S = Q K^T (bf16 products, float32 sums), e = exp(scale (S - rowmax)), O = (pb V + pl V) / rowsum(e)
 * with pb + pl = e in two bf16 parts (`segment_softmax_row`): e V as exact as float32 e would make it, so that the
 * output's own rounding to bf16 is its error (rounding e once before a single product, as torch's CPU flash kernel
 * does for transformers' 4-D SDPA calls, has 1.05-1.14x that error, a tenth of the outputs more than a bf16 step
 * off). The head's Q rows, K^T and V are packed once per (segment, head) task. q, k, v: bf16 with strides (t, h, 1)
 * in elements; out: [T, H, D] bf16 contiguous.
 * Rows and columns past L up to Lp = L rounded up to 32 are zeros (padded keys masked out of the softmax). Segments
 * and heads are split over threads; scratch holds SEGMENT_SCRATCH(Lp, D) floats per thread for the longest
 * segment. D a multiple of 32 up to 256, the engine as in pt_delta_chunked_bf16. */
#define MAX_SEGMENT 4096
#define SEGMENT_SCRATCH(L, D) \
    (QUERY_BLOCK * (L) + QUERY_BLOCK * (L) + QUERY_BLOCK * (D) + QUERY_BLOCK + 3 * (L) * (D) / 2 + 8 * 64)

/* SEGMENT_SCRATCH for the longest segment (padded here): what the caller allocates per thread */
PT_API int pt_segment_attention_scratch(int64_t longest, int64_t D, int64_t *floats) {
    *floats = SEGMENT_SCRATCH(round32(longest), D);
    return PT_OK;
}

PT_API int pt_segment_attention_bf16(const pt_attention_args *a, int engine, uint16_t *out, float *scratch,
                                     int64_t scratch_floats, int nthreads) {
    const uint16_t *q = a->q, *k = a->k, *v = a->v;
    int64_t q_t = a->q_t, q_h = a->q_h, k_t = a->k_t, k_h = a->k_h, v_t = a->v_t, v_h = a->v_h, H = a->H, D = a->D;
    const int64_t *seg_start = a->seg_start, *seg_len = a->seg_len;
    int64_t nseg = a->nseg;
    float scale = a->scale;
    int64_t longest = longest_segment(seg_start, seg_len, nseg), Lmax = round32(longest);
    if (longest < 0 || H < 0 || a->Hkv != H || D < 32 || D % 32 || D > 256 || longest > MAX_SEGMENT)
        return PT_DECLINE_SHAPE;
    if (a->causal)
        return PT_DECLINE_ARGUMENT;
    if (scratch_floats < SEGMENT_SCRATCH(Lmax, D))
        return PT_DECLINE_WORKSPACE;
    if (!engine_ok(engine))
        return PT_DECLINE_ISA;
    int64_t rows_of = engine == ENGINE_AMX ? 32 : engine == ENGINE_AVX512_BF16 ? DP_ROWS : 4;   /* a product's rows */
#pragma omp parallel num_threads(nthreads)
    {
        float *at = scratch + (int64_t)THREAD_NUM() * scratch_floats;
        float *sf = TAKE_F32(at, QUERY_BLOCK * Lmax), *of = TAKE_F32(at, QUERY_BLOCK * D);  /* scores, output */
        float *inv = TAKE_F32(at, QUERY_BLOCK);                                             /* 1 / sums */
        uint16_t *pb = TAKE_BF16(at, QUERY_BLOCK * Lmax);                                   /* e's top bits */
        uint16_t *pl = TAKE_BF16(at, QUERY_BLOCK * Lmax);                                   /* its rest */
        uint16_t *qb = TAKE_BF16(at, Lmax * D), *kt = TAKE_BF16(at, Lmax * D), *vv = TAKE_BF16(at, Lmax * D);
        tiles_on(engine);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < nseg * H; task++) {
            int64_t s = task / H, h = task % H, t0 = seg_start[s], L = seg_len[s], Lp = round32(L);
            if (L == 0)
                continue;
            /* Q rows, K^T and V in the matrix units' pair layout, zero past L */
            segment_rows(q, q_t, h * q_h, t0, L, Lp, D, qb);
            segment_kt(k, k_t, h * k_h, t0, L, Lp, D, kt, vv);      /* vv: K's rows, scratch until V's turn */
            segment_vv(v, v_t, h * v_h, t0, L, Lp, D, vv);
            for (int64_t i0 = 0; i0 < L; i0 += QUERY_BLOCK) {
                int64_t m = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK, mr = (m + rows_of - 1) / rows_of * rows_of;
                mm_bf16(engine, qb + i0 * D, D, kt, mr, Lp, D, sf, Lp, 0, NULL, 0);
                query_block_out(engine, sf, pb, pl, Lp, vv, m, mr, D, L, 0, scale, inv, of,
                                out + (t0 + i0) * H * D + h * D, H * D);
            }
        }
        tiles_off(engine);
    }
    return PT_OK;
}

/* ---- Causal attention within segments (the decoder's packed questions) in bf16 on the matrix units ------------
 * For each segment s (tokens seg_start[s] .. + seg_len[s]) and query head h, whose key/value head is h / (H / Hkv):
 * causal softmax attention, QUERY_BLOCK query rows at a time, each block's scores materialised up to its last key (64
 * rows of a 2304-token segment are 590 KB of floats, in L2): S = Q K^T on the tiles with float32 sums, e = exp(scale
 * (S - rowmax)) over the keys each row sees (zeros past them), O = (pb V + pl V) / rowsum(e) with pb + pl = e:
 * pt_segment_attention_bf16's numerics. Each key/value head's K^T (32-key blocks, each [D/2, 64] in the pair
 * layout) and V (the pair layout) are packed once per segment into kv, shared by the threads: kv_per_head =
 * CAUSAL_KV(Lp, D) bf16 per key/value head for the longest segment (Lp its length rounded up to 32); scratch holds
 * CAUSAL_SCRATCH(Lp, D) floats per thread. The query blocks of a segment go to threads last (longest) first.
 * q, k, v: bf16 with strides (t, h, 1) in elements; out: [T, H, D] bf16 contiguous. D a multiple of 32 up to 256, H
 * a multiple of Hkv, the engine as in pt_delta_chunked_bf16. */
#define MAX_CAUSAL 32768
#define CAUSAL_KV(L, D) (2 * (L) * (D))
#define CAUSAL_SCRATCH(L, D) \
    (QUERY_BLOCK * (L) + QUERY_BLOCK * (L) + QUERY_BLOCK * (D) / 2 + QUERY_BLOCK * (D) + QUERY_BLOCK + 16 * (D) \
     + 7 * 64)

/* CAUSAL_SCRATCH and CAUSAL_KV for the longest segment (padded here): what the caller allocates */
PT_API int pt_causal_attention_scratch(int64_t longest, int64_t D, int64_t *floats, int64_t *kv_per_head) {
    *floats = CAUSAL_SCRATCH(round32(longest), D);
    *kv_per_head = CAUSAL_KV(round32(longest), D);
    return PT_OK;
}

PT_API int pt_causal_attention_bf16(const pt_attention_args *a, int engine, uint16_t *out, uint16_t *kv,
                                    int64_t kv_per_head, float *scratch, int64_t scratch_floats, int nthreads) {
    const uint16_t *q = a->q, *k = a->k, *v = a->v;
    int64_t q_t = a->q_t, q_h = a->q_h, k_t = a->k_t, k_h = a->k_h, v_t = a->v_t, v_h = a->v_h, H = a->H;
    int64_t Hkv = a->Hkv, D = a->D, nseg = a->nseg;
    const int64_t *seg_start = a->seg_start, *seg_len = a->seg_len;
    float scale = a->scale;
    int64_t longest = longest_segment(seg_start, seg_len, nseg), Lmax = round32(longest);
    if (longest < 0 || H < 1 || Hkv < 1 || H % Hkv || D < 32 || D % 32 || D > 256 || longest > MAX_CAUSAL)
        return PT_DECLINE_SHAPE;
    if (!a->causal)
        return PT_DECLINE_ARGUMENT;
    if (scratch_floats < CAUSAL_SCRATCH(Lmax, D) || kv_per_head < CAUSAL_KV(Lmax, D))
        return PT_DECLINE_WORKSPACE;
    if (!engine_ok(engine))
        return PT_DECLINE_ISA;
    int64_t group = H / Hkv;
#pragma omp parallel num_threads(nthreads)
    {
        float *at = scratch + (int64_t)THREAD_NUM() * scratch_floats;
        float *sf = TAKE_F32(at, QUERY_BLOCK * Lmax), *of = TAKE_F32(at, QUERY_BLOCK * D);
        float *inv = TAKE_F32(at, QUERY_BLOCK);
        uint16_t *pb = TAKE_BF16(at, QUERY_BLOCK * Lmax), *qb = TAKE_BF16(at, QUERY_BLOCK * D);
        uint16_t *pl = TAKE_BF16(at, QUERY_BLOCK * Lmax);
        uint16_t *rows = TAKE_BF16(at, 32 * D);
        tiles_on(engine);
        for (int64_t s = 0; s < nseg; s++) {
            int64_t t0 = seg_start[s], L = seg_len[s], nb = round32(L) / 32;
            int64_t nq = (L + QUERY_BLOCK - 1) / QUERY_BLOCK;
            /* K^T and V of every key/value head, 32 keys a task (the loop's end is a barrier) */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < Hkv * nb; task++) {
                int64_t hk = task / nb, j = task % nb, n = L - 32 * j < 32 ? L - 32 * j : 32;
                uint16_t *kt = kv + hk * kv_per_head, *vv = kt + Lmax * D;
                segment_kt(k, k_t, hk * k_h, t0 + 32 * j, n, 32, D, kt + j * 32 * D, rows);
                segment_vv(v, v_t, hk * v_h, t0 + 32 * j, n, 32, D, vv + j * 32 * D);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < H * nq; task++) {
                int64_t h = task % H, i0 = (nq - 1 - task / H) * QUERY_BLOCK;
                int64_t m = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK, kend = round32(i0 + m);
                const uint16_t *kt = kv + (h / group) * kv_per_head, *vv = kt + Lmax * D;
                segment_rows(q, q_t, h * q_h, t0 + i0, m, QUERY_BLOCK, D, qb);
                for (int64_t j = 0; j < kend / 32; j++)
                    mm_bf16(engine, qb, D, kt + j * 32 * D, QUERY_BLOCK, 32, D, sf + 32 * j, kend, 0, NULL, 0);
                /* row i sees keys 0 .. i0 + i; whole blocks of rows (a constant the products are compiled for) */
                query_block_out(engine, sf, pb, pl, kend, vv, m, QUERY_BLOCK, D, i0 + 1, 1, scale, inv, of,
                                out + (t0 + i0) * H * D + h * D, H * D);
            }
        }
        tiles_off(engine);
    }
    return PT_OK;
}
PT_CONTRACT_END
