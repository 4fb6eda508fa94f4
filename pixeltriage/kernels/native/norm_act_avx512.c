/* AVX-512 passes of the bf16 forward's SiLU-gated products (pixeltriage/kernels/simd.py has their story): SwiGLU's
 * silu(gate) * up, the Gated DeltaNet's output norm, the attention output gate. Without AVX512-F/BW/VL/BF16 every
 * function declines (PT_DECLINE_ISA). Contracts, Python references and tests: abi.h. */
#include <stdint.h>

#include "abi.h"
#include "isa.h"
#if defined(PT_AVX512F) && defined(PT_AVX512BW) && defined(PT_AVX512VL) && defined(PT_AVX512BF16)

#include "vec_math.h"

static inline __m512 load16(const uint16_t *p, __mmask16 m) { return widen_bf16x16(_mm256_maskz_loadu_epi16(m, p)); }

static inline void store16(uint16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: bf16 rows of stride gu_t, out: bf16 [T, I] contiguous */
PT_API int pt_simd_silu_mul(const void *gu, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads) {
    if (T < 0 || I < 0 || gu_t < 2 * I)
        return PT_DECLINE_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = (const uint16_t *)gu + t * gu_t, *u = g + I;
        uint16_t *o = (uint16_t *)out + t * I;
        int64_t next = t + 1 < T ? gu_t : 0;                       /* the next row's gate and up (isa.h) */
        for (int64_t i = 0; i < I; i += 16) {
            if (i % 32 == 0) {
                prefetch_line(g + next + i);
                prefetch_line(u + next + i);
            }
            __mmask16 m = lanes16(I - i);
            __m512 y = load16(g + i, m);
            store16(o + i, m, _mm512_mul_ps(silu16(y), load16(u + i, m)));
        }
    }
    return PT_OK;
}

/* The Gated DeltaNet's output norm, pt_rms_norm_gated's bf16 case:
 *   out[r, h, :] = x[r, h, :] / sqrt(mean(x[r, h, :]^2) + eps) * w * silu(z[r, h, :])
 * x: float32 [R, H, D] with strides (x_r, x_h, 1); z: bf16 with strides (z_r, z_h, 1); w: float32 [D];
 * out: bf16 [R, H * D] contiguous */
PT_API int pt_simd_rms_norm_gated(const pt_norm_gated_args *a, void *out, int nthreads) {
    const float *x = a->x, *w = a->w;
    const void *z = a->z;
    int64_t x_r = a->x_r, x_h = a->x_h, z_r = a->z_r, z_h = a->z_h, R = a->R, H = a->H, D = a->D;
    float eps = a->eps;
    if (R < 0 || H < 0 || D < 1)
        return PT_DECLINE_SHAPE;
    if (a->z_bf16 != 1)
        return PT_DECLINE_DTYPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            const float *xv = x + r * x_r + h * x_h;
            const uint16_t *zv = (const uint16_t *)z + r * z_r + h * z_h;
            uint16_t *o = (uint16_t *)out + (r * H + h) * D;
            int64_t next = r + 1 < R;                                  /* the next row's x and z (isa.h) */
            __m512 sq = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                prefetch_line(xv + next * x_r + d);
                if (d % 32 == 0)
                    prefetch_line(zv + next * z_r + d);
                __m512 v = _mm512_maskz_loadu_ps(lanes16(D - d), xv + d);
                sq = _mm512_fmadd_ps(v, v, sq);
            }
            __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(sq) / (float)D + eps));
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 m = lanes16(D - d);
                __m512 normed = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xv + d), inv),
                                              _mm512_maskz_loadu_ps(m, w + d));
                store16(o + d, m, _mm512_mul_ps(normed, silu16(load16(zv + d, m))));
            }
        }
    }
    return PT_OK;
}

/* float32 -> bf16 (round to nearest even) -> float32 */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* o[r, h, :] *= sigmoid(g[r, h, :]) in place: the gated attention's output gate, with the sigmoid rounded to bf16
 * before the product, as torch's bf16 sigmoid then multiply (and transformers) round it. o, g: bf16 [R, H, D] with
 * strides (o_r, o_h, 1) and (g_r, g_h, 1) */
PT_API int pt_simd_sigmoid_gate(const pt_gate_args *a, int nthreads) {
    void *o = a->o;
    const void *g = a->g;
    int64_t o_r = a->o_r, o_h = a->o_h, g_r = a->g_r, g_h = a->g_h, R = a->R, H = a->H, D = a->D;
    if (R < 0 || H < 0 || D < 0)
        return PT_DECLINE_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            uint16_t *ov = (uint16_t *)o + r * o_r + h * o_h;
            const uint16_t *gv = (const uint16_t *)g + r * g_r + h * g_h;
            int64_t next = r + 1 < R;                                  /* the next row's o and gate (isa.h) */
            for (int64_t d = 0; d < D; d += 16) {
                if (d % 32 == 0) {
                    prefetch_line(ov + next * o_r + d);
                    prefetch_line(gv + next * g_r + d);
                }
                __mmask16 m = lanes16(D - d);
                store16(ov + d, m, _mm512_mul_ps(load16(ov + d, m), round16(sigmoid16(load16(gv + d, m)))));
            }
        }
    }
    return PT_OK;
}
#else
PT_API int pt_simd_silu_mul(const void *gu, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads) {
    (void)gu, (void)gu_t, (void)T, (void)I, (void)out, (void)nthreads;
    return PT_DECLINE_ISA;
}
PT_API int pt_simd_rms_norm_gated(const pt_norm_gated_args *a, void *out, int nthreads) {
    (void)a, (void)out, (void)nthreads;
    return PT_DECLINE_ISA;
}
PT_API int pt_simd_sigmoid_gate(const pt_gate_args *a, int nthreads) {
    (void)a, (void)nthreads;
    return PT_DECLINE_ISA;
}
#endif
