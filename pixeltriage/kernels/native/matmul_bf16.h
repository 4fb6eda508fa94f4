/* The bf16 products of the bf16 delta pass and the bf16 attention (delta_bf16.c, attention_bf16.c), on three
 * engines (abi.h's pt_bf16_engine), and the packers of their operands.
 *
 * Products take A row-major [M, Kd] and B in the matrix units' pair-interleaved layout ("VNNI": row p holds
 * B[2p, n], B[2p + 1, n] for each n, 2N bf16), and run on one of three engines: AMX tiles, AVX512-BF16 dot
 * products, or plain float32 multiply-adds of the same bf16 operands (any machine; the tests' reference for the
 * other two, equal up to the order of float32 sums). M, N and Kd are multiples of 32. */
#ifndef PT_MATMUL_BF16_H
#define PT_MATMUL_BF16_H

#include "vec.h"

#define ENGINE_FMA PT_ENGINE_FMA
#define ENGINE_AVX512_BF16 PT_ENGINE_AVX512_BF16
#define ENGINE_AMX PT_ENGINE_AMX

/* The engines this build runs: bit e for engine e; AMX only once Linux has granted the process its tile state
 * (asked at each call, a no-op after the first grant). features.c */
int bf16_engine_bits(void);

/* Where `engine` names a bf16 engine this build runs */
static inline int engine_ok(int engine) {
    return engine >= ENGINE_FMA && engine <= ENGINE_AMX && (bf16_engine_bits() & (1 << engine));
}

PT_CONTRACT_BEGIN
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4), may_alias));

/* bf16 pair (a[0], a[1]) as one 32-bit word */
static inline uint32_t bf16_pair(const uint16_t *a) {
    uint32_t w;
    memcpy(&w, a, sizeof w);
    return w;
}

/* c[M, N] (float32, row stride ldc) = (acc ? cscale c : 0) + a[M, Kd] b[Kd, N]; a: bf16 row-major (row stride lda);
 * b: the pair-interleaved layout of a [Kd, N] matrix (row p: 2N bf16); cscale: NULL (1), or c's row i times cscale[i]
 * as it is read (one float32 product, as a pass over c before the call). lower: a is lower triangular (a[i, p] = 0
 * for p > i), so row block i0 reads only its first i0 + block columns. The "fma" engine: 4 rows by 16 columns in
 * registers, one pair of the reduction per step, each bf16 widened and multiplied in float32 (the reference of the
 * other two). */
PT_HELPER void mm_bf16_vec(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
                        float *c, int64_t ldc, int acc, const float *cscale, int lower) {
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
        int64_t kd = lower && i0 + 4 < Kd ? i0 + 4 : Kd;
        for (int64_t j0 = 0; j0 < N; j0 += VL) {
            vf16 s[4];
            for (int r = 0; r < 4; r++) {
                s[r] = acc ? *(const vf16 *)(c + (i0 + r) * ldc + j0) : (vf16){0};
                if (acc && cscale)
                    s[r] *= cscale[i0 + r];
            }
            for (int64_t p = 0; p < kd / 2; p++) {
                vu16 bb = *(const vu16 *)(b + p * 2 * N + 2 * j0);
                vf16 even = (vf16)(bb << 16), odd = (vf16)(bb & 0xffff0000u);
                for (int r = 0; r < 4; r++) {
                    const uint16_t *ar = a + (i0 + r) * lda + 2 * p;
                    s[r] += bf16_to_float(ar[0]) * even;
                    s[r] += bf16_to_float(ar[1]) * odd;
                }
            }
            for (int r = 0; r < 4; r++)
                *(vf16 *)(c + (i0 + r) * ldc + j0) = s[r];
        }
    }
}

#define DP_ROWS 8                      /* mm_bf16_dp's rows of c at a time (so a multiple of them for its M) */
#ifdef PT_AVX512BF16
/* mm_bf16_vec's contract on AVX512-BF16's dot products (each lane: c += a pair times b's pair, 32 multiply-adds per
 * instruction): 8 rows by 32 columns of c in 16 registers, so that 16 independent dot products per pair of the
 * reduction cover the instruction's latency (two loads of b and 8 broadcasts of a's pairs feed them). In 4 rows by
 * 16 columns (4 accumulators), latency bound, the bf16 delta pass took 1.07x the float32 pass's time on a bench-small
 * layer and the causal attention 0.69x SDPA's (AMD EPYC with AVX-512 BF16, 2 threads). */
PT_HELPER void mm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
                       float *c, int64_t ldc, int acc, const float *cscale, int lower) {
    for (int64_t i0 = 0; i0 < M; i0 += DP_ROWS) {
        int64_t kd = lower && i0 + DP_ROWS < Kd ? i0 + DP_ROWS : Kd;
        for (int64_t j0 = 0; j0 < N; j0 += 2 * VL) {
            __m512 s[DP_ROWS][2];
#pragma GCC unroll 8
            for (int r = 0; r < DP_ROWS; r++)
                for (int h = 0; h < 2; h++)
                    s[r][h] = !acc ? _mm512_setzero_ps()
                              : cscale ? _mm512_mul_ps(_mm512_loadu_ps(c + (i0 + r) * ldc + j0 + h * VL),
                                                       _mm512_set1_ps(cscale[i0 + r]))
                                       : _mm512_loadu_ps(c + (i0 + r) * ldc + j0 + h * VL);
            const uint16_t *ap = a + i0 * lda;
            for (int64_t p = 0; p < kd / 2; p++) {
                __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * N + 2 * j0);
                __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * N + 2 * (j0 + VL));
#pragma GCC unroll 8
                for (int r = 0; r < DP_ROWS; r++) {
                    __m512bh ar = (__m512bh)_mm512_set1_epi32((int)bf16_pair(ap + r * lda + 2 * p));
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], ar, b0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], ar, b1);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < DP_ROWS; r++)
                for (int h = 0; h < 2; h++)
                    _mm512_storeu_ps(c + (i0 + r) * ldc + j0 + h * VL, s[r][h]);
        }
    }
}
#endif

#ifdef PT_AMX
/* Tile configuration: eight 16-row x 64-byte tiles; 0-3 hold a 32 x 32 block of c (float32), 4-5 two 16-row
 * blocks of a (32 bf16 of the reduction each), 6-7 two 16-column blocks of b (16 pairs of rows each). */
PT_HELPER void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* mm_bf16_vec's contract on AMX tiles, in 32 x 32 blocks of c. */
PT_HELPER void mm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
                        float *c, int64_t ldc, int acc, int lower) {
    int64_t sa = lda * 2, sb = N * 4, sc = ldc * 4;          /* row strides in bytes */
    for (int64_t i0 = 0; i0 < M; i0 += 32) {
        int64_t kd = lower && i0 + 32 < Kd ? i0 + 32 : Kd;
        for (int64_t j0 = 0; j0 < N; j0 += 32) {
            float *c0 = c + i0 * ldc + j0, *c1 = c0 + 16 * ldc;
            if (acc) {
                _tile_loadd(0, c0, sc);
                _tile_loadd(1, c0 + 16, sc);
                _tile_loadd(2, c1, sc);
                _tile_loadd(3, c1 + 16, sc);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t p = 0; p < kd; p += 32) {
                _tile_loadd(4, a + i0 * lda + p, sa);
                _tile_loadd(5, a + (i0 + 16) * lda + p, sa);
                _tile_loadd(6, b + p * N + 2 * j0, sb);               /* row p / 2 of 2N bf16 */
                _tile_loadd(7, b + p * N + 2 * (j0 + 16), sb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c0, sc);
            _tile_stored(1, c0 + 16, sc);
            _tile_stored(2, c1, sc);
            _tile_stored(3, c1 + 16, sc);
        }
    }
}
#endif

PT_HELPER void mm_bf16(int engine, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
                    float *c, int64_t ldc, int acc, const float *cscale, int lower) {
#ifdef PT_AMX
    if (engine == ENGINE_AMX) {                       /* the tiles load c as it is: cscale in a pass before */
        if (acc && cscale)
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++)
                    c[i * ldc + j] *= cscale[i];
        mm_bf16_amx(a, lda, b, M, N, Kd, c, ldc, acc, lower);
        return;
    }
#endif
#ifdef PT_AVX512BF16
    if (engine == ENGINE_AVX512_BF16) {
        mm_bf16_dp(a, lda, b, M, N, Kd, c, ldc, acc, cscale, lower);
        return;
    }
#endif
    (void)engine;
    mm_bf16_vec(a, lda, b, M, N, Kd, c, ldc, acc, cscale, lower);
}

/* A thread's tile state around its products on `engine` (each thread of a parallel region configures its own
 * tiles, and releases them at its end); nothing for the other engines */
static inline void tiles_on(int engine) {
#ifdef PT_AMX
    if (engine == ENGINE_AMX)
        amx_configure();
#endif
    (void)engine;
}

static inline void tiles_off(int engine) {
#ifdef PT_AMX
    if (engine == ENGINE_AMX)
        _tile_release();
#endif
    (void)engine;
}

/* The bf16 pass's operand packers. The scalar ones (`_ref`) are the reference, and the path of builds without
 * AVX512-BF16; the vector ones convert 32 floats per instruction with the same rounding (nearest even, NaN quieted),
 * except that denormal floats become zero, as the AMX tiles read bf16 denormals anyway. `pt_bf16_pack` runs either
 * for the tests. At bench-small the scalar packers were ~30% of the pass (perf samples, 2 threads). */

/* dst[R, N] bf16 row-major (row stride ldd) = src[R, N] float32 (row stride lds) * (rowscale ? rowscale[r] : 1) */
PT_HELPER void to_bf16_rows_ref(const float *src, int64_t lds, int64_t R, int64_t N, const float *rowscale,
                             uint16_t *dst, int64_t ldd) {
    for (int64_t r = 0; r < R; r++) {
        float s = rowscale ? rowscale[r] : 1.0f;
        for (int64_t n = 0; n < N; n++)
            dst[r * ldd + n] = float_to_bf16(src[r * lds + n] * s);
    }
}

/* The pair-interleaved layout of B = src[R, N] (float32, row stride lds; R even):
 * dst[p, 2n + e] = bf16(B[2p + e, n]) */
PT_HELPER void pack_pairs_ref(const float *src, int64_t lds, int64_t R, int64_t N, uint16_t *dst) {
    for (int64_t p = 0; p < R / 2; p++) {
        const float *r0 = src + 2 * p * lds, *r1 = r0 + lds;
        uint16_t *o = dst + p * 2 * N;
        for (int64_t n = 0; n < N; n++) {
            o[2 * n] = float_to_bf16(r0[n]);
            o[2 * n + 1] = float_to_bf16(r1[n]);
        }
    }
}

/* The same for B = src^T, src [N, R] float32 (row stride lds): dst[p, 2n + e] = bf16(src[n, 2p + e]) */
PT_HELPER void pack_pairs_t_ref(const float *src, int64_t lds, int64_t N, int64_t R, uint16_t *dst) {
    for (int64_t n = 0; n < N; n++) {
        const float *row = src + n * lds;
        for (int64_t p = 0; p < R / 2; p++) {
            dst[p * 2 * N + 2 * n] = float_to_bf16(row[2 * p]);
            dst[p * 2 * N + 2 * n + 1] = float_to_bf16(row[2 * p + 1]);
        }
    }
}

/* dst[R, N] bf16 (row stride ldd) = (src[N, R] float32 (row stride lds) * rowscale[n])^T: a row-major transpose */
PT_HELPER void to_bf16_t_ref(const float *src, int64_t lds, int64_t N, int64_t R, const float *rowscale, uint16_t *dst,
                          int64_t ldd) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < N; n++)
            dst[r * ldd + n] = float_to_bf16(src[n * lds + r] * rowscale[n]);
}

#ifdef PT_AVX512BF16
PT_HELPER void to_bf16_rows_fast(const float *src, int64_t lds, int64_t R, int64_t N, const float *rowscale,
                              uint16_t *dst, int64_t ldd) {
    if (N % 32) {
        to_bf16_rows_ref(src, lds, R, N, rowscale, dst, ldd);
        return;
    }
    for (int64_t r = 0; r < R; r++) {
        __m512 s = _mm512_set1_ps(rowscale ? rowscale[r] : 1.0f);
        const float *in = src + r * lds;
        for (int64_t n = 0; n < N; n += 32)
            _mm512_storeu_si512(dst + r * ldd + n, bf16x32(_mm512_mul_ps(_mm512_loadu_ps(in + n), s),
                                                           _mm512_mul_ps(_mm512_loadu_ps(in + n + 16), s)));
    }
}

/* 16 floats of two rows, a and b, as 16 bf16 pairs (a[j], b[j]): one 32-bit word each, in order */
static inline __m512i bf16_pairs16(__m512 a, __m512 b) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(interleave), bf16x32(a, b));
}

PT_HELPER void pack_pairs_fast(const float *src, int64_t lds, int64_t R, int64_t N, uint16_t *dst) {
    if (N % 16 || R % 2) {
        pack_pairs_ref(src, lds, R, N, dst);
        return;
    }
    for (int64_t p = 0; p < R / 2; p++) {
        const float *r0 = src + 2 * p * lds, *r1 = r0 + lds;
        uint16_t *o = dst + p * 2 * N;
        for (int64_t n = 0; n < N; n += 16)
            _mm512_storeu_si512(o + 2 * n, bf16_pairs16(_mm512_loadu_ps(r0 + n), _mm512_loadu_ps(r1 + n)));
    }
}

/* 16 rows of src at a time: each row's 32 floats become 16 bf16 pairs (32-bit words), the rows of a 16 x 16 matrix
 * of words that `transpose16_epi32` turns into 16 output rows' pieces */
PT_HELPER void pack_pairs_t_fast(const float *src, int64_t lds, int64_t N, int64_t R, uint16_t *dst) {
    if (N % 16 || R % 32) {
        pack_pairs_t_ref(src, lds, N, R, dst);
        return;
    }
    for (int64_t n0 = 0; n0 < N; n0 += 16)
        for (int64_t p0 = 0; p0 < R / 2; p0 += 16) {
            __m512i x[16];
            for (int64_t i = 0; i < 16; i++) {
                const float *in = src + (n0 + i) * lds + 2 * p0;
                x[i] = bf16x32(_mm512_loadu_ps(in), _mm512_loadu_ps(in + 16));
            }
            transpose16_epi32(x);
            for (int64_t j = 0; j < 16; j++)          /* output row p0 + j, words n0 .. n0 + 16 */
                _mm512_storeu_si512(dst + (p0 + j) * 2 * N + 2 * n0, x[j]);
        }
}

/* 32 rows of src by 16 columns at a time: rows 2i and 2i + 1, scaled and rounded, interleaved into 16 pairs (the
 * pairs of output columns 2i, 2i + 1 for 16 output rows), then `transpose16_epi32`: each output row's 32 bf16 */
PT_HELPER void to_bf16_t_fast(const float *src, int64_t lds, int64_t N, int64_t R, const float *rowscale, uint16_t *dst,
                           int64_t ldd) {
    if (N % 32 || R % 16) {
        to_bf16_t_ref(src, lds, N, R, rowscale, dst, ldd);
        return;
    }
    for (int64_t n0 = 0; n0 < N; n0 += 32)
        for (int64_t r0 = 0; r0 < R; r0 += 16) {
            __m512i x[16];
            for (int64_t i = 0; i < 16; i++) {
                const float *in = src + (n0 + 2 * i) * lds + r0;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(in), _mm512_set1_ps(rowscale[n0 + 2 * i]));
                __m512 b = _mm512_mul_ps(_mm512_loadu_ps(in + lds), _mm512_set1_ps(rowscale[n0 + 2 * i + 1]));
                x[i] = bf16_pairs16(a, b);
            }
            transpose16_epi32(x);
            for (int64_t j = 0; j < 16; j++)
                _mm512_storeu_si512(dst + (r0 + j) * ldd + n0, x[j]);
        }
}
#define PT_FAST_PACK 1
#define to_bf16_rows to_bf16_rows_fast
#define pack_pairs pack_pairs_fast
#define pack_pairs_t pack_pairs_t_fast
#define to_bf16_t to_bf16_t_fast
#else
#define PT_FAST_PACK 0
#define to_bf16_rows to_bf16_rows_ref
#define pack_pairs pack_pairs_ref
#define pack_pairs_t pack_pairs_t_ref
#define to_bf16_t to_bf16_t_ref
#endif
PT_CONTRACT_END

#endif
