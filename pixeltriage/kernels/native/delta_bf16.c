/* The chunked gated delta rule with its products in bf16 on AMX, AVX512-BF16 or float32 multiply-adds
 * (pt_delta_chunked_bf16), and its operand packers for the tests (pt_bf16_pack). */
#define _DEFAULT_SOURCE              /* clock_gettime(), for the profiler's split */
#include "delta.h"
#include "matmul_bf16.h"

PT_CONTRACT_BEGIN
/* ---- The delta rule in bf16 on the matrix units ----------------------------------------------------------------
 * The same chunked rule as pt_delta_chunked for a bf16 forward, with its products as bf16 matmuls accumulated in
 * float32 (flash-linear-attention's numerics on a GPU): per chunk and head, kb k^T and q k^T, u = T vb and
 * w = T diag(exp(gamma)) kb with T rounded to bf16, v_new = u - w S, out = diag(exp(gamma) scale) q S + intra v_new
 * and S = chunk_decay S + k_end^T v_new, where every operand of a product is rounded to bf16 once and the state S,
 * u, v_new before its rounding, the decays, the UT inverse and every sum stay float32. */

/* The packers for the tests: PT_PACK_ROWS to_bf16_rows (rowscale = scale if given), PT_PACK_PAIRS pack_pairs,
 * PT_PACK_PAIRS_T pack_pairs_t, PT_PACK_ROWS_T to_bf16_t (rowscale = scale, required), of src [R, N] float32
 * contiguous (for the last two, src is [N, R]) into dst (the layout's R * N bf16), the vector packer if fast and this
 * build has it, else the reference. */
PT_API int pt_bf16_pack(int which, int fast, const float *src, int64_t R, int64_t N, const float *scale,
                        uint16_t *dst) {
    if (which < PT_PACK_ROWS || which > PT_PACK_ROWS_T || (which == PT_PACK_ROWS_T && !scale))
        return PT_DECLINE_ARGUMENT;
    if (R < 0 || N < 0)
        return PT_DECLINE_SHAPE;
    if (fast && !PT_FAST_PACK)
        return PT_DECLINE_ISA;
    switch (which * 2 + (fast != 0)) {
    case 0: to_bf16_rows_ref(src, N, R, N, scale, dst, N); break;
    case 1: to_bf16_rows(src, N, R, N, scale, dst, N); break;
    case 2: pack_pairs_ref(src, N, R, N, dst); break;
    case 3: pack_pairs(src, N, R, N, dst); break;
    case 4: pack_pairs_t_ref(src, R, N, R, dst); break;
    case 5: pack_pairs_t(src, R, N, R, dst); break;
    case 6: to_bf16_t_ref(src, R, N, R, scale, dst, N); break;
    default: to_bf16_t(src, R, N, R, scale, dst, N); break;
    }
    return PT_OK;
}

/* Per-thread scratch of the bf16 pass, in floats, for K and V the head dims padded to multiples of 32 (zero
 * columns, which change no product; the caller zeroes the scratch once and nothing writes the padding after):
 * float32 q, kb, k, w (4 C K), vb, u, the output before its copy when V was padded (3 C V), the decay matrix,
 * kb k^T (then T), q k^T (3 C^2); bf16 (half a float each): q, kb, k^T and kb paired, w, k_end^T (6 C K), intra,
 * T, T diag(exp(gamma)) (3 C^2), vb and v_new paired (2 C V), the state paired (K V); each of the 22 arrays
 * rounded up to 64 floats (256 bytes). */
#define MAX_DELTA_HEAD 512              /* the bf16 pass's widest head (its per-thread scratch grows with K V) */
#define DELTA_BF16_SCRATCH(C, K, V) \
    (4 * (C) * (K) + 3 * (C) * (V) + 3 * (C) * (C) + (6 * (C) * (K) + 3 * (C) * (C) + 2 * (C) * (V) + (K) * (V)) / 2 \
     + 24 * 64)

/* DELTA_BF16_SCRATCH for head dims K and V (padded here): what the caller allocates per thread */
PT_API int pt_delta_chunked_bf16_scratch(int64_t C, int64_t K, int64_t V, int64_t *floats) {
    *floats = DELTA_BF16_SCRATCH(C, round32(K), round32(V));
    return PT_OK;
}


/* One chunk of one head in bf16 (see pt_delta_chunked_bf16): S is the head's float32 state, updated; o the chunk's
 * first output row for this head, rows ldo apart. */
static void delta_chunk_bf16(const delta_args *a, int engine, int64_t t0, int64_t len, int64_t seg0, int64_t h,
                             const float *g, float *S, float *out, int64_t ldo, float *scratch) {
    int64_t C = a->C, K = round32(a->K), V = round32(a->V);          /* the padded head dims */
    float scale = a->scale, cutoff = a->cutoff, tiny = a->tiny;
    float *at = scratch;
    float *qm = TAKE_F32(at, C * K), *kbm = TAKE_F32(at, C * K), *vbm = TAKE_F32(at, C * V);
    float *kn = TAKE_F32(at, C * K), *dec = TAKE_F32(at, C * C), *t = TAKE_F32(at, C * C);
    float *qk = TAKE_F32(at, C * C), *u = TAKE_F32(at, C * V), *wf = TAKE_F32(at, C * K);
    float *o = V == a->V ? out : TAKE_F32(at, C * V);
    uint16_t *qb = TAKE_BF16(at, C * K), *kbb = TAKE_BF16(at, C * K), *ktp = TAKE_BF16(at, C * K);
    uint16_t *kbp = TAKE_BF16(at, C * K), *wb = TAKE_BF16(at, C * K), *kendt = TAKE_BF16(at, C * K);
    uint16_t *intra = TAKE_BF16(at, C * C), *tb = TAKE_BF16(at, C * C), *twb = TAKE_BF16(at, C * C);
    uint16_t *vbp = TAKE_BF16(at, C * V), *vnp = TAKE_BF16(at, C * V), *sp = TAKE_BF16(at, K * V);
    delta_gather_rows(a, t0, len, seg0, h, qm, kbm, vbm, kn, K, V);
    /* qscale zeroed past C, which is all the products read: GCC cannot see that and warns without AVX512-BF16 */
    float gexp[MAX_DELTA_CHUNK], kend[MAX_DELTA_CHUNK], qscale[MAX_DELTA_CHUNK] = {0};
    chunk_decays(g, C, cutoff, gexp, kend, dec);
    for (int64_t i = 0; i < C; i++)
        qscale[i] = gexp[i] * scale;
    /* kb k^T and q k^T */
    to_bf16_rows(qm, K, C, K, NULL, qb, K);
    to_bf16_rows(kbm, K, C, K, NULL, kbb, K);
    pack_pairs_t(kn, K, C, K, ktp);
    mm_bf16(engine, kbb, K, ktp, C, C, K, t, C, 0, NULL, 0);
    mm_bf16(engine, qb, K, ktp, C, C, K, qk, C, 0, NULL, 0);
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < C; j++)
            qk[i * C + j] = j <= i ? qk[i * C + j] * (dec[i * C + j] * scale) : 0.0f;
    to_bf16_rows(qk, C, C, C, NULL, intra, C);
    /* T = (I + strictly_lower(kb k^T * decay))^-1 in float32, then its two bf16 copies */
    for (int64_t i = 0; i < C; i++)
        for (int64_t j = 0; j < i; j++)
            dec[i * C + j] *= t[i * C + j];
    ut_inverse(t, dec, C, tiny);
    to_bf16_rows(t, C, C, C, NULL, tb, C);
    for (int64_t i = 0; i < C; i++)                                  /* t is not read after its two copies */
        for (int64_t j = 0; j < C; j++)
            t[i * C + j] *= -gexp[j];
    to_bf16_rows(t, C, C, C, NULL, twb, C);
    /* u = T vb; -w = T diag(-exp(gamma)) kb (the sign exact in every rounding) for v_new = u + (-w) S */
    pack_pairs(vbm, V, C, V, vbp);
    pack_pairs(kbm, K, C, K, kbp);
    mm_bf16(engine, tb, C, vbp, C, V, C, u, V, 0, NULL, 1);
    mm_bf16(engine, twb, C, kbp, C, K, C, wf, K, 0, NULL, 1);
    to_bf16_rows(wf, K, C, K, NULL, wb, K);
    to_bf16_t(kn, K, C, K, kend, kendt, C);                          /* k_end^T: k decayed to the chunk's end */
    /* the recurrence: v_new = u - w S; out = diag(exp(gamma) scale) q S + intra v_new; S = decay S + k_end^T v_new */
    pack_pairs(S, V, K, V, sp);
    mm_bf16(engine, wb, K, sp, C, V, K, u, V, 1, NULL, 0);
    pack_pairs(u, V, C, V, vnp);
    int64_t ld = o == out ? ldo : V;
    mm_bf16(engine, qb, K, sp, C, V, K, o, ld, 0, NULL, 0);
    mm_bf16(engine, intra, C, vnp, C, V, C, o, ld, 1, qscale, 1);   /* o = diag(qscale) o + intra v_new */
    if (o != out)                                                    /* the head's V of its padded columns */
        for (int64_t i = 0; i < C; i++)
            memcpy(out + i * ldo, o + i * V, (size_t)a->V * sizeof(float));
    float cd[MAX_DELTA_HEAD];                                        /* S's decay, one per row (0 * inf stays NaN) */
    for (int64_t i = 0; i < K; i++)
        cd[i] = gexp[C - 1];
    mm_bf16(engine, kendt, C, vnp, K, V, C, S, V, 1, cd, 0);
}

/* pt_delta_chunked's contract (conv mode or not) with its products in bf16 on `engine` (a bit of
 * pt_bf16_engines()), the conv's SiLU `silu16_bf16`; the state is [H, K32, V32] floats, with K32 and V32 the head
 * dims rounded up to multiples of 32; scratch holds scratch_floats floats per thread, at least
 * DELTA_BF16_SCRATCH(C, K32, V32), zeroed. C a multiple of 32. */
PT_API int pt_delta_chunked_bf16(const pt_delta_args *args, int engine, float *out, float *state, float *scratch,
                                 int64_t scratch_floats, double *prof, int nthreads) {
    int64_t N = args->N, H = args->H, C = args->C, K = args->K, V = args->V;
    const int64_t *chunk_start = args->chunk_start, *chunk_len = args->chunk_len, *seg_start = args->seg_start;
    const uint8_t *restart = args->restart;
    const float *gamma = args->gamma, *taps = args->taps;
    if (N < 0 || H < 0 || C < 32 || C % 32 || C > MAX_DELTA_CHUNK || K < 1 || V < 1 || K > MAX_DELTA_HEAD
        || V > MAX_DELTA_HEAD || !delta_conv_ok(taps, args->W, args->group, H, K, V, args->conv_dim)
        || !delta_chunks_ok(N, C, chunk_start, chunk_len, taps, seg_start))
        return PT_DECLINE_SHAPE;
    if (scratch_floats < DELTA_BF16_SCRATCH(C, round32(K), round32(V)))
        return PT_DECLINE_WORKSPACE;
    if (!dtype_flag_ok(args->x_bf16))
        return PT_DECLINE_DTYPE;
    if (!engine_ok(engine))
        return PT_DECLINE_ISA;
    delta_args a = delta_args_of(args, prof, 1);
#pragma omp parallel num_threads(nthreads)
    {
        double start = prof ? delta_seconds() : 0.0;
        int tid = THREAD_NUM(), nth = NUM_THREADS();
        int64_t h0 = H * tid / nth, h1 = H * (tid + 1) / nth;      /* as pt_delta_chunked: a block of heads */
        float *mine = scratch + (int64_t)tid * scratch_floats;
        tiles_on(engine);
        for (int64_t n = 0; n < N; n++)
            for (int64_t h = h0; h < h1; h++) {
                float *S = state + h * round32(K) * round32(V);
                if (n == 0 || restart[n])
                    memset(S, 0, (size_t)(round32(K) * round32(V)) * sizeof(float));
                delta_chunk_bf16(&a, engine, chunk_start[n], chunk_len[n], taps ? seg_start[n] : 0, h,
                                 gamma + (n * H + h) * C, S, out + (n * C * H + h) * V, H * V, mine);
            }
        tiles_off(engine);
        if (prof)
            prof[2 * tid + 1] += delta_seconds() - start;
    }
    return PT_OK;
}
PT_CONTRACT_END
