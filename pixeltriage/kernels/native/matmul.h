/* The float32 products of the delta rule's chunks and the float32 attention (delta.c, attention.c).
 *
 * Small dense products, [rows x d] x [d x cols] with cols a multiple of 16, as register-blocked outer products:
 * four rows by a block of columns are accumulated in registers over the shared dimension, in GCC/clang vector
 * extensions of the machine's own register width (`vr`): with AVX-512, four 16-float vectors per row (16
 * accumulators, 4 loads and 4 broadcasts per 16 FMAs); with AVX2's 16 registers, two 8-float ones. Written in
 * 16-float vectors everywhere, the AVX2 build kept its accumulators on the stack: the float32 pass of a bench-small
 * layer took 5.5x as long (908 against 165 ms, AMD EPYC, 2 threads; bit-identical outputs). */
#ifndef PT_MATMUL_H
#define PT_MATMUL_H

#include "vec.h"

PT_CONTRACT_BEGIN
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
PT_CONTRACT_END

#endif
