/* PixelTriage's native CPU kernels: plain C11 + OpenMP, called through ctypes (see __init__.py). Each entry point's
 * contract, the codes it returns, its Python reference and its test: abi.h. bf16 inputs are read as the top half of
 * a float32 (exact); all arithmetic is float32.
 */
#define _DEFAULT_SOURCE              /* syscall(), for the AMX permission */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "abi.h"
#include "isa.h"
#ifdef PT_AVX512F
#include "vec_math.h"

/* 16 bf16 at p as float32 (exact: the top halves) */
static inline __m512 load_bf16x16(const uint16_t *p) { return widen_bf16x16(_mm256_loadu_si256((const __m256i *)p)); }
#endif

#define MAX_CONV_WIDTH 16

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* e^x, |relative error| < 2 ulp over the float range: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6
 * polynomial (Cephes' expf coefficients). Branch-free and call-free, so the loops around it vectorise (libm's
 * expf does not). Inputs are clamped to [-87, 88]: below, e^x is under float's normal range (0 for our uses). */
/* its steps, shared with the vector twin exp_vr (same operations, same order: the same bits), for a float or a vector:
 * n = round(x / ln2) to the nearest integer; r = x - n ln2 with ln2 split in two (n * ln2_hi exact); p(r) */
#define EXP_ROUND(x) (((x) * 1.44269504088896341f + 12582912.0f) - 12582912.0f)
#define EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define EXP_POLY(r) ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) \
                       * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = EXP_ROUND(x), r = EXP_REDUCE(x, n), p = EXP_POLY(r);
    int32_t bits = ((int32_t)(n == n ? n : 0.0f) + 127) << 23;   /* NaN in: NaN out (through p), no UB cast */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* vec_math.h's vector functions on n floats, for the tests (their float64 references beside them) */
PT_API int pt_vec_math(int which, const float *x, int64_t n, float *out) {
    if (which < PT_VEC_EXP || which > PT_VEC_SILU_BF16)
        return PT_DECLINE_ARGUMENT;
    if (n < 0)
        return PT_DECLINE_SHAPE;
#ifdef PT_AVX512F
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes16(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        v = which == PT_VEC_EXP ? exp16(v) : which == PT_VEC_EXP2_BF16 ? exp2_16_bf16(v)
            : which == PT_VEC_SILU ? silu16(v) : silu16_bf16(v);
        _mm512_mask_storeu_ps(out + i, m, v);
    }
    return PT_OK;
#else
    (void)x, (void)out;
    return PT_DECLINE_ISA;
#endif
}

/* SiLU, y / (1 + e^-y); 0 below y = -87, where e^-y leaves float's range (the true value is under 2e-36 there). */
static inline float silu_f32(float y) { return y < -87.0f ? 0.0f : y / (1.0f + exp_f32(-y)); }

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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")                 /* the multiply-adds fused, as in the delta rule's pass */
#endif
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
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

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

/* float32 -> bfloat16, rounding to nearest even (torch's .to(torch.bfloat16)); NaNs stay quiet NaNs. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* dst[0, n) = bf16(src[0, n)), float_to_bf16's rounding, 32 at a time where the build has AVX512-BF16 (there
 * denormal floats become zero) */
#ifdef PT_AVX512BF16
/* 32 floats, lo then hi, as 32 bf16 in order */
static inline __m512i bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#endif

/* The transpose of a matrix held as n registers of n lanes (its rows), in place, in log2(n) rounds: in round s
 * (n / 2, ..., 1) each pair of registers i, i + s (i & s == 0) swaps its off-diagonal s x s blocks, within every
 * 2s x 2s block at once, one two-source shuffle per register: register i's lane j becomes its partner's lane j - s
 * where j & s (the `lo` mask: indices n and up name the partner's lanes), the partner's the mirror of it (`hi`).
 * TRANSPOSE_ROUNDS(n, ROUND) calls ROUND(s, (lo...), (hi...)) for each round of n lanes (n = 16, 8 or 4). */
#define LANES(...) __VA_ARGS__
#define TRANSPOSE_ROUNDS_16(ROUND)                                                                            \
    ROUND(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                                        \
          (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))                                     \
    ROUND(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),                                      \
          (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))                                       \
    ROUND(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),                                      \
          (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))                                       \
    ROUND(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),                                     \
          (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define TRANSPOSE_ROUNDS_8(ROUND)                                                                             \
    ROUND(4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))                                        \
    ROUND(2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))                                        \
    ROUND(1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#define TRANSPOSE_ROUNDS_4(ROUND)                                                                             \
    ROUND(2, (0, 1, 4, 5), (2, 3, 6, 7))                                                                      \
    ROUND(1, (0, 4, 2, 6), (1, 5, 3, 7))
#define TRANSPOSE_ROUNDS(n, ROUND) TRANSPOSE_ROUNDS_##n(ROUND)
/* one round over the array `x` of registers of type `vec`, masks of type `mask` (in scope: x, n lanes) */
#define TRANSPOSE_ROUND(x, n, vec, mask, s, lo, hi)                                                           \
    for (int i = 0; i < (n); i++)                                                                             \
        if (!(i & (s))) {                                                                                     \
            vec a_ = x[i], b_ = x[i + (s)];                                                                   \
            x[i] = __builtin_shuffle(a_, b_, (mask){LANES lo});                                               \
            x[i + (s)] = __builtin_shuffle(a_, b_, (mask){LANES hi});                                         \
        }

#ifdef PT_AVX512F
/* x[0, 16) as the rows of a 16 x 16 matrix of 32-bit words (a bf16 pair each), transposed in place (the rounds
 * above: 64 two-source permutes, where a gather per output row read each of its 16 words from another cache line) */
typedef int32_t v16si __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i x[16]) {
    v16si w[16];
    for (int i = 0; i < 16; i++)
        w[i] = (v16si)x[i];
#define ROUND16(s, lo, hi) TRANSPOSE_ROUND(w, 16, v16si, v16si, s, lo, hi)
    TRANSPOSE_ROUNDS(16, ROUND16)
#undef ROUND16
    for (int i = 0; i < 16; i++)
        x[i] = (__m512i)w[i];
}
#endif

static inline void bf16_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#ifdef PT_AVX512BF16
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512(dst + i, bf16x32(_mm512_loadu_ps(src + i), _mm512_loadu_ps(src + i + 16)));
#endif
    for (; i < n; i++)
        dst[i] = float_to_bf16(src[i]);
}

/* A dtype flag the kernels take: 0 float32, 1 bfloat16 */
static inline int dtype_flag_ok(int flag) { return flag == 0 || flag == 1; }

/* The Gated DeltaNet's output norm: out[r, h, :] = x[r, h, :] / sqrt(mean(x[r, h, :]^2) + eps) * w * silu(z[r, h, :]).
 * x: float32 [R, H, D] with strides (x_r, x_h, 1); z: [R, H, D] (bf16 if z_bf16) with strides (z_r, z_h, 1);
 * w: float32 [D]; out: [R, H * D] contiguous, in z's dtype (rounded once, from float32). */
PT_API int pt_rms_norm_gated(const pt_norm_gated_args *a, void *out, int nthreads) {
    const float *x = a->x, *w = a->w;
    const void *z = a->z;
    int64_t x_r = a->x_r, x_h = a->x_h, z_r = a->z_r, z_h = a->z_h, R = a->R, H = a->H, D = a->D;
    int z_bf16 = a->z_bf16;
    float eps = a->eps;
    if (R < 0 || H < 0 || D < 1)
        return PT_DECLINE_SHAPE;
    if (!dtype_flag_ok(z_bf16))
        return PT_DECLINE_DTYPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            const float *restrict xv = x + r * x_r + h * x_h;
            int64_t zo = r * z_r + h * z_h, oo = (r * H + h) * D, next = r + 1 < R, zs = z_bf16 ? 2 : 4;
            prefetch_span(xv + next * x_r, D * 4);                /* the next row's x and z for this head (isa.h) */
            prefetch_span((const char *)z + (zo + next * z_r) * zs, D * zs);
            float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
            for (int64_t d = 0; d < D; d++)
                sq += xv[d] * xv[d];
            float inv = 1.0f / __builtin_sqrtf(sq / (float)D + eps);
            if (z_bf16) {
                const uint16_t *restrict zv = (const uint16_t *)z + zo;
                uint16_t *restrict o = (uint16_t *)out + oo;
                for (int64_t d = 0; d < D; d++)
                    o[d] = float_to_bf16(xv[d] * inv * w[d] * silu_f32(bf16_to_float(zv[d])));
            } else {
                const float *restrict zv = (const float *)z + zo;
                float *restrict o = (float *)out + oo;
                for (int64_t d = 0; d < D; d++)
                    o[d] = xv[d] * inv * w[d] * silu_f32(zv[d]);
            }
        }
    }
    return PT_OK;
}

/* The residual update and the next norm, in one pass over the residual stream (the decoder's RMSNorm, the ViT's
 * LayerNorm):
 *   h[t, :] += delta[t, :] (if delta is not NULL), then
 *   RMSNorm (layer_norm = 0):  out[t, :] = h / sqrt(mean(h^2) + eps) * w
 *   LayerNorm (layer_norm = 1): out[t, :] = (h - mean) / sqrt(mean((h - mean)^2) + eps) * w + b
 * h: float32 [T, D] contiguous, updated in place; delta: [T, D] with row stride delta_t (bf16 if delta_bf16);
 * w: float32 [D] (for the decoder, the zero-centred norm's 1 + weight); b: float32 [D] (LayerNorm only);
 * out: [T, D] contiguous, bf16 if out_bf16. */
PT_API int pt_add_norm(const pt_add_norm_args *a, void *out, int out_bf16, int nthreads) {
    float *h = a->h;
    const void *delta = a->delta;
    const float *w = a->w, *b = a->b;
    int64_t delta_t = a->delta_t, T = a->T, D = a->D;
    int delta_bf16 = a->delta_bf16, layer_norm = a->layer_norm;
    float eps = a->eps;
    if (T < 0 || D < 1)
        return PT_DECLINE_SHAPE;
    if (layer_norm && b == NULL)
        return PT_DECLINE_ARGUMENT;
    if (!dtype_flag_ok(delta_bf16) || !dtype_flag_ok(out_bf16))
        return PT_DECLINE_DTYPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *restrict hv = h + t * D;
        if (delta && delta_bf16) {
            const uint16_t *restrict dv = (const uint16_t *)delta + t * delta_t;
            for (int64_t d = 0; d < D; d++)
                hv[d] += bf16_to_float(dv[d]);
        } else if (delta) {
            const float *restrict dv = (const float *)delta + t * delta_t;
            for (int64_t d = 0; d < D; d++)
                hv[d] += dv[d];
        }
        float mean = 0.0f, sq = 0.0f;
        if (layer_norm) {
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++)
                sum += hv[d];
            mean = sum / (float)D;
        }
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < D; d++)
            sq += (hv[d] - mean) * (hv[d] - mean);
        float inv = 1.0f / __builtin_sqrtf(sq / (float)D + eps);
        if (out_bf16) {                     /* in float32 a block at a time (vectorised), then rounded 32 at a time */
            uint16_t *restrict o = (uint16_t *)out + t * D;
            float r[256];
            for (int64_t d0 = 0; d0 < D; d0 += 256) {
                int64_t n = D - d0 < 256 ? D - d0 : 256;
                if (layer_norm)
                    for (int64_t d = 0; d < n; d++)
                        r[d] = (hv[d0 + d] - mean) * inv * w[d0 + d] + b[d0 + d];
                else
                    for (int64_t d = 0; d < n; d++)
                        r[d] = hv[d0 + d] * inv * w[d0 + d];
                bf16_row(r, o + d0, n);
            }
        } else if (layer_norm) {
            float *restrict o = (float *)out + t * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = (hv[d] - mean) * inv * w[d] + b[d];
        } else {
            float *restrict o = (float *)out + t * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = hv[d] * inv * w[d];
        }
    }
    return PT_OK;
}

/* The two exponential passes with exp's polynomial in fused multiply-adds (outside these regions GCC in ISO C mode
 * contracts nothing). AVX2 EPYC, 2 threads, 21 interleaved pairs: pt_silu_mul on bench-small's float32 [2296,
 * 2 x 3072] 0.86x its time (bf16 0.87x, the same bits), pt_gelu_tanh on the ViT's [4000, 2048] 0.82x; float32
 * outputs within 3.2e-8 of the unfused ones. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif
/* SwiGLU's product: out[t, i] = silu(gu[t, i]) * gu[t, I + i], in float32, rounded once if out_bf16.
 * gu: [T, 2I] with row stride gu_t (bf16 if gu_bf16); out: [T, I] contiguous, same dtype as gu. */
PT_API int pt_silu_mul(const void *gu, int gu_bf16, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads) {
    if (T < 0 || I < 0)
        return PT_DECLINE_SHAPE;
    if (!dtype_flag_ok(gu_bf16))
        return PT_DECLINE_DTYPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        /* 64 values at a time, first asking for the next row's gate and up there (isa.h) */
        int64_t size = gu_bf16 ? 2 : 4, next = t + 1 < T ? gu_t * size : 0;
        const char *gb = (const char *)gu + t * gu_t * size, *ub = gb + I * size;
        for (int64_t i0 = 0; i0 < I; i0 += 64) {
            int64_t i1 = I - i0 < 64 ? I : i0 + 64;
            prefetch_span(gb + next + i0 * size, (i1 - i0) * size);
            prefetch_span(ub + next + i0 * size, (i1 - i0) * size);
            if (gu_bf16) {
                const uint16_t *restrict g = (const uint16_t *)gb, *restrict u = (const uint16_t *)ub;
                uint16_t *restrict o = (uint16_t *)out + t * I;
                for (int64_t i = i0; i < i1; i++)
                    o[i] = float_to_bf16(silu_f32(bf16_to_float(g[i])) * bf16_to_float(u[i]));
            } else {
                const float *restrict g = (const float *)gb, *restrict u = (const float *)ub;
                float *restrict o = (float *)out + t * I;
                for (int64_t i = i0; i < i1; i++)
                    o[i] = silu_f32(g[i]) * u[i];
            }
        }
    }
    return PT_OK;
}

/* tanh-approximated GELU in place, float32: x <- 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed
 * as x / (1 + e^(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + e^(-2u))), one exponential and one division a
 * value, where tanh's 1 + tanh(u) cancels for negative x. torch's float32 gelu(approximate="tanh") on the ViT's
 * [4000, 2048] took 22 ms at 2 threads on the AVX2 EPYC, its erf GELU 9.5 ms. x: n floats, contiguous. */
PT_API int pt_gelu_tanh(float *x, int64_t n, int nthreads) {
    if (n < 0)
        return PT_DECLINE_SHAPE;
    const int64_t block = 4096;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < n; b += block) {
        float *restrict p = x + b;
        int64_t m = n - b < block ? n - b : block;
        for (int64_t i = 0; i < m; i++) {
            float v = p[i], u2 = -1.5957691216057308f * (v + 0.044715f * v * v * v);     /* -2u */
            p[i] = v / (1.0f + exp_f32(u2));
        }
    }
    return PT_OK;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* Rotary on the first R features, in float32 and rounded once, optionally after a zero-centred RMSNorm (the
 * decoder attention's q and k; w NULL: none, the ViT's full-width rotary with R = D):
 *   y = x / sqrt(mean(x^2) + eps) * w (w: the norm's 1 + weight, float32 [D]), or y = x;
 *   out[:R/2] = y1 cos - y2 sin, out[R/2:R] = y2 cos + y1 sin (y1, y2 the halves of y[:R]; cos, sin float32 [N, R],
 *   their matching halves); out[R:] = y[R:].
 * x: [N, G, D] (bf16 if bf16) with strides (x_n, x_g, 1); out: [N, G, D] contiguous, x's dtype. */
PT_API int pt_rotary(const pt_rotary_args *a, void *out, int nthreads) {
    const void *x = a->x;
    const float *w = a->w, *cos = a->cos, *sin = a->sin;
    int64_t x_n = a->x_n, x_g = a->x_g, N = a->N, G = a->G, D = a->D, R = a->R;
    int bf16 = a->x_bf16;
    float eps = a->eps;
    if (N < 0 || G < 0 || D < 1 || D > 4096 || R < 0 || R > D || R % 2)
        return PT_DECLINE_SHAPE;
    if (!dtype_flag_ok(bf16))
        return PT_DECLINE_DTYPE;
    int64_t half = R / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float y[4096], r[4096];
        const float *restrict c = cos + n * R, *restrict s = sin + n * R;
        for (int64_t g = 0; g < G; g++) {
            int64_t xo = n * x_n + g * x_g, oo = (n * G + g) * D, size = bf16 ? 2 : 4;
            if (n + 1 < N)                                                   /* the next row's (isa.h) */
                prefetch_span((const char *)x + (xo + x_n) * size, D * size);
            if (bf16)
                for (int64_t d = 0; d < D; d++)
                    y[d] = bf16_to_float(((const uint16_t *)x)[xo + d]);
            else
                memcpy(y, (const float *)x + xo, (size_t)D * sizeof(float));
            if (w) {
                float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
                for (int64_t d = 0; d < D; d++)
                    sq += y[d] * y[d];
                float inv = 1.0f / __builtin_sqrtf(sq / (float)D + eps);
                for (int64_t d = 0; d < D; d++)
                    y[d] = y[d] * inv * w[d];
            }
            if (bf16) {                     /* in float32 first (vectorised), then rounded 32 at a time */
                for (int64_t d = 0; d < half; d++) {
                    r[d] = y[d] * c[d] - y[d + half] * s[d];
                    r[d + half] = y[d + half] * c[d + half] + y[d] * s[d + half];
                }
                for (int64_t d = R; d < D; d++)
                    r[d] = y[d];
                bf16_row(r, (uint16_t *)out + oo, D);
            } else {
                float *restrict o = (float *)out + oo;
                for (int64_t d = 0; d < half; d++) {
                    o[d] = y[d] * c[d] - y[d + half] * s[d];
                    o[d + half] = y[d + half] * c[d + half] + y[d] * s[d + half];
                }
                for (int64_t d = R; d < D; d++)
                    o[d] = y[d];
            }
        }
    }
    return PT_OK;
}

/* ---- The delta rule's chunk matmuls --------------------------------------------------------------------------
 * Small dense products, [rows x d] x [d x cols] with cols a multiple of 16, as register-blocked outer products:
 * four rows by a block of columns are accumulated in registers over the shared dimension, in GCC/clang vector
 * extensions of the machine's own register width (`vr`): with AVX-512, four 16-float vectors per row (16
 * accumulators, 4 loads and 4 broadcasts per 16 FMAs); with AVX2's 16 registers, two 8-float ones. Written in
 * 16-float vectors everywhere, the AVX2 build kept its accumulators on the stack: the float32 pass of a bench-small
 * layer took 5.5x as long (908 against 165 ms, AMD EPYC, 2 threads; bit-identical outputs). */
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#define NUM_THREADS() omp_get_num_threads()
#else
#define THREAD_NUM() 0
#define NUM_THREADS() 1
#endif

typedef float vf16 __attribute__((vector_size(64), aligned(4), may_alias));   /* unaligned 16-float vector */
/* acc += a * b as one fused multiply-add (GCC in ISO C mode, -std=c11, contracts nothing by default; clang
 * contracts within an expression) */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif
#define VL 16

/* The machine's own vector register, for loops whose values must stay in registers: a vf16 is two AVX2 registers
 * or four SSE ones, and GCC keeps arrays of them on the stack when they outnumber the registers. */
#if defined(PT_VR_BYTES)               /* a test's build of another machine's width (tests/kernels: register_widths) */
#define VR_BYTES PT_VR_BYTES
#elif defined(__AVX512F__)
#define VR_BYTES 64
#elif defined(__AVX__)
#define VR_BYTES 32
#else
#define VR_BYTES 16
#endif
typedef float vr __attribute__((vector_size(VR_BYTES), aligned(4), may_alias));
#define VRL (VR_BYTES / 4)
/* mm4's widest column block: 4 rows x MM_COLS columns of accumulators fill half the vector registers (16 of
 * AVX-512's 32, 8 of AVX2's or SSE's 16), beside the row of b and the broadcast */
#define MM_COLS (VR_BYTES == 64 ? 4 * VRL : 2 * VRL)

/* GCC folds the row of b into each multiply-add as a memory operand, loading it again for every row of a (8 loads
 * and 4 broadcasts per 8 AVX2 multiply-adds); an empty asm that claims to change the vector keeps it in a register,
 * loaded once. The float32 delta pass of a bench-small layer: 0.91x (AMD EPYC, AVX2, 2 threads; bit-identical). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(PT_VR_BYTES)
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define KEEP_IN_REGISTER(x) ((void)0)
#endif

/* c[r, 0:VRL nr] = beta * c[r, :] + alpha * sum_{d < kd} a[r * lda + d] * b[d * ldb + 0:VRL nr]  for r < 4 when
 * load, else alpha * sum (c not read). nr in 1..4 (a literal at each call, so that acc[][] lives in registers). */
static inline __attribute__((always_inline)) void mm4(int nr, const float *a, int64_t lda, const float *b, int64_t ldb,
                                                      int64_t kd, float *c, int64_t ldc, float alpha, float beta,
                                                      int load) {
    vr acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < nr; j++)
            acc[r][j] = (vr){0};
    for (int64_t d = 0; d < kd; d++) {
        vr bv[4];
        for (int j = 0; j < nr; j++) {
            bv[j] = *(const vr *)(b + d * ldb + j * VRL);
            KEEP_IN_REGISTER(bv[j]);
        }
        for (int r = 0; r < 4; r++) {
            float ar = a[r * lda + d];                      /* scalar * vector: a broadcast */
            for (int j = 0; j < nr; j++)
                acc[r][j] += ar * bv[j];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < nr; j++) {
            vr *o = (vr *)(c + r * ldc + j * VRL);
            *o = load ? beta * *o + alpha * acc[r][j] : alpha * acc[r][j];
        }
}

/* mm4 over a row block's first `ncols` columns (a multiple of 16), MM_COLS at a time. */
static inline void mm4_cols(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kd, float *c,
                            int64_t ldc, int64_t ncols, float alpha, float beta, int load) {
    int64_t j = 0;
    for (; j + MM_COLS <= ncols; j += MM_COLS)
        mm4(MM_COLS / VRL, a, lda, b + j, ldb, kd, c + j, ldc, alpha, beta, load);
    switch ((ncols - j) / VRL) {                     /* AVX-512: 1 to 3 vectors left; else none (16 | ncols) */
    case 3: mm4(3, a, lda, b + j, ldb, kd, c + j, ldc, alpha, beta, load); break;
    case 2: mm4(2, a, lda, b + j, ldb, kd, c + j, ldc, alpha, beta, load); break;
    case 1: mm4(1, a, lda, b + j, ldb, kd, c + j, ldc, alpha, beta, load); break;
    default: break;
    }
}

/* exp(e) for a log decay e (<= 0 up to rounding), 0 below the cut-off (the torch path's `_decay`); NaN stays NaN. */
static inline float decay_exp(float e, float cutoff) { return e < cutoff ? 0.0f : exp_f32(e > 0.0f ? 0.0f : e); }

#define MAX_DELTA_CHUNK 256

static inline int64_t round16(int64_t n) { return (n + VL - 1) / VL * VL; }

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
    /* conv mode (taps != NULL): q, k and v are made here from the projection x [T, conv_dim] (bf16 if x_bf16, row
     * stride x_t) by the causal conv1d + SiLU, taps [W, conv_dim] float32; value head h reads key head h / group */
    const void *x;
    int x_bf16, W;
    int64_t x_t, conv_dim, group;
    const float *taps;
    /* NULL, or per thread [conv + SiLU seconds, the thread's whole pass seconds] added to (`delta_seconds`) */
    double *prof;
    /* conv mode: the SiLU to the accuracy of a bf16 consumer (`silu16_bf16`, the bf16 pass) instead of `silu16` */
    int silu_bf16;
} delta_args;

static inline double delta_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
static void NAME(const delta_args *a, int64_t t0, int64_t i, int64_t len, int64_t c0, int64_t n, float *out,       \
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

static void conv_silu_chunk(const delta_args *a, int64_t t0, int64_t len, int64_t seg0, int64_t c0, int64_t n,
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
                if (a->silu_bf16)
                    CONV_COLUMN_STEP(LOAD_ROW, silu16_bf16)
                else
                    CONV_COLUMN_STEP(LOAD_ROW, silu16)
#undef LOAD_ROW
#undef LOAD_ADDR
            } else {
                const float *xf = (const float *)a->x + c0;
#define LOAD_ROW(t, c) _mm512_loadu_ps(xf + (t) * a->x_t + (c))
#define LOAD_ADDR(t, c) xf[(t) * a->x_t + (c)]
                if (a->silu_bf16)
                    CONV_COLUMN_STEP(LOAD_ROW, silu16_bf16)
                else
                    CONV_COLUMN_STEP(LOAD_ROW, silu16)
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
    delta_args a = {.x = args->x, .x_bf16 = args->x_bf16, .W = args->W, .x_t = args->x_t, .conv_dim = C,
                    .taps = args->taps};                                                          /* the conv's */
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
    int64_t hk = a->taps ? h / a->group : h, nk = H / (a->taps ? a->group : 1);
    if (a->taps) {                         /* conv mode: the chunk's q, k and v into qm, kn and vbm, then in place */
        double start = a->prof ? delta_seconds() : 0.0;
        conv_silu_chunk(a, t0, len, seg0, hk * K, K, qm, ldk);
        conv_silu_chunk(a, t0, len, seg0, (nk + hk) * K, K, kn, ldk);
        conv_silu_chunk(a, t0, len, seg0, 2 * nk * K + h * V, V, vbm, ldv);
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
        if (a->taps) {
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
                    p->V, p->l2norm, p->eps, p->scale, p->cutoff, p->tiny, p->x, p->x_bf16, p->W, p->x_t,
                    p->conv_dim, p->group, p->taps, prof, silu_bf16};
    return a;
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

/* ---- The delta rule in bf16 on the matrix units ----------------------------------------------------------------
 * The same chunked rule as pt_delta_chunked for a bf16 forward, with its products as bf16 matmuls accumulated in
 * float32 (flash-linear-attention's numerics on a GPU): per chunk and head, kb k^T and q k^T, u = T vb and
 * w = T diag(exp(gamma)) kb with T rounded to bf16, v_new = u - w S, out = diag(exp(gamma) scale) q S + intra v_new
 * and S = chunk_decay S + k_end^T v_new, where every operand of a product is rounded to bf16 once and the state S,
 * u, v_new before its rounding, the decays, the UT inverse and every sum stay float32.
 * Products take A row-major [M, Kd] and B in the matrix units' pair-interleaved layout ("VNNI": row p holds
 * B[2p, n], B[2p + 1, n] for each n, 2N bf16), and run on one of three engines: AMX tiles, AVX512-BF16 dot
 * products, or plain float32 multiply-adds of the same bf16 operands (any machine; the tests' reference for the
 * other two, equal up to the order of float32 sums). M, N and Kd are multiples of 32. */
#if defined(PT_AMX) && !defined(PT_ISA_EMULATION)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define ENGINE_FMA PT_ENGINE_FMA
#define ENGINE_AVX512_BF16 PT_ENGINE_AVX512_BF16
#define ENGINE_AMX PT_ENGINE_AMX

/* Which engines this build has: bit e set for engine e; AMX only once Linux has granted this process the tile
 * state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA: asked at each call, a no-op after the first grant). */
static int bf16_engines(void) {
    int engines = 1 << ENGINE_FMA;
#ifdef PT_AVX512BF16
    engines |= 1 << ENGINE_AVX512_BF16;
#endif
#if defined(PT_AMX) && defined(PT_ISA_EMULATION)
    engines |= 1 << ENGINE_AMX;                       /* isa_emulation.h's tiles: no kernel state to ask for */
#elif defined(PT_AMX)
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0)
        engines |= 1 << ENGINE_AMX;
#endif
    return engines;
}

PT_API int pt_bf16_engines(int *engines) {
    *engines = bf16_engines();
    return PT_OK;
}

PT_API int pt_build_features(uint64_t *features) {
    uint64_t f = 0;
#ifdef __AVX2__
    f |= PT_FEATURE_AVX2;
#endif
#ifdef __FMA__
    f |= PT_FEATURE_FMA;
#endif
#ifdef PT_AVX512F
    f |= PT_FEATURE_AVX512F;
#endif
#ifdef PT_AVX512BW
    f |= PT_FEATURE_AVX512BW;
#endif
#ifdef PT_AVX512VL
    f |= PT_FEATURE_AVX512VL;
#endif
#ifdef PT_AVX512BF16
    f |= PT_FEATURE_AVX512BF16;
#endif
#ifdef PT_AMX
    f |= PT_FEATURE_AMX;
#endif
#ifdef PT_ISA_EMULATION
    f |= PT_FEATURE_EMULATED;
#endif
    *features = f;
    return PT_OK;
}

/* Where `engine` names a bf16 engine this build runs */
static inline int engine_ok(int engine) {
    return engine >= ENGINE_FMA && engine <= ENGINE_AMX && (bf16_engines() & (1 << engine));
}

typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4), may_alias));

static inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

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
static void mm_bf16_vec(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
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
static void mm_bf16_dp(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
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
static void amx_configure(void) {
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
static void mm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
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

static void mm_bf16(int engine, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t M, int64_t N, int64_t Kd,
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
static void to_bf16_rows_ref(const float *src, int64_t lds, int64_t R, int64_t N, const float *rowscale,
                             uint16_t *dst, int64_t ldd) {
    for (int64_t r = 0; r < R; r++) {
        float s = rowscale ? rowscale[r] : 1.0f;
        for (int64_t n = 0; n < N; n++)
            dst[r * ldd + n] = float_to_bf16(src[r * lds + n] * s);
    }
}

/* The pair-interleaved layout of B = src[R, N] (float32, row stride lds; R even):
 * dst[p, 2n + e] = bf16(B[2p + e, n]) */
static void pack_pairs_ref(const float *src, int64_t lds, int64_t R, int64_t N, uint16_t *dst) {
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
static void pack_pairs_t_ref(const float *src, int64_t lds, int64_t N, int64_t R, uint16_t *dst) {
    for (int64_t n = 0; n < N; n++) {
        const float *row = src + n * lds;
        for (int64_t p = 0; p < R / 2; p++) {
            dst[p * 2 * N + 2 * n] = float_to_bf16(row[2 * p]);
            dst[p * 2 * N + 2 * n + 1] = float_to_bf16(row[2 * p + 1]);
        }
    }
}

/* dst[R, N] bf16 (row stride ldd) = (src[N, R] float32 (row stride lds) * rowscale[n])^T: a row-major transpose */
static void to_bf16_t_ref(const float *src, int64_t lds, int64_t N, int64_t R, const float *rowscale, uint16_t *dst,
                          int64_t ldd) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < N; n++)
            dst[r * ldd + n] = float_to_bf16(src[n * lds + r] * rowscale[n]);
}

#ifdef PT_AVX512BF16
static void to_bf16_rows_fast(const float *src, int64_t lds, int64_t R, int64_t N, const float *rowscale,
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

static void pack_pairs_fast(const float *src, int64_t lds, int64_t R, int64_t N, uint16_t *dst) {
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
static void pack_pairs_t_fast(const float *src, int64_t lds, int64_t N, int64_t R, uint16_t *dst) {
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
static void to_bf16_t_fast(const float *src, int64_t lds, int64_t N, int64_t R, const float *rowscale, uint16_t *dst,
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

/* The packers for the tests: PT_PACK_ROWS to_bf16_rows (rowscale = scale if given), PT_PACK_PAIRS pack_pairs,
 * PT_PACK_PAIRS_T pack_pairs_t, PT_PACK_ROWS_T to_bf16_t (rowscale = scale, required), of src [R, N] float32
 * contiguous (for the last two, src is [N, R]) into dst (the layout's R * N bf16), the vector packer if fast and this
 * build has it, else the reference. */
PT_API int pt_bf16_pack(int which, int fast, const float *src, int64_t R, int64_t N, const float *scale,
                        uint16_t *dst) {
    if (which < PT_PACK_ROWS || which > PT_PACK_ROWS_T || (which == PT_PACK_ROWS_T && !scale))
        return PT_DECLINE_ARGUMENT;
    if (R < 0 || N < 0)
        return PT_DECLINE_SHAPE;
    if (fast && !PT_FAST_PACK)
        return PT_DECLINE_ISA;
    switch (which * 2 + (fast != 0)) {
    case 0: to_bf16_rows_ref(src, N, R, N, scale, dst, N); break;
    case 1: to_bf16_rows(src, N, R, N, scale, dst, N); break;
    case 2: pack_pairs_ref(src, N, R, N, dst); break;
    case 3: pack_pairs(src, N, R, N, dst); break;
    case 4: pack_pairs_t_ref(src, R, N, R, dst); break;
    case 5: pack_pairs_t(src, R, N, R, dst); break;
    case 6: to_bf16_t_ref(src, R, N, R, scale, dst, N); break;
    default: to_bf16_t(src, R, N, R, scale, dst, N); break;
    }
    return PT_OK;
}

/* Per-thread scratch of the bf16 pass, in floats, for K and V the head dims padded to multiples of 32 (zero
 * columns, which change no product; the caller zeroes the scratch once and nothing writes the padding after):
 * float32 q, kb, k, w (4 C K), vb, u, the output before its copy when V was padded (3 C V), the decay matrix,
 * kb k^T (then T), q k^T (3 C^2); bf16 (half a float each): q, kb, k^T and kb paired, w, k_end^T (6 C K), intra,
 * T, T diag(exp(gamma)) (3 C^2), vb and v_new paired (2 C V), the state paired (K V); each of the 22 arrays
 * rounded up to 64 floats (256 bytes). */
#define MAX_DELTA_HEAD 512              /* the bf16 pass's widest head (its per-thread scratch grows with K V) */
#define DELTA_BF16_SCRATCH(C, K, V) \
    (4 * (C) * (K) + 3 * (C) * (V) + 3 * (C) * (C) + (6 * (C) * (K) + 3 * (C) * (C) + 2 * (C) * (V) + (K) * (V)) / 2 \
     + 24 * 64)

/* DELTA_BF16_SCRATCH for head dims K and V (padded here): what the caller allocates per thread */
PT_API int pt_delta_chunked_bf16_scratch(int64_t C, int64_t K, int64_t V, int64_t *floats) {
    *floats = DELTA_BF16_SCRATCH(C, round32(K), round32(V));
    return PT_OK;
}

/* scratch taken in 64-float (256-byte) pieces from a thread's block, in floats and in bf16 */
#define TAKE_F32(at, n) ((at) += ((n) + 63) / 64 * 64, (at) - ((n) + 63) / 64 * 64)
#define TAKE_BF16(at, n) ((uint16_t *)TAKE_F32(at, ((n) + 1) / 2))

/* One chunk of one head in bf16 (see pt_delta_chunked_bf16): S is the head's float32 state, updated; o the chunk's
 * first output row for this head, rows ldo apart. */
static void delta_chunk_bf16(const delta_args *a, int engine, int64_t t0, int64_t len, int64_t seg0, int64_t h,
                             const float *g, float *S, float *out, int64_t ldo, float *scratch) {
    int64_t C = a->C, K = round32(a->K), V = round32(a->V);          /* the padded head dims */
    float scale = a->scale, cutoff = a->cutoff, tiny = a->tiny;
    float *at = scratch;
    float *qm = TAKE_F32(at, C * K), *kbm = TAKE_F32(at, C * K), *vbm = TAKE_F32(at, C * V);
    float *kn = TAKE_F32(at, C * K), *dec = TAKE_F32(at, C * C), *t = TAKE_F32(at, C * C);
    float *qk = TAKE_F32(at, C * C), *u = TAKE_F32(at, C * V), *wf = TAKE_F32(at, C * K);
    float *o = V == a->V ? out : TAKE_F32(at, C * V);
    uint16_t *qb = TAKE_BF16(at, C * K), *kbb = TAKE_BF16(at, C * K), *ktp = TAKE_BF16(at, C * K);
    uint16_t *kbp = TAKE_BF16(at, C * K), *wb = TAKE_BF16(at, C * K), *kendt = TAKE_BF16(at, C * K);
    uint16_t *intra = TAKE_BF16(at, C * C), *tb = TAKE_BF16(at, C * C), *twb = TAKE_BF16(at, C * C);
    uint16_t *vbp = TAKE_BF16(at, C * V), *vnp = TAKE_BF16(at, C * V), *sp = TAKE_BF16(at, K * V);
    delta_gather_rows(a, t0, len, seg0, h, qm, kbm, vbm, kn, K, V);
    /* qscale zeroed past C, which is all the products read: GCC cannot see that and warns without AVX512-BF16 */
    float gexp[MAX_DELTA_CHUNK], kend[MAX_DELTA_CHUNK], qscale[MAX_DELTA_CHUNK] = {0};
    chunk_decays(g, C, cutoff, gexp, kend, dec);
    for (int64_t i = 0; i < C; i++)
        qscale[i] = gexp[i] * scale;
    /* kb k^T and q k^T */
    to_bf16_rows(qm, K, C, K, NULL, qb, K);
    to_bf16_rows(kbm, K, C, K, NULL, kbb, K);
    pack_pairs_t(kn, K, C, K, ktp);
    mm_bf16(engine, kbb, K, ktp, C, C, K, t, C, 0, NULL, 0);
    mm_bf16(engine, qb, K, ktp, C, C, K, qk, C, 0, NULL, 0);
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < C; j++)
            qk[i * C + j] = j <= i ? qk[i * C + j] * (dec[i * C + j] * scale) : 0.0f;
    to_bf16_rows(qk, C, C, C, NULL, intra, C);
    /* T = (I + strictly_lower(kb k^T * decay))^-1 in float32, then its two bf16 copies */
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < i; j++)
            dec[i * C + j] *= t[i * C + j];
    ut_inverse(t, dec, C, tiny);
    to_bf16_rows(t, C, C, C, NULL, tb, C);
    for (int64_t i = 0; i < C; i++)                                  /* t is not read after its two copies */
        for (int64_t j = 0; j < C; j++)
            t[i * C + j] *= -gexp[j];
    to_bf16_rows(t, C, C, C, NULL, twb, C);
    /* u = T vb; -w = T diag(-exp(gamma)) kb (the sign exact in every rounding) for v_new = u + (-w) S */
    pack_pairs(vbm, V, C, V, vbp);
    pack_pairs(kbm, K, C, K, kbp);
    mm_bf16(engine, tb, C, vbp, C, V, C, u, V, 0, NULL, 1);
    mm_bf16(engine, twb, C, kbp, C, K, C, wf, K, 0, NULL, 1);
    to_bf16_rows(wf, K, C, K, NULL, wb, K);
    to_bf16_t(kn, K, C, K, kend, kendt, C);                          /* k_end^T: k decayed to the chunk's end */
    /* the recurrence: v_new = u - w S; out = diag(exp(gamma) scale) q S + intra v_new; S = decay S + k_end^T v_new */
    pack_pairs(S, V, K, V, sp);
    mm_bf16(engine, wb, K, sp, C, V, K, u, V, 1, NULL, 0);
    pack_pairs(u, V, C, V, vnp);
    int64_t ld = o == out ? ldo : V;
    mm_bf16(engine, qb, K, sp, C, V, K, o, ld, 0, NULL, 0);
    mm_bf16(engine, intra, C, vnp, C, V, C, o, ld, 1, qscale, 1);   /* o = diag(qscale) o + intra v_new */
    if (o != out)                                                    /* the head's V of its padded columns */
        for (int64_t i = 0; i < C; i++)
            memcpy(out + i * ldo, o + i * V, (size_t)a->V * sizeof(float));
    float cd[MAX_DELTA_HEAD];                                        /* S's decay, one per row (0 * inf stays NaN) */
    for (int64_t i = 0; i < K; i++)
        cd[i] = gexp[C - 1];
    mm_bf16(engine, kendt, C, vnp, K, V, C, S, V, 1, cd, 0);
}

/* pt_delta_chunked's contract (conv mode or not) with its products in bf16 on `engine` (a bit of
 * pt_bf16_engines()), the conv's SiLU `silu16_bf16`; the state is [H, K32, V32] floats, with K32 and V32 the head
 * dims rounded up to multiples of 32; scratch holds scratch_floats floats per thread, at least
 * DELTA_BF16_SCRATCH(C, K32, V32), zeroed. C a multiple of 32. */
PT_API int pt_delta_chunked_bf16(const pt_delta_args *args, int engine, float *out, float *state, float *scratch,
                                 int64_t scratch_floats, double *prof, int nthreads) {
    int64_t N = args->N, H = args->H, C = args->C, K = args->K, V = args->V;
    const int64_t *chunk_start = args->chunk_start, *chunk_len = args->chunk_len, *seg_start = args->seg_start;
    const uint8_t *restart = args->restart;
    const float *gamma = args->gamma, *taps = args->taps;
    if (N < 0 || H < 0 || C < 32 || C % 32 || C > MAX_DELTA_CHUNK || K < 1 || V < 1 || K > MAX_DELTA_HEAD
        || V > MAX_DELTA_HEAD || !delta_conv_ok(taps, args->W, args->group, H, K, V, args->conv_dim)
        || !delta_chunks_ok(N, C, chunk_start, chunk_len, taps, seg_start))
        return PT_DECLINE_SHAPE;
    if (scratch_floats < DELTA_BF16_SCRATCH(C, round32(K), round32(V)))
        return PT_DECLINE_WORKSPACE;
    if (!dtype_flag_ok(args->x_bf16))
        return PT_DECLINE_DTYPE;
    if (!engine_ok(engine))
        return PT_DECLINE_ISA;
    delta_args a = delta_args_of(args, prof, 1);
#pragma omp parallel num_threads(nthreads)
    {
        double start = prof ? delta_seconds() : 0.0;
        int tid = THREAD_NUM(), nth = NUM_THREADS();
        int64_t h0 = H * tid / nth, h1 = H * (tid + 1) / nth;      /* as pt_delta_chunked: a block of heads */
        float *mine = scratch + (int64_t)tid * scratch_floats;
        tiles_on(engine);
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = h0; h < h1; h++) {
                float *S = state + h * round32(K) * round32(V);
                if (n == 0 || restart[n])
                    memset(S, 0, (size_t)(round32(K) * round32(V)) * sizeof(float));
                delta_chunk_bf16(&a, engine, chunk_start[n], chunk_len[n], taps ? seg_start[n] : 0, h,
                                 gamma + (n * H + h) * C, S, out + (n * C * H + h) * V, H * V, mine);
            }
        tiles_off(engine);
        if (prof)
            prof[2 * tid + 1] += delta_seconds() - start;
    }
    return PT_OK;
}

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
#define QUERY_BLOCK 64
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

/* ---- Attention within segments in float32 (any CPU): the vision tower's images and the decoder's questions -----
 * For each segment s (tokens seg_start[s] .. + seg_len[s]) and query head h, whose key/value head is h / (H / Hkv):
 * softmax attention, causal or not, QUERY_BLOCK query rows at a time, each block's scores materialised up to its
 * last key (64 rows of a 2304-token segment are 590 KB, in L2):
 *   S = Q K^T, e = 2^(c S - c rowmax) with c = scale log2(e), over the keys each row sees, O = e V / rowsum(e),
 * the products in mm4's register blocks with float32 sums. Each (key/value head, segment)'s K^T and V are packed
 * once in contiguous panels of ATT_COLS columns ([D, w] of K^T, [Lp, w] of V; w = ATT_COLS or the last panel's
 * rest), Lp = L rounded up to 16 with zero keys past L: kv_floats >= ATTENTION_F32_KV(Hkv, D, sum of the Lp). Each
 * product takes one panel over every 4-row group of the block, so the panel stays in L1; a causal group computes
 * only the panels up to its last row's key. Two schedules, the same blocks (so the same bits): with segments times
 * key/value heads at least ATTENTION_F32_TASKS_PER_THREAD per thread (the ViT's images), each (segment, key/value
 * head) is a task that packs its panels and runs its query heads' blocks while they are in cache (the ViT's
 * attention, 10 images of 400 patches, 8 heads of 64, 2 threads: 0.89x the time of packing every panel first);
 * otherwise (the decoder's few long questions) the panels are packed first, shared by the threads, and the query
 * blocks of a segment go to threads last (longest) first. q, k, v: float32 with strides (t, h, 1) in elements;
 * out: [T, H, D] contiguous. scratch holds ATTENTION_F32_SCRATCH(Lp, D) floats per thread for the longest segment.
 * D a multiple of 16 up to 512, H a multiple of Hkv. The output does not depend on the thread count. Returns 1 for
 * what it does not take. */
#define MAX_ATTENTION_F32 32768
/* Columns of a product's panel: 4 rows x 24 columns on AVX2 (12 of its 16 registers: the 16 columns of mm4's
 * MM_COLS left 8 accumulators, and the decoder's attention took 1.05x as long), MM_COLS elsewhere */
#define ATT_COLS (VR_BYTES == 32 ? 3 * VRL : MM_COLS)

/* c[0:4, 0:w] = a b over kd, for one panel of w (<= ATT_COLS, a multiple of VRL) columns */
static inline void att_cols(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kd, float *c,
                            int64_t ldc, int64_t w) {
    switch (w / VRL) {
    case 4: mm4(4, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    case 3: mm4(3, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    case 2: mm4(2, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    default: mm4(1, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    }
}
#define ATTENTION_F32_KV(Hkv, D, sumLp) (2 * (Hkv) * (D) * (sumLp))
#define ATTENTION_F32_SCRATCH(L, D) (QUERY_BLOCK * (L) + 2 * QUERY_BLOCK * (D) + QUERY_BLOCK + 4 * 64)

/* 2^y for the softmax's y <= 0 (NaN in: NaN out): 2^n 2^f, n = round(y), f in [-1/2, 1/2] through Cephes' exp2f
 * polynomial (relative error <= 8.0e-8 at every float in [-126, 0], checked against libm's exp2 in double), y
 * clamped at -126 (2^-126, float's least normal, stands for the smaller values beside a sum >= 1). n comes from the
 * bits of y + 1.5 2^23 (no float-to-int conversion): one select, no branch, so the softmax's loop vectorises;
 * exp_f32's two clamps and NaN select took a seventh of the ViT's attention on AVX2 (0.86x with this one). */
static inline float exp2_softmax(float y) {
    y = y < -126.0f ? -126.0f : y;
    float t = y + 12582912.0f, n = t - 12582912.0f, f = y - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23;             /* round(y) + 127 into the exponent field */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

PT_API int pt_attention_f32_scratch(int64_t longest, int64_t D, int64_t *floats) {
    *floats = ATTENTION_F32_SCRATCH(round16(longest), D);
    return PT_OK;
}

/* x[0:VRL] as the rows of a VRL x VRL matrix, transposed in place: the rounds above, in GCC's generic vectors at
 * this build's register width */
typedef int32_t vrm __attribute__((vector_size(VR_BYTES)));
#define ROUND_VR(s, lo, hi) TRANSPOSE_ROUND(x, VRL, vr, vrm, s, lo, hi)
static inline __attribute__((always_inline)) void transpose_vr(vr x[VRL]) {
#if VRL == 16
    TRANSPOSE_ROUNDS(16, ROUND_VR)
#elif VRL == 8
    TRANSPOSE_ROUNDS(8, ROUND_VR)
#else
    TRANSPOSE_ROUNDS(4, ROUND_VR)
#endif
}
#undef ROUND_VR

/* One 16-key block of one (key/value head, segment): keys n0 .. n0 + 16 (zeros from L) into the K^T and V panels.
 * K^T by VRL x VRL transposes (VRL keys never straddle a panel: ATT_COLS and n0 are multiples of VRL); the scalar
 * loop it replaced (row d of the panel, the keys' element d, one at a time) took 13% of the ViT's attention (10
 * images of 400 patches, 8 heads of 64, 1 thread, AVX-512). */
static void attention_f32_pack(const float *k, int64_t k_t, const float *v, int64_t v_t, int64_t L, int64_t Lp,
                               int64_t D, int64_t n0, float *kt, float *vp) {
    for (int64_t n1 = n0; n1 < n0 + VL; n1 += VRL) {
        int64_t p = n1 / ATT_COLS * ATT_COLS, w = Lp - p < ATT_COLS ? Lp - p : ATT_COLS;
        float *dst = kt + p * D + (n1 - p);                  /* panel row d at dst + d w: the keys' element d */
        for (int64_t d0 = 0; d0 < D; d0 += VRL) {
            vr x[VRL];
            for (int64_t i = 0; i < VRL; i++)
                x[i] = n1 + i < L ? *(const vr *)(k + (n1 + i) * k_t + d0) : (vr){0};
            transpose_vr(x);
            for (int64_t j = 0; j < VRL; j++)
                *(vr *)(dst + (d0 + j) * w) = x[j];
        }
    }
    for (int64_t n = n0; n < n0 + VL; n++) {
        const float *vr_ = v + n * v_t;
        for (int64_t c = 0; c < D; c += ATT_COLS) {                                    /* V's panels */
            int64_t wv = D - c < ATT_COLS ? D - c : ATT_COLS;
            float *dst = vp + c * Lp + n * wv;
            for (int64_t j = 0; j < wv; j += VRL)
                *(vr *)(dst + j) = n < L ? *(const vr *)(vr_ + c + j) : (vr){0};
        }
    }
}

/* Query rows i0 .. i0 + QUERY_BLOCK (or to L) of head h of one segment (tokens t0 .. t0 + L, Lp = round16(L)), its
 * key/value head's K^T and V panels packed at kt and vp: out's rows, through the thread's scratch (qb, sf, of, inv). */
static inline __attribute__((always_inline)) void attention_f32_block(
    const float *q, int64_t q_t, int64_t q_h, int64_t H, int64_t D, int64_t t0, int64_t L, int64_t i0, int64_t h,
    int causal, float scale, const float *kt, const float *vp, float *qb, float *sf, float *of, float *inv,
    float *out) {
    int64_t Lp = round16(L), m = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK, mr = (m + 3) / 4 * 4;
    for (int64_t i = 0; i < mr; i++) {                       /* Q's rows, contiguous; zeros past m */
        for (int64_t c = 0; c < D; c += VRL)      /* vector moves: glibc's memcpy takes `rep movs` here */
            *(vr *)(qb + i * D + c) = i < m ? *(const vr *)(q + (t0 + i0 + i) * q_t + h * q_h + c) : (vr){0};
    }
    /* the keys row group r (rows i0 + r .. + 3) reads: all L, or up to its last row's position */
#define KEYS(r) (causal ? (i0 + (r) + 4 < L ? i0 + (r) + 4 : L) : L)
    for (int64_t p = 0; p < Lp; p += ATT_COLS) {             /* S = Q K^T, a K^T panel at a time */
        int64_t w = Lp - p < ATT_COLS ? Lp - p : ATT_COLS;
        for (int64_t r = 0; r < mr; r += 4)
            if (p < KEYS(r))
                att_cols(qb + r * D, D, kt + p * D, w, D, sf + r * Lp + p, Lp, w);
    }
    for (int64_t i = 0; i < mr; i++) {                       /* softmax over the keys row i sees */
        int64_t seen = causal ? (i0 + i + 1 < L ? i0 + i + 1 : L) : L, kd = KEYS(i / 4 * 4);
        float *row = sf + i * Lp, mx = row[0], sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 1; j < seen; j++)
            mx = row[j] > mx ? row[j] : mx;
        float c = scale * 1.44269504088896341f, cm = c * mx;      /* e^(scale (s - mx)) = 2^(c s - c mx) */
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < seen; j++) {
            row[j] = exp2_softmax(c * row[j] - cm);
            sum += row[j];
        }
        for (int64_t j = seen; j < kd; j++)
            row[j] = 0.0f;
        inv[i] = 1.0f / sum;
    }
    for (int64_t c = 0; c < D; c += ATT_COLS) {              /* O = e V, a V panel at a time */
        int64_t w = D - c < ATT_COLS ? D - c : ATT_COLS;
        for (int64_t r = 0; r < mr; r += 4)
            att_cols(sf + r * Lp, Lp, vp + c * Lp, w, KEYS(r), of + r * D + c, D, w);
    }
#undef KEYS
    for (int64_t i = 0; i < m; i++) {
        float *o = out + (t0 + i0 + i) * H * D + h * D;
        for (int64_t c = 0; c < D; c++)
            o[c] = of[i * D + c] * inv[i];
    }
}

/* pt_attention_f32's per-(segment, key/value head) schedule from this many such tasks per thread (fewer would leave
 * threads idle at the end: the decoder's one question over two key/value heads) */
#define ATTENTION_F32_TASKS_PER_THREAD 4

PT_API int pt_attention_f32(const pt_attention_args *a, float *out, float *kv, int64_t kv_floats, float *scratch,
                            int64_t scratch_floats, int nthreads) {
    const float *q = a->q, *k = a->k, *v = a->v;
    int64_t q_t = a->q_t, q_h = a->q_h, k_t = a->k_t, k_h = a->k_h, v_t = a->v_t, v_h = a->v_h, H = a->H;
    int64_t Hkv = a->Hkv, D = a->D, nseg = a->nseg;
    const int64_t *seg_start = a->seg_start, *seg_len = a->seg_len;
    int causal = a->causal;
    float scale = a->scale;
    int64_t longest = longest_segment(seg_start, seg_len, nseg), Lmax = round16(longest), sumLp = 0, ntasks = 0;
    if (longest < 0 || H < 1 || Hkv < 1 || H % Hkv || D < VL || D % VL || D > 512 || longest > MAX_ATTENTION_F32)
        return PT_DECLINE_SHAPE;
    if (scratch_floats < ATTENTION_F32_SCRATCH(Lmax, D))
        return PT_DECLINE_WORKSPACE;
    for (int64_t s = 0; s < nseg; s++) {
        sumLp += round16(seg_len[s]);
        ntasks += (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    }
    if (kv_floats < ATTENTION_F32_KV(Hkv, D, sumLp))
        return PT_DECLINE_WORKSPACE;
    int64_t group = H / Hkv, nkb = sumLp / VL;
    int per_segment = nseg * Hkv >= ATTENTION_F32_TASKS_PER_THREAD * (int64_t)nthreads;
    float *vbase = kv + Hkv * D * sumLp;
#pragma omp parallel num_threads(nthreads)
    {
        float *at = scratch + (int64_t)THREAD_NUM() * scratch_floats;
        float *sf = TAKE_F32(at, QUERY_BLOCK * Lmax), *qb = TAKE_F32(at, QUERY_BLOCK * D);
        float *of = TAKE_F32(at, QUERY_BLOCK * D), *inv = TAKE_F32(at, QUERY_BLOCK);
        if (per_segment) {
            /* (segment, key/value head) tasks: its panels, then its query heads' blocks */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < nseg * Hkv; task++) {
                int64_t s = task / Hkv, hk = task % Hkv, off = 0;
                for (int64_t r = 0; r < s; r++)
                    off += round16(seg_len[r]);
                int64_t t0 = seg_start[s], L = seg_len[s], Lp = round16(L), base = hk * D * sumLp + D * off;
                for (int64_t n0 = 0; n0 < Lp; n0 += VL)
                    attention_f32_pack(k + t0 * k_t + hk * k_h, k_t, v + t0 * v_t + hk * v_h, v_t, L, Lp, D, n0,
                                       kv + base, vbase + base);
                for (int64_t h = hk * group; h < (hk + 1) * group; h++)
                    for (int64_t i0 = 0; i0 < L; i0 += QUERY_BLOCK)
                        attention_f32_block(q, q_t, q_h, H, D, t0, L, i0, h, causal, scale, kv + base, vbase + base,
                                            qb, sf, of, inv, out);
            }
        } else {
            /* K^T and V of every (key/value head, segment), 16 keys of every key/value head a task (a token's heads
             * are read together, rows rather than one head's strided slices; the loop's end is a barrier) */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nkb; b++) {
                int64_t s = 0, off = 0;
                while (b * VL >= off + round16(seg_len[s]))      /* the segment of key block b: at most nseg steps */
                    off += round16(seg_len[s++]);
                int64_t t0 = seg_start[s];
                for (int64_t hk = 0; hk < Hkv; hk++) {
                    int64_t base = hk * D * sumLp + D * off;
                    attention_f32_pack(k + t0 * k_t + hk * k_h, k_t, v + t0 * v_t + hk * v_h, v_t, seg_len[s],
                                       round16(seg_len[s]), D, b * VL - off, kv + base, vbase + base);
                }
            }
            /* query blocks: (segment, block from the segment's end, head) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < ntasks * H; task++) {
                int64_t h = task % H, blk = task / H, s = 0, off = 0;
                while (blk >= (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK) {
                    blk -= (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
                    off += round16(seg_len[s++]);
                }
                int64_t L = seg_len[s], hk = h / group, base = hk * D * sumLp + D * off;
                int64_t i0 = ((L + QUERY_BLOCK - 1) / QUERY_BLOCK - 1 - blk) * QUERY_BLOCK;
                attention_f32_block(q, q_t, q_h, H, D, seg_start[s], L, i0, h, causal, scale, kv + base,
                                    vbase + base, qb, sf, of, inv, out);
            }
        }
    }
    return PT_OK;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
