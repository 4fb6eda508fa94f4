/* The depthwise causal conv1d + SiLU of the Gated DeltaNet (conv.c's pt_causal_conv1d_silu, and the delta passes'
 * conv mode, delta.h): a token's channels (`conv_silu_span`) and a chunk's rows (`conv_silu_chunk`). */
#ifndef PT_CONV_H
#define PT_CONV_H

#include "vec.h"


#define MAX_CONV_WIDTH 16

/* A conv's input: the projection x [T, conv_dim] (bf16 if x_bf16, row stride x_t) and taps [W, conv_dim] float32;
 * the SiLU to the accuracy of a bf16 consumer where silu_bf16 (`silu16_bf16`, the bf16 delta pass) instead of
 * `silu16` */
typedef struct {
    const void *x;
    int x_bf16, W;
    int64_t x_t, conv_dim;
    const float *taps;
    int silu_bf16;
} conv_source;

/* One token's depthwise causal conv1d + SiLU over channels [c0, c0 + n):
 *   out[c] = silu(x[t, c0 + c] * taps[W - 1, c0 + c] + sum_{j < W - 1} x[t - W + 1 + j, c0 + c] * taps[j, c0 + c])
 * the sum in the order written (the torch path's), rows before seg0 (the first row of t's packed sequence) read as
 * zeros. x: rows of `ldt` channels with row stride x_t (bf16 if x_bf16, else float32); taps: [W, ldt] float32. */
#define LOAD_BF16(p, c) bf16_to_float(((const uint16_t *)(p))[c])
#define LOAD_F32(p, c) (((const float *)(p))[c])
/* all taps inside the sequence (the common case): each channel's sum in registers, one pass over out */
#define CONV_SPAN4(LOAD)                                                                                       \
    for (int64_t c = 0; c < n; c++) {                                                                          \
        float y = LOAD(rows[3], c) * w[3][c];                                                                  \
        y += LOAD(rows[0], c) * w[0][c];                                                                       \
        y += LOAD(rows[1], c) * w[1][c];                                                                       \
        y += LOAD(rows[2], c) * w[2][c];                                                                       \
        out[c] = silu_f32(y);                                                                                  \
    }
#define CONV_SPAN(LOAD)                                                                                        \
    for (int64_t c = 0; c < n; c++) {                                                                          \
        float y = LOAD(rows[W - 1], c) * w[W - 1][c];                                                          \
        for (int j = first; j < W - 1; j++)                                                                    \
            y += LOAD(rows[j], c) * w[j][c];                                                                   \
        out[c] = silu_f32(y);                                                                                  \
    }

PT_CONTRACT_BEGIN                 /* the multiply-adds fused, as in the delta rule's pass */
static void conv_silu_span(const void *x, int x_bf16, int64_t x_t, const float *taps, int W, int64_t ldt, int64_t t,
                           int64_t seg0, int64_t c0, int64_t n, float *restrict out) {
    const void *rows[MAX_CONV_WIDTH];
    const float *w[MAX_CONV_WIDTH];
    size_t elem = x_bf16 ? 2 : 4;
    int first = 0;                                   /* the first tap inside the sequence (taps before: zeros) */
    for (int j = 0; j < W; j++) {
        int64_t r = t - W + 1 + j;
        if (r < seg0) {
            first = j + 1;
            r = t;                                   /* never read: a row inside the buffer all the same */
        }
        rows[j] = (const char *)x + (size_t)(r * x_t + c0) * elem;
        w[j] = taps + (int64_t)j * ldt + c0;
    }
    if (W == 4 && first == 0) {
        if (x_bf16) { CONV_SPAN4(LOAD_BF16) } else { CONV_SPAN4(LOAD_F32) }
    } else {
        if (x_bf16) { CONV_SPAN(LOAD_BF16) } else { CONV_SPAN(LOAD_F32) }
    }
}
PT_CONTRACT_END

PT_CONTRACT_BEGIN
/* Conv mode: rows i < len of the chunk starting at token t0, channels [c0, c0 + n), into out (row i at out + i * ldo):
 * `conv_silu_span`'s values, in its order of multiply-adds. Where built with AVX-512 and W = 4: 32 channels at a
 * time down the chunk's rows, the last three rows' inputs kept in registers (each input line read once, where row by
 * row it was read four times), each row's line asked for 8 rows ahead (rows are 12-24 KB apart, each on its own
 * page, where the hardware prefetchers do not follow), the next 32 channels' first rows at the end of a column.
 * The SiLU is `silu16` (rcp14 and a Newton step for the division: within 2 ulp of y / (1 + e^-y)), or for the bf16
 * pass `silu16_bf16` (relative error under 1e-5, its q, k and v rounded to bf16 after: 0.93x that pass); in cache this
 * does 0.64 ns per channel against 1.2-1.6 for the scalar loops. Bench-small layer (2296 tokens, 16 heads of 128),
 * paired against a row-by-row AVX-512 conv: 0.88x the float32 pass, 0.83x the bf16 pass; down the rows without the
 * prefetches it was 1.09-1.13x slower. */
#define CONV_COLUMN_STEP(LOAD, SILU)                                                                                \
    for (int64_t c = 0; c < n; c += 32) {                                                                     \
        const float *tp = a->taps + c0 + c;                                                                   \
        int64_t ldt = a->conv_dim;                                                                            \
        __m512 w00 = _mm512_loadu_ps(tp), w01 = _mm512_loadu_ps(tp + 16);                                     \
        __m512 w10 = _mm512_loadu_ps(tp + ldt), w11 = _mm512_loadu_ps(tp + ldt + 16);                         \
        __m512 w20 = _mm512_loadu_ps(tp + 2 * ldt), w21 = _mm512_loadu_ps(tp + 2 * ldt + 16);                 \
        __m512 w30 = _mm512_loadu_ps(tp + 3 * ldt), w31 = _mm512_loadu_ps(tp + 3 * ldt + 16);                 \
        int64_t t = t0 + i;                                                                                   \
        __m512 p30 = LOAD(t - 3, c), p31 = LOAD(t - 3, c + 16), p20 = LOAD(t - 2, c), p21 = LOAD(t - 2, c + 16); \
        __m512 p10 = LOAD(t - 1, c), p11 = LOAD(t - 1, c + 16);                                               \
        for (int64_t r = i; r < len; r++, t++) {                                                              \
            if (r + 8 < len) {                                                                                 \
                __builtin_prefetch(&LOAD_ADDR(t + 8, c), 0, 3);                                               \
                __builtin_prefetch(&LOAD_ADDR(t + 8, c + 16), 0, 3);                                          \
            } else if (c + 32 < n && i + r + 8 < 2 * len) {                                                   \
                __builtin_prefetch(&LOAD_ADDR(t0 + i + r + 8 - len, c + 32), 0, 3);                           \
                __builtin_prefetch(&LOAD_ADDR(t0 + i + r + 8 - len, c + 48), 0, 3);                           \
            }                                                                                                  \
            __m512 x0 = LOAD(t, c), x1 = LOAD(t, c + 16);                                                     \
            __m512 y0 = _mm512_fmadd_ps(p30, w00, _mm512_mul_ps(x0, w30));                                    \
            __m512 y1 = _mm512_fmadd_ps(p31, w01, _mm512_mul_ps(x1, w31));                                    \
            y0 = _mm512_fmadd_ps(p10, w20, _mm512_fmadd_ps(p20, w10, y0));                                    \
            y1 = _mm512_fmadd_ps(p11, w21, _mm512_fmadd_ps(p21, w11, y1));                                    \
            _mm512_storeu_ps(out + r * ldo + c, SILU(y0));                                                    \
            _mm512_storeu_ps(out + r * ldo + c + 16, SILU(y1));                                               \
            p30 = p20, p31 = p21, p20 = p10, p21 = p11, p10 = x0, p11 = x1;                                   \
        }                                                                                                     \
    }
#ifndef PT_AVX512F
/* exp_f32 and silu_f32 on a machine vector, operation for operation (so the same values) */
typedef int32_t vri __attribute__((vector_size(VR_BYTES), aligned(4), may_alias));
typedef uint16_t vrh __attribute__((vector_size(VR_BYTES / 2), aligned(2), may_alias));
typedef uint32_t vru __attribute__((vector_size(VR_BYTES), aligned(4), may_alias));
static inline vr vr_select(vri m, vr yes, vr no) { return (vr)((m & (vri)yes) | (~m & (vri)no)); }
static inline vr exp_vr(vr x) {
    x = vr_select(x < -87.0f, (vr){0} - 87.0f, vr_select(x > 88.0f, (vr){0} + 88.0f, x));
    vr n = EXP_ROUND(x), r = EXP_REDUCE(x, n), p = EXP_POLY(r);
    vri bits = ((__builtin_convertvector(n, vri) & (n == n)) + 127) << 23;
    return p * (vr)bits;
}
static inline vr silu_vr(vr y) { return vr_select(y < -87.0f, (vr){0}, y / (1.0f + exp_vr(-y))); }

/* Conv mode without AVX-512, W = 4: two machine vectors of channels at a time (a cache line on AVX2) down rows
 * [i, len) of the chunk, the last three rows' inputs kept in registers (each input line read once, where row by row
 * it was read four times), each row's line asked for 8 rows ahead (rows are 12-24 KB apart, each on its own page),
 * the next column's first rows at the end of one; `conv_silu_span`'s values, bit for bit (the same operations in
 * the same order, the division included). AVX2 EPYC, 2 threads, bench-small's [2296, 6144] of a [2296, 8192]
 * projection against the row-by-row loop: the conv alone 0.85x, a layer's float32 delta pass 0.89-0.90x (one
 * vector at a time: 1.0x and 0.92x). */
#define CONV_COLUMN_VR(NAME, LOAD, ADDR)                                                                            \
static void NAME(const conv_source *a, int64_t t0, int64_t i, int64_t len, int64_t c0, int64_t n, float *out,       \
                 int64_t ldo) {                                                                                     \
    int64_t ldt = a->conv_dim, x_t = a->x_t;                                                                    \
    for (int64_t c = 0; c < n; c += 2 * VRL) {                                                                  \
        const float *tp = a->taps + c0 + c;                                                                     \
        vr w0 = *(const vr *)tp, w1 = *(const vr *)(tp + ldt), w2 = *(const vr *)(tp + 2 * ldt);                \
        vr w3 = *(const vr *)(tp + 3 * ldt), u0 = *(const vr *)(tp + VRL), u1 = *(const vr *)(tp + ldt + VRL);  \
        vr u2 = *(const vr *)(tp + 2 * ldt + VRL), u3 = *(const vr *)(tp + 3 * ldt + VRL);                      \
        int64_t t = t0 + i;                                                                                     \
        vr p3 = LOAD(t - 3, c), p2 = LOAD(t - 2, c), p1 = LOAD(t - 1, c);                                       \
        vr q3 = LOAD(t - 3, c + VRL), q2 = LOAD(t - 2, c + VRL), q1 = LOAD(t - 1, c + VRL);                     \
        for (int64_t r = i; r < len; r++, t++) {                                                                \
            if (r + 8 < len)                                                                                    \
                __builtin_prefetch(ADDR(t + 8, c), 0, 3);                                                       \
            else if (c + 2 * VRL < n && i + r + 8 < 2 * len)                                                    \
                __builtin_prefetch(ADDR(t0 + i + r + 8 - len, c + 2 * VRL), 0, 3);                              \
            vr x = LOAD(t, c), xx = LOAD(t, c + VRL);                                                           \
            vr y = x * w3, yy = xx * u3;                                                                        \
            y += p3 * w0;                                                                                       \
            yy += q3 * u0;                                                                                      \
            y += p2 * w1;                                                                                       \
            yy += q2 * u1;                                                                                      \
            y += p1 * w2;                                                                                       \
            yy += q1 * u2;                                                                                      \
            *(vr *)(out + r * ldo + c) = silu_vr(y);                                                            \
            *(vr *)(out + r * ldo + c + VRL) = silu_vr(yy);                                                     \
            p3 = p2, p2 = p1, p1 = x;                                                                           \
            q3 = q2, q2 = q1, q1 = xx;                                                                          \
        }                                                                                                       \
    }                                                                                                           \
}
#define ADDR_F32(t, c) ((const float *)a->x + c0 + (t) * x_t + (c))
#define LOAD_VR_F32(t, c) (*(const vr *)ADDR_F32(t, c))
#define ADDR_BF16(t, c) ((const uint16_t *)a->x + c0 + (t) * x_t + (c))
#define LOAD_VR_BF16(t, c) ((vr)(__builtin_convertvector(*(const vrh *)ADDR_BF16(t, c), vru) << 16))   /* exact */
CONV_COLUMN_VR(conv_column_vr_f32, LOAD_VR_F32, ADDR_F32)
CONV_COLUMN_VR(conv_column_vr_bf16, LOAD_VR_BF16, ADDR_BF16)
#undef CONV_COLUMN_VR
#undef LOAD_VR_F32
#undef ADDR_F32
#undef LOAD_VR_BF16
#undef ADDR_BF16
#endif

/* the column step for one input layout (LOAD), with the SiLU rounding the call asks for */
#define CONV_COLUMN_STEPS(LOAD)                                                                                    \
    if (a->silu_bf16)                                                                                             \
        CONV_COLUMN_STEP(LOAD, silu16_bf16)                                                                       \
    else                                                                                                          \
        CONV_COLUMN_STEP(LOAD, silu16)

static void conv_silu_chunk(const conv_source *a, int64_t t0, int64_t len, int64_t seg0, int64_t c0, int64_t n,
                            float *out, int64_t ldo) {
    int64_t i = 0;
#ifdef PT_AVX512F
    if (a->W == 4 && n % 32 == 0) {
        for (; i < len && t0 + i - 3 < seg0; i++)       /* rows whose taps reach before the sequence: one by one */
            conv_silu_span(a->x, a->x_bf16, a->x_t, a->taps, 4, a->conv_dim, t0 + i, seg0, c0, n, out + i * ldo);
        if (i < len) {
            if (a->x_bf16) {
                const uint16_t *xb = (const uint16_t *)a->x + c0;
#define LOAD_ROW(t, c) load_bf16x16(xb + (t) * a->x_t + (c))
#define LOAD_ADDR(t, c) xb[(t) * a->x_t + (c)]
                CONV_COLUMN_STEPS(LOAD_ROW)
#undef LOAD_ROW
#undef LOAD_ADDR
            } else {
                const float *xf = (const float *)a->x + c0;
#define LOAD_ROW(t, c) _mm512_loadu_ps(xf + (t) * a->x_t + (c))
#define LOAD_ADDR(t, c) xf[(t) * a->x_t + (c)]
                CONV_COLUMN_STEPS(LOAD_ROW)
#undef LOAD_ROW
#undef LOAD_ADDR
            }
        }
        return;
    }
#else
    if (a->W == 4 && n % (2 * VRL) == 0) {
        for (; i < len && t0 + i - 3 < seg0; i++)       /* rows whose taps reach before the sequence: one by one */
            conv_silu_span(a->x, a->x_bf16, a->x_t, a->taps, 4, a->conv_dim, t0 + i, seg0, c0, n, out + i * ldo);
        if (i < len) {
            if (a->x_bf16)
                conv_column_vr_bf16(a, t0, i, len, c0, n, out, ldo);
            else
                conv_column_vr_f32(a, t0, i, len, c0, n, out, ldo);
        }
        return;
    }
#endif
    for (; i < len; i++)
        conv_silu_span(a->x, a->x_bf16, a->x_t, a->taps, a->W, a->conv_dim, t0 + i, seg0, c0, n, out + i * ldo);
}
#undef CONV_COLUMN_STEP
PT_CONTRACT_END

#endif
