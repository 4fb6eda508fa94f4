/* The norms and activations between the matmuls, in scalar C the compiler vectorises (their AVX-512 twins:
 * norm_act_avx512.c): the residual update and next norm, the output norm, SwiGLU's product, GELU, rotary; and
 * vec_math.h's functions for their tests. Contracts, Python references and tests: abi.h. */
#include "vec.h"

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
PT_CONTRACT_BEGIN
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
PT_CONTRACT_END

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
