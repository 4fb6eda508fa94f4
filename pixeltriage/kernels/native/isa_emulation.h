/* The AVX-512 (F, BW, VL, BF16) and AMX-BF16 intrinsics the native sources use, in portable C (GCC/clang vector
 * extensions), for a build with -DPT_ISA_EMULATION (isa.h): the kernels' AVX-512 and AMX paths then run on any CPU,
 * so that their tests check them on machines without those units. Slow (lane loops; the tiles in thread-local
 * memory); never what a forward uses unless asked (PIXELTRIAGE_NATIVE_ISA=emulated).
 *
 * Each function follows Intel's description of its instruction, with these choices:
 * - bf16 products (vdpbf16ps, tdpbf16ps) read denormal inputs as zero, add each product to the float32 sum with one
 *   rounding (to nearest even) and flush a denormal sum to zero, in the pseudo-code's order: vdpbf16ps the odd pair
 *   element first, tdpbf16ps the even one. The hardware's own order of a tile row's sums is not specified further.
 * - the float to bf16 conversions (vcvtne(2)ps2bf16) round to nearest even, read denormals as zero, quiet NaNs.
 * - rcp14 is the exact reciprocal (the instruction's result is within 2^-14 of it; callers refine it).
 * - a tile used outside its configuration (rows, bytes per row, operands whose shapes do not match) traps, as the
 *   instruction faults.
 * Not included with <immintrin.h>: it defines the same names. */
#ifndef PT_ISA_EMULATION_H
#define PT_ISA_EMULATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"   /* 64-byte vectors passed between inline functions: no ABI to keep */
#endif

typedef float __m512 __attribute__((vector_size(64)));
typedef long long __m512i __attribute__((vector_size(64)));
typedef long long __m256i __attribute__((vector_size(32)));
typedef short __m512bh __attribute__((vector_size(64)));
typedef short __m256bh __attribute__((vector_size(32)));
typedef uint16_t __mmask16;
typedef uint32_t __mmask32;
typedef int32_t pt_v16si __attribute__((vector_size(64)));
typedef uint32_t pt_v16su __attribute__((vector_size(64)));
typedef uint16_t pt_v32hu __attribute__((vector_size(64)));
typedef uint16_t pt_v16hu __attribute__((vector_size(32)));

#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_TO_NEG_INF 0x01
#define _MM_FROUND_TO_POS_INF 0x02
#define _MM_FROUND_TO_ZERO 0x03
#define _MM_FROUND_CUR_DIRECTION 0x04
#define _MM_FROUND_NO_EXC 0x08

/* comparison predicates: bits 0-2 the relation, bit 3 the result for unordered operands flipped, bit 4 the
 * signalling variant (the same result) */
#define _CMP_EQ_OQ 0x00
#define _CMP_LT_OS 0x01
#define _CMP_LE_OS 0x02
#define _CMP_UNORD_Q 0x03
#define _CMP_NEQ_UQ 0x04
#define _CMP_NLT_US 0x05
#define _CMP_NLE_US 0x06
#define _CMP_ORD_Q 0x07
#define _CMP_EQ_UQ 0x08
#define _CMP_NGE_US 0x09
#define _CMP_NGT_US 0x0a
#define _CMP_FALSE_OQ 0x0b
#define _CMP_NEQ_OQ 0x0c
#define _CMP_GE_OS 0x0d
#define _CMP_GT_OS 0x0e
#define _CMP_TRUE_UQ 0x0f
#define _CMP_LT_OQ 0x11
#define _CMP_LE_OQ 0x12
#define _CMP_NLT_UQ 0x15
#define _CMP_NLE_UQ 0x16
#define _CMP_GE_OQ 0x1d
#define _CMP_GT_OQ 0x1e

static inline float pt_emu_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t pt_emu_float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* a denormal as a zero of its sign (DAZ on inputs, FTZ on results) */
static inline float pt_emu_flush(float x) {
    uint32_t u = pt_emu_float_bits(x);
    return (u & 0x7f800000u) ? x : pt_emu_bits_float(u & 0x80000000u);
}

static inline float pt_emu_bf16(uint16_t h) { return pt_emu_flush(pt_emu_bits_float((uint32_t)h << 16)); }

/* vcvtneps2bf16's rounding of one float */
static inline uint16_t pt_emu_to_bf16(float x) {
    uint32_t u = pt_emu_float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    if (!(u & 0x7f800000u))
        u &= 0x80000000u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- float32 lanes ---------------------------------------------------------------------------------------------- */
static inline __m512 _mm512_setzero_ps(void) { return (__m512){0}; }

static inline __m512 _mm512_set1_ps(float x) {
    __m512 r;
    for (int i = 0; i < 16; i++)
        r[i] = x;
    return r;
}

static inline __m512 _mm512_loadu_ps(const void *p) {
    __m512 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void _mm512_storeu_ps(void *p, __m512 a) { memcpy(p, &a, sizeof a); }

/* masked loads and stores touch only the lanes whose bit is set (the others may lie past an allocation) */
static inline __m512 _mm512_mask_loadu_ps(__m512 src, __mmask16 k, const void *p) {
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            src[i] = ((const float *)p)[i];
    return src;
}

static inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void *p) {
    return _mm512_mask_loadu_ps(_mm512_setzero_ps(), k, p);
}

static inline void _mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 a) {
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            ((float *)p)[i] = a[i];
}

static inline __m512 _mm512_add_ps(__m512 a, __m512 b) { return a + b; }
static inline __m512 _mm512_sub_ps(__m512 a, __m512 b) { return a - b; }
static inline __m512 _mm512_mul_ps(__m512 a, __m512 b) { return a * b; }

static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    __m512 r;
    for (int i = 0; i < 16; i++)
        r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}

static inline __m512 _mm512_fmsub_ps(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, -c); }
static inline __m512 _mm512_fnmadd_ps(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(-a, b, c); }

/* maxps / minps: the second operand where the comparison is false (a NaN in either, or two zeros) */
static inline float pt_emu_max(float a, float b) { return a > b ? a : b; }

static inline __m512 _mm512_max_ps(__m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++)
        r[i] = pt_emu_max(a[i], b[i]);
    return r;
}

static inline __m512 _mm512_min_ps(__m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++)
        r[i] = a[i] < b[i] ? a[i] : b[i];
    return r;
}

static inline __mmask16 _mm512_cmp_ps_mask(__m512 a, __m512 b, const int pred) {
    __mmask16 k = 0;
    for (int i = 0; i < 16; i++) {
        float x = a[i], y = b[i];
        int hit;
        if (x != x || y != y) {                    /* unordered: true for UNORD, NEQ, NLT, NLE; flipped by bit 3 */
            int base = pred & 7;
            hit = (base == 3 || base == 4 || base == 5 || base == 6) ^ (pred >> 3 & 1);
        } else {
            switch (pred & 7) {
            case 0: hit = x == y; break;
            case 1: hit = x < y; break;
            case 2: hit = x <= y; break;
            case 3: hit = 0; break;
            case 4: hit = x != y; break;
            case 5: hit = !(x < y); break;
            case 6: hit = !(x <= y); break;
            default: hit = 1; break;
            }
        }
        k |= (__mmask16)(hit << i);
    }
    return k;
}

static inline __m512 _mm512_mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            src[i] = a[i];
    return src;
}

static inline __m512 _mm512_maskz_mov_ps(__mmask16 k, __m512 a) { return _mm512_mask_mov_ps(_mm512_setzero_ps(), k, a); }

static inline __m512 _mm512_maskz_mul_ps(__mmask16 k, __m512 a, __m512 b) { return _mm512_maskz_mov_ps(k, a * b); }

/* vrndscaleps: a rounded to imm[7:4] fraction bits, by imm[1:0] (or the current mode where imm[2] is set) */
static inline __m512 _mm512_roundscale_ps(__m512 a, const int imm) {
    float scale = ldexpf(1.0f, imm >> 4 & 15);
    __m512 r;
    for (int i = 0; i < 16; i++) {
        float x = a[i] * scale;
        if (imm & 4)
            x = rintf(x);
        else
            switch (imm & 3) {
            case 0: x = rintf(x); break;                /* the default mode: to nearest even */
            case 1: x = floorf(x); break;
            case 2: x = ceilf(x); break;
            default: x = truncf(x); break;
            }
        r[i] = x / scale;
    }
    return r;
}

/* vscalefps: a * 2^floor(b), with its special cases (NaN in, NaN out; 0 * 2^inf and inf * 2^-inf NaN) */
static inline __m512 _mm512_scalef_ps(__m512 a, __m512 b) {
    __m512 r;
    for (int i = 0; i < 16; i++) {
        float x = a[i], y = b[i];
        if (x != x || y != y)
            r[i] = x + y;
        else if (isinf(y))
            r[i] = y > 0 ? (x == 0.0f ? NAN : x * INFINITY) : (isinf(x) ? NAN : x * 0.0f);
        else
            r[i] = ldexpf(x, (int)fmaxf(-400.0f, fminf(400.0f, floorf(y))));
    }
    return r;
}

static inline __m512 _mm512_rcp14_ps(__m512 a) { return 1.0f / a; }

/* the reductions in GCC's <immintrin.h> order: halves, then quarters, then pairs */
static inline float _mm512_reduce_add_ps(__m512 a) {
    float t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = a[i + 8] + a[i];
    for (int i = 0; i < 4; i++)
        u[i] = t[i + 4] + t[i];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

static inline float _mm512_reduce_max_ps(__m512 a) {
    float t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = pt_emu_max(a[i + 8], a[i]);
    for (int i = 0; i < 4; i++)
        u[i] = pt_emu_max(t[i + 4], t[i]);
    return pt_emu_max(pt_emu_max(u[0], u[2]), pt_emu_max(u[1], u[3]));
}

/* ---- integer lanes ---------------------------------------------------------------------------------------------- */
static inline __m512 _mm512_castsi512_ps(__m512i a) { return (__m512)a; }
static inline __m512i _mm512_castps_si512(__m512 a) { return (__m512i)a; }
static inline __m512i _mm512_and_si512(__m512i a, __m512i b) { return a & b; }

static inline __m512i _mm512_loadu_si512(const void *p) {
    __m512i r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void _mm512_storeu_si512(void *p, __m512i a) { memcpy(p, &a, sizeof a); }

static inline __m256i _mm256_loadu_si256(const void *p) {
    __m256i r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void _mm256_storeu_si256(void *p, __m256i a) { memcpy(p, &a, sizeof a); }

static inline __m256i _mm256_maskz_loadu_epi16(__mmask16 k, const void *p) {
    pt_v16hu r = {0};
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            r[i] = ((const uint16_t *)p)[i];
    return (__m256i)r;
}

static inline void _mm256_mask_storeu_epi16(void *p, __mmask16 k, __m256i a) {
    pt_v16hu h = (pt_v16hu)a;
    for (int i = 0; i < 16; i++)
        if (k >> i & 1)
            ((uint16_t *)p)[i] = h[i];
}

static inline __m512i _mm512_set1_epi32(int x) {
    pt_v16si r;
    for (int i = 0; i < 16; i++)
        r[i] = x;
    return (__m512i)r;
}

static inline __m512i _mm512_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7,
                                       int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
    return (__m512i)(pt_v16si){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}

static inline __m512i _mm512_mullo_epi32(__m512i a, __m512i b) { return (__m512i)((pt_v16su)a * (pt_v16su)b); }

static inline __m512i _mm512_slli_epi32(__m512i a, unsigned int n) {
    return n > 31 ? (__m512i){0} : (__m512i)((pt_v16su)a << n);
}

static inline __m512i _mm512_cvtepu16_epi32(__m256i a) {
    pt_v16hu h = (pt_v16hu)a;
    pt_v16su r = {0};
    for (int i = 0; i < 16; i++)
        r[i] = h[i];
    return (__m512i)r;
}

static inline __m512i _mm512_i32gather_epi32(__m512i index, const void *base, const int scale) {
    pt_v16si ix = (pt_v16si)index, r = {0};
    for (int i = 0; i < 16; i++)
        memcpy(&r[i], (const char *)base + (int64_t)ix[i] * scale, 4);
    return (__m512i)r;
}

static inline __m512 _mm512_i32gather_ps(__m512i index, const void *base, const int scale) {
    return (__m512)_mm512_i32gather_epi32(index, base, scale);
}

static inline __m512i _mm512_permutexvar_epi16(__m512i index, __m512i a) {
    pt_v32hu ix = (pt_v32hu)index, x = (pt_v32hu)a, r = {0};
    for (int i = 0; i < 32; i++)
        r[i] = x[ix[i] & 31];
    return (__m512i)r;
}

static inline __m512i _mm512_permutex2var_epi16(__m512i a, __m512i index, __m512i b) {
    pt_v32hu ix = (pt_v32hu)index, x = (pt_v32hu)a, y = (pt_v32hu)b, r = {0};
    for (int i = 0; i < 32; i++)
        r[i] = ix[i] & 32 ? y[ix[i] & 31] : x[ix[i] & 31];
    return (__m512i)r;
}

/* ---- bf16 ------------------------------------------------------------------------------------------------------- */
static inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
    pt_v16hu r = {0};
    for (int i = 0; i < 16; i++)
        r[i] = pt_emu_to_bf16(a[i]);
    return (__m256bh)r;
}

/* 32 bf16: b's 16 in the low half, a's in the high one */
static inline __m512bh _mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
    pt_v32hu r = {0};
    for (int i = 0; i < 16; i++) {
        r[i] = pt_emu_to_bf16(b[i]);
        r[i + 16] = pt_emu_to_bf16(a[i]);
    }
    return (__m512bh)r;
}

/* src[j] + a[2j + 1] b[2j + 1] + a[2j] b[2j], each product added with one rounding */
static inline __m512 _mm512_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
    pt_v32hu x = (pt_v32hu)a, y = (pt_v32hu)b;
    for (int j = 0; j < 16; j++) {
        float s = pt_emu_flush(src[j]);
        s = pt_emu_flush(fmaf(pt_emu_bf16(x[2 * j + 1]), pt_emu_bf16(y[2 * j + 1]), s));
        src[j] = pt_emu_flush(fmaf(pt_emu_bf16(x[2 * j]), pt_emu_bf16(y[2 * j]), s));
    }
    return src;
}

/* ---- AMX tiles: eight per thread, each up to 16 rows of 64 bytes, shaped by _tile_loadconfig ------------------- */
typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    unsigned char data[8][16 * 64];
} pt_emu_tiles;

static _Thread_local pt_emu_tiles pt_emu_tile;

static inline void pt_emu_tile_check(int ok) {
    if (!ok)
        __builtin_trap();
}

/* the 64-byte configuration: palette (byte 0; 1 the only one, 0 releases), bytes per row (16-bit words from byte
 * 16), rows (bytes from 48); tiles 8-15 are not in palette 1 */
static inline void _tile_loadconfig(const void *config) {
    const unsigned char *c = (const unsigned char *)config;
    memset(&pt_emu_tile, 0, sizeof pt_emu_tile);
    if (c[0] == 0)
        return;
    pt_emu_tile_check(c[0] == 1);
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, sizeof colsb);
        pt_emu_tile_check(colsb <= 64 && c[48 + t] <= 16 && colsb % 4 == 0);
        pt_emu_tile.colsb[t] = colsb;
        pt_emu_tile.rows[t] = c[48 + t];
    }
    pt_emu_tile.configured = 1;
}

static inline void _tile_release(void) { memset(&pt_emu_tile, 0, sizeof pt_emu_tile); }

static inline unsigned char *pt_emu_tile_data(int t) {
    pt_emu_tile_check(pt_emu_tile.configured && t >= 0 && t < 8 && pt_emu_tile.rows[t] > 0);
    return pt_emu_tile.data[t];
}

static inline void _tile_zero(int t) { memset(pt_emu_tile_data(t), 0, sizeof pt_emu_tile.data[0]); }

static inline void _tile_loadd(int t, const void *base, long stride) {
    unsigned char *d = pt_emu_tile_data(t);
    for (int r = 0; r < pt_emu_tile.rows[t]; r++)
        memcpy(d + r * 64, (const char *)base + r * stride, pt_emu_tile.colsb[t]);
}

static inline void _tile_stored(int t, void *base, long stride) {
    const unsigned char *d = pt_emu_tile_data(t);
    for (int r = 0; r < pt_emu_tile.rows[t]; r++)
        memcpy((char *)base + r * stride, d + r * 64, pt_emu_tile.colsb[t]);
}

/* c[m, n] += sum over k of a[m, 2k] b[k, 2n] + a[m, 2k + 1] b[k, 2n + 1] (a, b: bf16 pairs; c: float32) */
static inline void _tile_dpbf16ps(int c, int a, int b) {
    float *dst = (float *)pt_emu_tile_data(c);
    const uint16_t *x = (const uint16_t *)pt_emu_tile_data(a), *y = (const uint16_t *)pt_emu_tile_data(b);
    int M = pt_emu_tile.rows[c], N = pt_emu_tile.colsb[c] / 4, K = pt_emu_tile.colsb[a] / 4;
    pt_emu_tile_check(pt_emu_tile.rows[a] == M && pt_emu_tile.rows[b] == K && pt_emu_tile.colsb[b] == 4 * N);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++) {
                float s = pt_emu_flush(dst[m * 16 + n]);
                s = pt_emu_flush(fmaf(pt_emu_bf16(x[m * 32 + 2 * k]), pt_emu_bf16(y[k * 32 + 2 * n]), s));
                dst[m * 16 + n] = pt_emu_flush(fmaf(pt_emu_bf16(x[m * 32 + 2 * k + 1]), pt_emu_bf16(y[k * 32 + 2 * n + 1]), s));
            }
}

#endif
