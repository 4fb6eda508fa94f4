/* The C kernels' one ABI: every entry point the Python side calls, the argument structs of the long ones, the
 * codes they return and the enums their integer arguments take. kernels/native/abi.py reads this file to bind the
 * library with ctypes (so the Python side has no signature of its own) and writes the static checks every build
 * compiles beside the sources (each struct's size and field offsets as ctypes lays them out, each function's type
 * as it was read, each enum value), so that a header the reader misreads fails the build, never a forward.
 *
 * Written in the subset abi.py reads: `typedef enum { NAME = value, /+ key: text +/ ... } type;` (values literal or
 * `1 << n`); `typedef struct { type name; ... } type;` (scalars, pointers, and structs declared before); and
 * `PT_API int name(params);` with int, int64_t, uint32_t, uint64_t, float and double, pointers to them, to void,
 * uint8_t, uint16_t or a struct above. Above each function its comment ends in tags, one a line:
 *   reference: the Python function it is compared with (a dotted name, then notes)   (kernels)
 *   query:     what it answers                                                        (the rest)
 *   test:      the test that compares the two (tests/<file>.py::<name>; several separated by ", ")
 *   declines:  key (when), ... : the codes it returns besides PT_OK
 * (a tag runs on over the lines after it, up to the next).
 * Arrays are raw pointers into tensors whose last dimension is contiguous; strides are in elements. A kernel checks
 * its arguments before it writes anything: where it declines, its outputs are untouched and the caller runs its
 * Python path. Where the last parameter is `nthreads`, kernels.native.call passes torch's thread count. */
#ifndef PT_ABI_H
#define PT_ABI_H

#include <stdint.h>

#define PT_API __attribute__((visibility("default")))

/* What every entry point returns: PT_OK where it ran, else why it declined (kernels.native.decline_reason) */
typedef enum {
    PT_OK = 0,                  /* ran: the call's outputs are written */
    PT_DECLINE_SHAPE = 1,       /* shape: a size, stride, count or table entry outside what the kernel takes */
    PT_DECLINE_ISA = 2,         /* isa: a path this build has no instructions for (a bf16 engine, AVX-512) */
    PT_DECLINE_WORKSPACE = 3,   /* workspace: a scratch or output buffer smaller than the call needs */
    PT_DECLINE_ARGUMENT = 4,    /* argument: a selector out of range, or a pointer the call needs is NULL */
    PT_DECLINE_DTYPE = 5,       /* dtype: a dtype flag other than 0 (float32) and 1 (bfloat16) */
} pt_status;

/* The engines of the bf16 kernels' products (pt_delta_chunked_bf16, the bf16 attention) */
typedef enum {
    PT_ENGINE_FMA = 0,          /* fma: float32 multiply-adds of the bf16 operands, any CPU (the others' reference) */
    PT_ENGINE_AVX512_BF16 = 1,  /* avx512_bf16: AVX512-BF16 dot products */
    PT_ENGINE_AMX = 2,          /* amx: AMX tiles (Linux grants the process their state first) */
} pt_bf16_engine;

/* Instruction sets, as bits: those a build was compiled for (pt_build_features) and those this CPU runs
 * (pt_cpu_features); kernels/native/variants.py picks the build from the second */
typedef enum {
    PT_FEATURE_AVX2 = 1 << 0,        /* avx2: AVX2 */
    PT_FEATURE_FMA = 1 << 1,         /* fma: FMA3 */
    PT_FEATURE_BMI1 = 1 << 2,        /* bmi1: BMI1 */
    PT_FEATURE_BMI2 = 1 << 3,        /* bmi2: BMI2 */
    PT_FEATURE_F16C = 1 << 4,        /* f16c: half-precision conversions */
    PT_FEATURE_LZCNT = 1 << 5,       /* lzcnt: LZCNT */
    PT_FEATURE_MOVBE = 1 << 6,       /* movbe: MOVBE */
    PT_FEATURE_AVX512F = 1 << 7,     /* avx512f: AVX-512 foundation */
    PT_FEATURE_AVX512BW = 1 << 8,    /* avx512bw: AVX-512 byte and word */
    PT_FEATURE_AVX512CD = 1 << 9,    /* avx512cd: AVX-512 conflict detection */
    PT_FEATURE_AVX512DQ = 1 << 10,   /* avx512dq: AVX-512 doubleword and quadword */
    PT_FEATURE_AVX512VL = 1 << 11,   /* avx512vl: AVX-512 on 128- and 256-bit vectors */
    PT_FEATURE_AVX512BF16 = 1 << 12, /* avx512_bf16: AVX-512 bf16 conversions and dot products */
    PT_FEATURE_AMX = 1 << 13,        /* amx: AMX tiles with bf16 products (a CPU's: Linux granted the tile state) */
    PT_FEATURE_EMULATED = 1 << 14,   /* emulated: the AVX-512 and AMX paths in portable C (isa_emulation.h) */
} pt_feature;

/* vec_math.h's functions pt_vec_math evaluates */
typedef enum {
    PT_VEC_EXP = 0,             /* exp: e^x (exp16) */
    PT_VEC_EXP2_BF16 = 1,       /* exp2_bf16: 2^x for x <= 0 to a bf16 result's accuracy (exp2_16_bf16) */
    PT_VEC_SILU = 2,            /* silu: x / (1 + e^-x) (silu16) */
    PT_VEC_SILU_BF16 = 3,       /* silu_bf16: silu to a bf16 consumer's accuracy (silu16_bf16) */
} pt_vec_fn;

/* The bf16 pass's operand layouts pt_bf16_pack makes of a float32 matrix */
typedef enum {
    PT_PACK_ROWS = 0,           /* rows: src [R, N] -> [R, N], row r times scale[r] (scale NULL: 1) */
    PT_PACK_PAIRS = 1,          /* pairs: src [R, N] -> [R/2, 2N], out[p, 2n + e] = src[2p + e, n] */
    PT_PACK_PAIRS_T = 2,        /* pairs_t: src [N, R] -> [R/2, 2N], out[p, 2n + e] = src[n, 2p + e] */
    PT_PACK_ROWS_T = 3,         /* rows_t: src [N, R] -> [R, N], (src[n, :] * scale[n])^T (scale required) */
} pt_pack_layout;

/* pt_add_norm's inputs: h += delta, then RMSNorm (w) or LayerNorm (w, b) of h */
typedef struct {
    float *h;                   /* [T, D] float32 contiguous, updated in place */
    const void *delta;          /* NULL, or [T, D] with row stride delta_t (bf16 if delta_bf16) */
    int64_t delta_t;
    int delta_bf16;
    const float *w;             /* [D]; the decoder's zero-centred norm passes 1 + weight */
    const float *b;             /* [D] for LayerNorm, NULL for RMSNorm */
    int layer_norm;             /* 0 RMSNorm, 1 LayerNorm */
    int64_t T, D;
    float eps;
} pt_add_norm_args;

/* The Gated DeltaNet's output norm's inputs: x / sqrt(mean(x^2) + eps) * w * silu(z) over the last dim */
typedef struct {
    const float *x;             /* [R, H, D] float32, strides (x_r, x_h, 1) */
    int64_t x_r, x_h;
    const void *z;              /* [R, H, D] strides (z_r, z_h, 1), bf16 if z_bf16 (the output's dtype) */
    int64_t z_r, z_h;
    int z_bf16;
    const float *w;             /* [D] */
    int64_t R, H, D;
    float eps;
} pt_norm_gated_args;

/* pt_rotary's inputs: rotary on the first R of D features, after a zero-centred RMSNorm where w is given */
typedef struct {
    const void *x;              /* [N, G, D] strides (x_n, x_g, 1), bf16 if x_bf16 (the output's dtype) */
    int64_t x_n, x_g;
    int x_bf16;
    const float *w;             /* NULL, or [D]: the norm's 1 + weight */
    float eps;
    const float *cos, *sin;     /* [N, R] float32 */
    int64_t N, G, D, R;
} pt_rotary_args;

/* pt_causal_conv1d_silu's inputs: a depthwise causal conv1d over packed sequences, then SiLU */
typedef struct {
    const void *x;              /* [T, C] with row stride x_t, bf16 if x_bf16 */
    int64_t x_t;
    int x_bf16;
    const float *taps;          /* [W, C] float32 */
    int W;                      /* 1..16 */
    int64_t T, C;
    const int64_t *seg_start;   /* [T]: each row's first row of its sequence (earlier rows read as zeros) */
} pt_conv_args;

/* pt_chunk_gather's inputs: token-major rows into the delta rule's chunk layout, each scaled */
typedef struct {
    const float *src;           /* [T, H, D] float32, strides (src_t, src_h, 1) */
    int64_t src_t, src_h;
    int64_t T, H, D;
    const int64_t *row;         /* [T]: each token's row in the chunk layout */
    int64_t C;
    const float *mult, *mult2;  /* NULL (1), or [T, H] float32 contiguous */
    int l2norm;
    float eps;
} pt_gather_args;

/* The chunked gated delta rule's inputs (pt_delta_chunked, pt_delta_chunked_bf16): token-major q, k, v, or, in
 * conv mode (taps not NULL), the Gated DeltaNet's projection x through the causal conv1d + SiLU */
typedef struct {
    const float *q, *k, *v;     /* [T, H, K|V] float32, strides (x_t, x_h, 1); unused in conv mode */
    int64_t q_t, q_h, k_t, k_h, v_t, v_h;
    const float *beta;          /* [T, H] contiguous */
    const float *gamma;         /* [N, H, C]: the log decays cumulated from each chunk's start */
    const int64_t *chunk_start, *chunk_len;   /* [N]: chunk n holds tokens chunk_start[n] + i, i < chunk_len[n] */
    const uint8_t *restart;     /* [N]: the state restarts from zero at chunks where set */
    int64_t N, H, C, K, V;
    int l2norm;                 /* q and k L2-normalised (x / sqrt(sum x^2 + eps)) */
    float eps, scale, cutoff, tiny;
    const void *x;              /* conv mode: [T, conv_dim] = [q heads | k heads | v heads], row stride x_t */
    int64_t x_t;
    int x_bf16;
    const float *taps;          /* conv mode: [W, conv_dim] float32; NULL: q, k and v as given */
    int W;
    int64_t conv_dim, group;    /* value head h reads key head h / group */
    const int64_t *seg_start;   /* conv mode: [N], the first token of chunk n's packed sequence */
} pt_delta_args;

/* The attention kernels' inputs: softmax attention within segments of packed tokens */
typedef struct {
    const void *q, *k, *v;      /* [T, H|Hkv, D] strides (x_t, x_h, 1): float32 or bf16 as the kernel's name says */
    int64_t q_t, q_h, k_t, k_h, v_t, v_h;
    int64_t H, Hkv, D;          /* query head h reads key/value head h / (H / Hkv) */
    const int64_t *seg_start, *seg_len;   /* [nseg] */
    int64_t nseg;
    int causal;
    float scale;
} pt_attention_args;

/* pt_simd_sigmoid_gate's operands: o *= sigmoid(g), in place */
typedef struct {
    void *o;                    /* [R, H, D] bf16, strides (o_r, o_h, 1) */
    int64_t o_r, o_h;
    const void *g;              /* [R, H, D] bf16, strides (g_r, g_h, 1) */
    int64_t g_r, g_h;
    int64_t R, H, D;
} pt_gate_args;

/* ---- queries ----------------------------------------------------------------------------------------------- */

/* The instruction sets this build's code uses (pt_feature bits) into *features: the compiler's target, and the
 * AVX-512 and AMX paths isa.h enables (all of them, and PT_FEATURE_EMULATED, in the emulated build).
 * query: the build's instruction sets
 * test: tests/kernels/test_native.py::test_each_build_is_compiled_for_what_the_cpu_runs */
PT_API int pt_build_features(uint64_t *features);

/* The instruction sets this CPU runs (pt_feature bits) into *features, from CPUID and what the OS saves (XCR0):
 * the AVX and AVX-512 registers, and on Linux the AMX tile state once granted to the process (asked here, as
 * pt_bf16_engines does); 0 on other architectures.
 * query: this CPU's instruction sets
 * test: tests/kernels/test_native.py::test_cpu_features_agree_with_proc_cpuinfo */
PT_API int pt_cpu_features(uint64_t *features);

/* The bf16 engines this build runs (bit e for pt_bf16_engine e) into *engines; AMX only once Linux has granted the
 * process its tile state (asked here).
 * query: the bf16 engines
 * test: tests/kernels/test_gated_delta.py::test_bf16_engines_agree */
PT_API int pt_bf16_engines(int *engines);

/* The per-thread scratch, in floats, of pt_delta_chunked_bf16 for chunk C and head dims K, V into *floats.
 * query: pt_delta_chunked_bf16's scratch
 * test: tests/kernels/test_gated_delta.py::test_bf16_pass_matches_float32_pass_and_float64_recurrence */
PT_API int pt_delta_chunked_bf16_scratch(int64_t C, int64_t K, int64_t V, int64_t *floats);

/* The per-thread scratch, in floats, of pt_segment_attention_bf16 for its longest segment into *floats.
 * query: pt_segment_attention_bf16's scratch
 * test: tests/kernels/test_fast_paths.py::test_segment_attention_bf16_matches_masked_attention_and_sdpa */
PT_API int pt_segment_attention_scratch(int64_t longest, int64_t D, int64_t *floats);

/* The per-thread scratch (floats) and per key/value head K^T and V (bf16) of pt_causal_attention_bf16 for its
 * longest segment.
 * query: pt_causal_attention_bf16's scratch
 * test: tests/kernels/test_fast_paths.py::test_causal_attention_bf16_matches_masked_attention_and_sdpa */
PT_API int pt_causal_attention_scratch(int64_t longest, int64_t D, int64_t *floats, int64_t *kv_per_head);

/* The per-thread scratch, in floats, of pt_attention_f32 for its longest segment into *floats.
 * query: pt_attention_f32's scratch
 * test: tests/kernels/test_fast_paths.py::test_attention_f32_matches_float64_and_sdpa */
PT_API int pt_attention_f32_scratch(int64_t longest, int64_t D, int64_t *floats);

/* ---- norms and activations (norm_act.c, norm_act_avx512.c) --------------------------------------------------- */

/* The residual update and the next norm in one pass over the residual stream: out = norm(h += delta), out [T, D]
 * contiguous, bf16 if out_bf16.
 * reference: pixeltriage.kernels.norm.add_norm_torch
 * test: tests/kernels/test_fast_paths.py::test_add_rms_norm_matches_add_then_norm,
 *     tests/kernels/test_fast_paths.py::test_add_layer_norm_matches_add_then_layer_norm
 * declines: shape (T < 0, D < 1), argument (LayerNorm without b), dtype (delta_bf16 or out_bf16) */
PT_API int pt_add_norm(const pt_add_norm_args *a, void *out, int out_bf16, int nthreads);

/* The Gated DeltaNet's output norm; out [R, H * D] contiguous in z's dtype, rounded once from float32.
 * reference: pixeltriage.kernels.norm.rms_norm_gated_reference
 * test: tests/kernels/test_fast_paths.py::test_gated_rms_norm_matches_reference_and_leaves_its_inputs
 * declines: shape (R < 0, H < 0, D < 1), dtype (z_bf16) */
PT_API int pt_rms_norm_gated(const pt_norm_gated_args *a, void *out, int nthreads);

/* pt_rms_norm_gated's bf16 case in AVX-512 (z bf16, out bf16): float32 arithmetic rounded once.
 * reference: pixeltriage.kernels.norm.rms_norm_gated_reference
 * test: tests/kernels/test_fast_paths.py::test_vector_rms_norm_gated_matches_reference_and_the_c_kernel
 * declines: isa (no AVX512-F/BW/VL/BF16), shape (R < 0, H < 0, D < 1), dtype (z not bf16) */
PT_API int pt_simd_rms_norm_gated(const pt_norm_gated_args *a, void *out, int nthreads);

/* SwiGLU's product: out[t, i] = silu(gu[t, i]) * gu[t, I + i] in float32, rounded once if bf16; gu [T, 2I] with row
 * stride gu_t (bf16 if gu_bf16), out [T, I] contiguous in gu's dtype.
 * reference: pixeltriage.kernels.activation.silu_mul (native=False)
 * test: tests/kernels/test_fast_paths.py::test_silu_mul_matches_float64
 * declines: shape (T < 0, I < 0), dtype (gu_bf16) */
PT_API int pt_silu_mul(const void *gu, int gu_bf16, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads);

/* pt_silu_mul's bf16 case in AVX-512.
 * reference: pixeltriage.kernels.activation.silu_mul (native=False)
 * test: tests/kernels/test_fast_paths.py::test_vector_silu_mul_matches_float64_and_the_c_kernel
 * declines: isa (no AVX512-F/BW/VL/BF16), shape (T < 0, I < 0, gu_t < 2I) */
PT_API int pt_simd_silu_mul(const void *gu, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads);

/* The gated attention's output gate, o *= sigmoid(g) in bf16, the sigmoid rounded to bf16 before the product (as
 * torch's two ops round it).
 * reference: pixeltriage.kernels.activation.sigmoid_gate_ (vector=False)
 * test: tests/kernels/test_fast_paths.py::test_vector_sigmoid_gate_matches_float64_and_torch
 * declines: isa (no AVX512-F/BW/VL/BF16), shape (R, H or D < 0) */
PT_API int pt_simd_sigmoid_gate(const pt_gate_args *a, int nthreads);

/* tanh-approximated GELU in place on n contiguous floats, as x / (1 + e^(-2u)).
 * reference: pixeltriage.kernels.activation.gelu_tanh_ (native=False)
 * test: tests/kernels/test_fast_paths.py::test_gelu_tanh_in_place_matches_float64
 * declines: shape (n < 0) */
PT_API int pt_gelu_tanh(float *x, int64_t n, int nthreads);

/* Rotary on the first R features, optionally after the zero-centred RMSNorm; out [N, G, D] contiguous in x's dtype.
 * reference: pixeltriage.kernels.rotary.norm_partial_rotary (native=False),
 *     pixeltriage.kernels.rotary.apply_rotary_float_reference
 * test: tests/kernels/test_fast_paths.py::test_norm_partial_rotary_matches_float64,
 *     tests/kernels/test_fast_paths.py::test_rotary_matches_reference
 * declines: shape (N < 0, G < 0, D outside 1..4096, R odd or outside 0..D), dtype (x_bf16) */
PT_API int pt_rotary(const pt_rotary_args *a, void *out, int nthreads);

/* vec_math.h's AVX-512 function `which` (pt_vec_fn) on n floats, for the tests.
 * reference: torch.exp (float64; torch.exp2 and torch.nn.functional.silu for the others)
 * test: tests/kernels/test_native.py::test_vector_math_against_float64
 * declines: argument (which), shape (n < 0), isa (no AVX-512) */
PT_API int pt_vec_math(int which, const float *x, int64_t n, float *out);

/* ---- conv (conv.c) ----------------------------------------------------------------------------------------- */

/* Depthwise causal conv1d + SiLU over token-major rows; out [T, C] float32 contiguous.
 * reference: pixeltriage.kernels.conv.causal_conv1d_silu_reference
 * test: tests/kernels/test_native.py::test_native_conv_matches_reference_and_torch_path
 * declines: shape (W outside 1..16, T < 0, C < 0), dtype (x_bf16) */
PT_API int pt_causal_conv1d_silu(const pt_conv_args *a, float *out, int nthreads);

/* ---- the gated delta rule (delta.c, delta_bf16.c) ------------------------------------------------------------ */

/* Gather into the chunk layout: dst[row[t] / C][h][row[t] % C][:] = src[t][h][:] * s(t, h) * mult[t][h] (s the
 * L2 norm's reciprocal if l2norm, else 1), dst2 (if not NULL) the same times mult2; dst, dst2 [N, H, C, D].
 * reference: pixeltriage.kernels.gated_delta.chunk._Plan.chunked
 * test: tests/kernels/test_gated_delta.py::test_c_chunk_kernels_match_torch_prep_and_loop
 * declines: shape (T, H or D < 0, C < 1) */
PT_API int pt_chunk_gather(const pt_gather_args *a, float *dst, float *dst2, int nthreads);

/* The chunked gated delta rule in float32, one pass per head; out [N * C, H, V] token-major, state [H, K, V],
 * scratch DELTA_SCRATCH(C, K, V) floats per thread, prof NULL or [nthreads, 2] seconds (conv, whole pass) added to.
 * reference: pixeltriage.kernels.gated_delta.chunk._torch_prep (then chunk._torch_loop)
 * test: tests/kernels/test_gated_delta.py::test_c_chunk_kernels_match_torch_prep_and_loop,
 *     tests/kernels/test_gated_delta.py::test_conv_chunk_rule_matches_conv_then_chunk_rule
 * declines: shape (C, K or V not multiples of 16, C over 256, a conv width, projection or chunk table it cannot read),
 *     dtype (x_bf16) */
PT_API int pt_delta_chunked(const pt_delta_args *a, float *out, float *state, float *scratch, double *prof,
                            int nthreads);

/* pt_delta_chunked with its products as bf16 matmuls on `engine` (pt_bf16_engine); state [H, K32, V32] (head dims
 * rounded up to 32), scratch at least pt_delta_chunked_bf16_scratch floats per thread, zeroed.
 * reference: pixeltriage.kernels.gated_delta.naive.recurrent_gated_delta_rule (float64)
 * test: tests/kernels/test_gated_delta.py::test_bf16_pass_matches_float32_pass_and_float64_recurrence
 * declines: shape (C not a multiple of 32 up to 256, heads over 512, a conv width, projection or chunk table it cannot
 *     read), workspace (scratch_floats), isa (an engine this build lacks), dtype (x_bf16) */
PT_API int pt_delta_chunked_bf16(const pt_delta_args *a, int engine, float *out, float *state, float *scratch,
                                 int64_t scratch_floats, double *prof, int nthreads);

/* The bf16 pass's operand packer `which` (pt_pack_layout) of src, float32 contiguous, into dst: the vector packer
 * where fast, else the scalar reference.
 * reference: torch.Tensor.bfloat16
 * test: tests/kernels/test_gated_delta.py::test_bf16_packers_match_their_reference_and_torch
 * declines: argument (which, rows_t without scale), shape (R < 0, N < 0), isa (fast without AVX512-BF16) */
PT_API int pt_bf16_pack(int which, int fast, const float *src, int64_t R, int64_t N, const float *scale,
                        uint16_t *dst);

/* ---- attention (attention.c, attention_bf16.c) --------------------------------------------------------------- */

/* Non-causal attention within segments in bf16 on `engine` (the vision tower's images); Hkv = H, causal 0; out
 * [T, H, D] bf16 contiguous; scratch at least pt_segment_attention_scratch floats per thread.
 * reference: pixeltriage.kernels.attention.sdpa_segments
 * test: tests/kernels/test_fast_paths.py::test_segment_attention_bf16_matches_masked_attention_and_sdpa
 * declines: shape (D not a multiple of 32 up to 256, a segment over 4096 or negative, Hkv other than H), argument
 *     (causal), workspace (scratch_floats), isa (an engine this build lacks) */
PT_API int pt_segment_attention_bf16(const pt_attention_args *a, int engine, uint16_t *out, float *scratch,
                                     int64_t scratch_floats, int nthreads);

/* Causal attention within segments in bf16 on `engine` (the decoder's packed questions), grouped-query heads;
 * causal 1; out [T, H, D] bf16 contiguous; kv: Hkv blocks of kv_per_head bf16, scratch scratch_floats per thread
 * (pt_causal_attention_scratch).
 * reference: pixeltriage.kernels.attention.sdpa_segments
 * test: tests/kernels/test_fast_paths.py::test_causal_attention_bf16_matches_masked_attention_and_sdpa
 * declines: shape (D not a multiple of 32 up to 256, a segment over 32768 or negative, H not a multiple of Hkv),
 *     argument (causal), workspace (scratch_floats, kv_per_head), isa (an engine this build lacks) */
PT_API int pt_causal_attention_bf16(const pt_attention_args *a, int engine, uint16_t *out, uint16_t *kv,
                                    int64_t kv_per_head, float *scratch, int64_t scratch_floats, int nthreads);

/* Attention within segments in float32, causal or not, grouped-query heads; out [T, H, D] contiguous; kv at least
 * 2 Hkv D (the segments' lengths rounded up to 16, summed) floats, scratch pt_attention_f32_scratch per thread.
 * reference: pixeltriage.kernels.attention.sdpa_segments
 * test: tests/kernels/test_fast_paths.py::test_attention_f32_matches_float64_and_sdpa
 * declines: shape (D not a multiple of 16 up to 512, a segment over 32768 or negative, H not a multiple of Hkv),
 *     workspace (scratch_floats, kv_floats) */
PT_API int pt_attention_f32(const pt_attention_args *a, float *out, float *kv, int64_t kv_floats, float *scratch,
                            int64_t scratch_floats, int nthreads);

#endif
