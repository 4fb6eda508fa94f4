/* The instruction sets behind the native sources' fast paths, as feature macros the sources test:
 *   PT_AVX512F, PT_AVX512BW, PT_AVX512VL, PT_AVX512BF16  the AVX-512 intrinsics they use;
 *   PT_AMX                                               the AMX tiles with bf16 products (Linux: the tile state is
 *                                                        asked of the kernel).
 * From the compiler's target (-march=native: what this CPU has), or, in a build with -DPT_ISA_EMULATION, all of
 * them from isa_emulation.h: the same intrinsics in portable C, so that the AVX-512 and AMX paths run, slowly, on any
 * CPU, for their tests (kernels.native: PIXELTRIAGE_NATIVE_ISA=emulated). */
#ifndef PT_ISA_H
#define PT_ISA_H

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

#endif
