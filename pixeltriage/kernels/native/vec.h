/* What every kernel source shares: abi.h, the instruction sets (isa.h) and AVX-512 vector math (vec_math.h), the
 * scalar bf16 and float helpers, the lane transposes, the machine's vector register type (`vr`) and the per-thread
 * scratch carving. The first include of each source. */
#ifndef PT_VEC_H
#define PT_VEC_H

#include <stdint.h>
#include <string.h>

#include "abi.h"
#include "isa.h"
#ifdef PT_AVX512F
#include "vec_math.h"

/* 16 bf16 at p as float32 (exact: the top halves) */
static inline __m512 load_bf16x16(const uint16_t *p) { return widen_bf16x16(_mm256_loadu_si256((const __m256i *)p)); }
#endif

/* Code between PT_CONTRACT_BEGIN and PT_CONTRACT_END has its multiply-adds fused (GCC in ISO C mode, -std=c11,
 * contracts nothing by default; clang contracts within an expression). Where each region begins and ends is part
 * of the kernels' numerics: their outputs are compared to the bit across builds. */
#if defined(__GNUC__) && !defined(__clang__)
#define PT_CONTRACT_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=fast\")")
#define PT_CONTRACT_END _Pragma("GCC pop_options")
#else
#define PT_CONTRACT_BEGIN
#define PT_CONTRACT_END
#endif

/* A helper a source may leave unused (each source includes the headers of its family whole) */
#define PT_HELPER static __attribute__((unused))

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


/* SiLU, y / (1 + e^-y); 0 below y = -87, where e^-y leaves float's range (the true value is under 2e-36 there). */
static inline float silu_f32(float y) { return y < -87.0f ? 0.0f : y / (1.0f + exp_f32(-y)); }

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

#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#define NUM_THREADS() omp_get_num_threads()
#else
#define THREAD_NUM() 0
#define NUM_THREADS() 1
#endif

typedef float vf16 __attribute__((vector_size(64), aligned(4), may_alias));   /* unaligned 16-float vector */
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

static inline int64_t round16(int64_t n) { return (n + VL - 1) / VL * VL; }
static inline int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

/* scratch taken in 64-float (256-byte) pieces from a thread's block, in floats and in bf16 */
#define TAKE_F32(at, n) ((at) += ((n) + 63) / 64 * 64, (at) - ((n) + 63) / 64 * 64)
#define TAKE_BF16(at, n) ((uint16_t *)TAKE_F32(at, ((n) + 1) / 2))

#endif
