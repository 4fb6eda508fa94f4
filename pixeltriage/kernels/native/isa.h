/* The instruction sets behind the native sources' fast paths, as feature macros the sources test:
 *   PT_AVX512F, PT_AVX512BW, PT_AVX512VL, PT_AVX512BF16  the AVX-512 intrinsics they use;
 *   PT_AMX                                               the AMX tiles with bf16 products (Linux: the tile state is
 *                                                        asked of the kernel).
 * From the compiler's target (-march=native: what this CPU has), or, in a build with -DPT_ISA_EMULATION, all of
 * them from isa_emulation.h: the same intrinsics in portable C, so that the AVX-512 and AMX paths run, slowly, on any
 * CPU, for their tests (kernels.native: PIXELTRIAGE_NATIVE_ISA=emulated). */
#ifndef PT_ISA_H
#define PT_ISA_H

#include <stdint.h>

#ifdef PT_ISA_EMULATION
#include "isa_emulation.h"
#define PT_AVX512F 1
#define PT_AVX512BW 1
#define PT_AVX512VL 1
#define PT_AVX512BF16 1
#define PT_AMX 1
#else
#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AMX_TILE__))
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__AVX512F__)
#define PT_AVX512F 1
#endif
#if defined(__x86_64__) && defined(__AVX512BW__)
#define PT_AVX512BW 1
#endif
#if defined(__x86_64__) && defined(__AVX512VL__)
#define PT_AVX512VL 1
#endif
#if defined(__x86_64__) && defined(__AVX512BF16__)
#define PT_AVX512BF16 1
#endif
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PT_AMX 1
#endif
#endif

/* Ask for the cache line holding p, to read soon: the passes that stream rows ask for the next row's line at the
 * offset they are at, one line per 64 bytes as they go. This CPU's own prefetchers did not run ahead of such a
 * pass: bench-small's SwiGLU product, [2296, 2 x 3072] bf16 from memory, took 0.8-1.1 ns per output and thread
 * without and 0.31-0.40 with (0.37 either way with the rows in cache); a burst of the next row's lines at each
 * row's start, 0.50. No fault for any address; the callers stay inside their buffers all the same. */
static inline void prefetch_line(const void *p) { __builtin_prefetch(p, 0, 3); }

/* prefetch_line for each line [p, p + bytes) touches */
static inline void prefetch_span(const void *p, int64_t bytes) {
    const char *end = (const char *)p + bytes;
    for (const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63); line < end; line += 64)
        prefetch_line(line);
}

#endif
