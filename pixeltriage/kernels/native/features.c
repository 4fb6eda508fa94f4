/* What a build has and what this CPU runs: the instruction sets the build was compiled for, the bf16 engines it
 * runs, and the CPU's own instruction sets from CPUID (abi.h's queries). Alone, this file is also the probe library
 * kernels/native loads to choose a build (variants.py). */
#define _DEFAULT_SOURCE              /* syscall(), for the AMX permission */
#include "matmul_bf16.h"

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

/* Whether Linux grants this process the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; a no-op
 * after the first grant) */
static int amx_granted(void) {
#if defined(__linux__) && defined(__x86_64__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

int bf16_engine_bits(void) {
    int engines = 1 << ENGINE_FMA;
#ifdef PT_AVX512BF16
    engines |= 1 << ENGINE_AVX512_BF16;
#endif
#if defined(PT_AMX) && defined(PT_ISA_EMULATION)
    engines |= 1 << ENGINE_AMX;                       /* isa_emulation.h's tiles: no kernel state to ask for */
#elif defined(PT_AMX)
    if (amx_granted())
        engines |= 1 << ENGINE_AMX;
#endif
    return engines;
}

PT_API int pt_bf16_engines(int *engines) {
    *engines = bf16_engine_bits();
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
#ifdef __BMI__
    f |= PT_FEATURE_BMI1;
#endif
#ifdef __BMI2__
    f |= PT_FEATURE_BMI2;
#endif
#ifdef __F16C__
    f |= PT_FEATURE_F16C;
#endif
#ifdef __LZCNT__
    f |= PT_FEATURE_LZCNT;
#endif
#ifdef __MOVBE__
    f |= PT_FEATURE_MOVBE;
#endif
#ifdef PT_AVX512F
    f |= PT_FEATURE_AVX512F;
#endif
#ifdef PT_AVX512BW
    f |= PT_FEATURE_AVX512BW;
#endif
#ifdef __AVX512CD__
    f |= PT_FEATURE_AVX512CD;
#endif
#ifdef __AVX512DQ__
    f |= PT_FEATURE_AVX512DQ;
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

#if defined(__x86_64__) && defined(__GNUC__)
/* XCR0: the register state the OS saves (bits 1-2 SSE and AVX, 5-7 AVX-512, 17-18 AMX tiles) */
static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

/* CPUID's bits (Intel SDM vol. 2A, CPUID; AMD APM vol. 3), each counted only where the OS saves its registers */
static uint64_t cpuid_features(void) {
    unsigned a, b, c, d, max = __get_cpuid_max(0, 0);
    uint64_t f = 0;
    if (max < 1 || !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    uint64_t saved = c >> 27 & 1 ? xcr0() : 0;                    /* OSXSAVE: XGETBV is there to ask */
    int ymm = (saved & 0x6) == 0x6, zmm = ymm && (saved & 0xe0) == 0xe0, tiles = (saved & 0x60000) == 0x60000;
    if (ymm && c >> 12 & 1)
        f |= PT_FEATURE_FMA;
    if (c >> 22 & 1)
        f |= PT_FEATURE_MOVBE;
    if (ymm && c >> 29 & 1)
        f |= PT_FEATURE_F16C;
    if (__get_cpuid(0x80000001, &a, &b, &c, &d) && c >> 5 & 1)
        f |= PT_FEATURE_LZCNT;
    if (max < 7)
        return f;
    __cpuid_count(7, 0, a, b, c, d);
    unsigned leaf7_b = b, leaf7_d = d, leaf7_max = a;
    if (ymm && leaf7_b >> 5 & 1)
        f |= PT_FEATURE_AVX2;
    if (leaf7_b >> 3 & 1)
        f |= PT_FEATURE_BMI1;
    if (leaf7_b >> 8 & 1)
        f |= PT_FEATURE_BMI2;
    if (zmm) {
        f |= leaf7_b >> 16 & 1 ? PT_FEATURE_AVX512F : 0;
        f |= leaf7_b >> 17 & 1 ? PT_FEATURE_AVX512DQ : 0;
        f |= leaf7_b >> 28 & 1 ? PT_FEATURE_AVX512CD : 0;
        f |= leaf7_b >> 30 & 1 ? PT_FEATURE_AVX512BW : 0;
        f |= leaf7_b >> 31 & 1 ? PT_FEATURE_AVX512VL : 0;
        if (leaf7_max >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            f |= a >> 5 & 1 ? PT_FEATURE_AVX512BF16 : 0;
        }
    }
    if (tiles && leaf7_d >> 24 & 1 && leaf7_d >> 22 & 1 && amx_granted())      /* AMX-TILE, AMX-BF16 */
        f |= PT_FEATURE_AMX;
    return f;
}
#endif

PT_API int pt_cpu_features(uint64_t *features) {
#if defined(__x86_64__) && defined(__GNUC__)
    *features = cpuid_features();
#else
    *features = 0;
#endif
    return PT_OK;
}
