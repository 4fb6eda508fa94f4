/* What a build has: the instruction sets it was compiled for and the bf16 engines it runs (abi.h's queries). */
#define _DEFAULT_SOURCE              /* syscall(), for the AMX permission */
#include "matmul_bf16.h"

#if defined(PT_AMX) && !defined(PT_ISA_EMULATION)
#include <sys/syscall.h>
#include <unistd.h>
#endif

int bf16_engine_bits(void) {
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
