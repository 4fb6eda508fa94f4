/* AVX-512F vector math shared by the native sources (through vec.h): e^x, 2^x, sigmoid and SiLU on 16
 * floats, bf16 widening and lane masks. Included inside each source's AVX-512 section, after isa.h (the CPU's
 * intrinsics, or isa_emulation.h's); kernels/native hashes it into every build's cache key with the source. */
#ifndef PT_VEC_MATH_H
#define PT_VEC_MATH_H

/* The first `left` of 16 lanes (all 16 from 16 on) */
static inline __mmask16 lanes16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* 16 bf16 (in a 256-bit register) as float32, exactly: each the top half of its float */
static inline __m512 widen_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x's range reduction: x = n ln2 + r with n = round(x / ln2) (into *n) and r in [-ln2/2, ln2/2] (returned), ln2
 * in two parts so that n ln2's high part is exact; e^x = 2^n e^r */
static inline __m512 exp_reduce16(__m512 x, __m512 *n) {
    *n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(0.693359375f), x);
    return _mm512_fnmadd_ps(*n, _mm512_set1_ps(-2.12194440e-4f), r);
}

/* e^x for x in [-87, 88] (clamped): 2^n * p(r), p Cephes' degree-6 expf polynomial; NaN in, a finite value out
 * (the callers multiply by the NaN input again). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n, r = exp_reduce16(x, &n);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 2^x for x <= 0 to the accuracy a bf16 result needs: 2^n * p(f), n = round(x), f = x - n in [-1/2, 1/2], p a
 * degree-4 polynomial fitted to 2^f for relative error (under 3e-6, against bf16's 2e-3 rounding step); 2^-126
 * below -126; NaN in, NaN out (the clamp returns its second operand, x, for a NaN). The softmax's exponential:
 * with the scale's log2(e) folded into its argument, its range reduction is one rounding and one subtraction. */
static inline __m512 exp2_16_bf16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(9.57003236e-3f), _mm512_set1_ps(5.59176579e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93121850e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999285e-1f));
    return _mm512_scalef_ps(p, n);
}

/* 1 / (1 + e): rcp14 and one Newton step (relative error ~2^-28) in place of a division */
static inline __m512 inv1p16(__m512 e) {
    __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f)), rc = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(rc, _mm512_fnmadd_ps(d, rc, _mm512_set1_ps(2.0f)));
}

/* 1 / (1 + e^-y) (`inv1p16`); finite for NaN y */
static inline __m512 inv1pexp16(__m512 y) { return inv1p16(exp16(_mm512_sub_ps(_mm512_setzero_ps(), y))); }

/* sigmoid(y) = 1 / (1 + e^-y); NaN in, NaN out */
static inline __m512 sigmoid16(__m512 y) {
    __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(inv1pexp16(y), nan, y);
}

/* silu(y) = y / (1 + e^-y); 0 below y = -87, as pt_silu_mul (the true value is under 2e-36 there), NaN kept (the
 * comparison is unordered-true) */
static inline __m512 silu16(__m512 y) {
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), y, inv1pexp16(y));
}

/* silu16 to the accuracy a bf16 consumer needs (relative error under 1e-5: exp2_16_bf16, then rcp14 and a Newton
 * step): 15 vector operations against silu16's 21; the bf16 delta pass's conv, whose q, k and v are rounded to bf16 */
static inline __m512 silu16_bf16(__m512 y) {
    __m512 rc = inv1p16(exp2_16_bf16(_mm512_mul_ps(y, _mm512_set1_ps(-1.44269504088896341f))));
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), y, rc);
}

#endif
