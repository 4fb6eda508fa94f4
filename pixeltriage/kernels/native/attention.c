/* Attention within segments in float32, any CPU (pt_attention_f32): the vision tower's images and the decoder's
 * questions, causal or not. */
#include "attention.h"
#include "matmul.h"

PT_CONTRACT_BEGIN
/* ---- Attention within segments in float32 (any CPU): the vision tower's images and the decoder's questions -----
 * For each segment s (tokens seg_start[s] .. + seg_len[s]) and query head h, whose key/value head is h / (H / Hkv):
 * softmax attention, causal or not, QUERY_BLOCK query rows at a time, each block's scores materialised up to its
 * last key (64 rows of a 2304-token segment are 590 KB, in L2):
 *   S = Q K^T, e = 2^(c S - c rowmax) with c = scale log2(e), over the keys each row sees, O = e V / rowsum(e),
 * the products in mm4's register blocks with float32 sums. Each (key/value head, segment)'s K^T and V are packed
 * once in contiguous panels of ATT_COLS columns ([D, w] of K^T, [Lp, w] of V; w = ATT_COLS or the last panel's
 * rest), Lp = L rounded up to 16 with zero keys past L: kv_floats >= ATTENTION_F32_KV(Hkv, D, sum of the Lp). Each
 * product takes one panel over every 4-row group of the block, so the panel stays in L1; a causal group computes
 * only the panels up to its last row's key. Two schedules, the same blocks (so the same bits): with segments times
 * key/value heads at least ATTENTION_F32_TASKS_PER_THREAD per thread (the ViT's images), each (segment, key/value
 * head) is a task that packs its panels and runs its query heads' blocks while they are in cache (the ViT's
 * attention, 10 images of 400 patches, 8 heads of 64, 2 threads: 0.89x the time of packing every panel first);
 * otherwise (the decoder's few long questions) the panels are packed first, shared by the threads, and the query
 * blocks of a segment go to threads last (longest) first. q, k, v: float32 with strides (t, h, 1) in elements;
 * out: [T, H, D] contiguous. scratch holds ATTENTION_F32_SCRATCH(Lp, D) floats per thread for the longest segment.
 * D a multiple of 16 up to 512, H a multiple of Hkv. The output does not depend on the thread count. Returns 1 for
 * what it does not take. */
#define MAX_ATTENTION_F32 32768
/* Columns of a product's panel: 4 rows x 24 columns on AVX2 (12 of its 16 registers: the 16 columns of mm4's
 * MM_COLS left 8 accumulators, and the decoder's attention took 1.05x as long), MM_COLS elsewhere */
#define ATT_COLS (VR_BYTES == 32 ? 3 * VRL : MM_COLS)

/* c[0:4, 0:w] = a b over kd, for one panel of w (<= ATT_COLS, a multiple of VRL) columns */
static inline void att_cols(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t kd, float *c,
                            int64_t ldc, int64_t w) {
    switch (w / VRL) {
    case 4: mm4(4, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    case 3: mm4(3, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    case 2: mm4(2, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    default: mm4(1, a, lda, b, ldb, kd, c, ldc, 1.0f, 0.0f, 0); break;
    }
}
#define ATTENTION_F32_KV(Hkv, D, sumLp) (2 * (Hkv) * (D) * (sumLp))
#define ATTENTION_F32_SCRATCH(L, D) (QUERY_BLOCK * (L) + 2 * QUERY_BLOCK * (D) + QUERY_BLOCK + 4 * 64)

/* 2^y for the softmax's y <= 0 (NaN in: NaN out): 2^n 2^f, n = round(y), f in [-1/2, 1/2] through Cephes' exp2f
 * polynomial (relative error <= 8.0e-8 at every float in [-126, 0], checked against libm's exp2 in double), y
 * clamped at -126 (2^-126, float's least normal, stands for the smaller values beside a sum >= 1). n comes from the
 * bits of y + 1.5 2^23 (no float-to-int conversion): one select, no branch, so the softmax's loop vectorises;
 * exp_f32's two clamps and NaN select took a seventh of the ViT's attention on AVX2 (0.86x with this one). */
static inline float exp2_softmax(float y) {
    y = y < -126.0f ? -126.0f : y;
    float t = y + 12582912.0f, n = t - 12582912.0f, f = y - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23;             /* round(y) + 127 into the exponent field */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

PT_API int pt_attention_f32_scratch(int64_t longest, int64_t D, int64_t *floats) {
    *floats = ATTENTION_F32_SCRATCH(round16(longest), D);
    return PT_OK;
}

/* x[0:VRL] as the rows of a VRL x VRL matrix, transposed in place: the rounds above, in GCC's generic vectors at
 * this build's register width */
typedef int32_t vrm __attribute__((vector_size(VR_BYTES)));
#define ROUND_VR(s, lo, hi) TRANSPOSE_ROUND(x, VRL, vr, vrm, s, lo, hi)
static inline __attribute__((always_inline)) void transpose_vr(vr x[VRL]) {
#if VRL == 16
    TRANSPOSE_ROUNDS(16, ROUND_VR)
#elif VRL == 8
    TRANSPOSE_ROUNDS(8, ROUND_VR)
#else
    TRANSPOSE_ROUNDS(4, ROUND_VR)
#endif
}
#undef ROUND_VR

/* One 16-key block of one (key/value head, segment): keys n0 .. n0 + 16 (zeros from L) into the K^T and V panels.
 * K^T by VRL x VRL transposes (VRL keys never straddle a panel: ATT_COLS and n0 are multiples of VRL); the scalar
 * loop it replaced (row d of the panel, the keys' element d, one at a time) took 13% of the ViT's attention (10
 * images of 400 patches, 8 heads of 64, 1 thread, AVX-512). */
static void attention_f32_pack(const float *k, int64_t k_t, const float *v, int64_t v_t, int64_t L, int64_t Lp,
                               int64_t D, int64_t n0, float *kt, float *vp) {
    for (int64_t n1 = n0; n1 < n0 + VL; n1 += VRL) {
        int64_t p = n1 / ATT_COLS * ATT_COLS, w = Lp - p < ATT_COLS ? Lp - p : ATT_COLS;
        float *dst = kt + p * D + (n1 - p);                  /* panel row d at dst + d w: the keys' element d */
        for (int64_t d0 = 0; d0 < D; d0 += VRL) {
            vr x[VRL];
            for (int64_t i = 0; i < VRL; i++)
                x[i] = n1 + i < L ? *(const vr *)(k + (n1 + i) * k_t + d0) : (vr){0};
            transpose_vr(x);
            for (int64_t j = 0; j < VRL; j++)
                *(vr *)(dst + (d0 + j) * w) = x[j];
        }
    }
    for (int64_t n = n0; n < n0 + VL; n++) {
        const float *vr_ = v + n * v_t;
        for (int64_t c = 0; c < D; c += ATT_COLS) {                                    /* V's panels */
            int64_t wv = D - c < ATT_COLS ? D - c : ATT_COLS;
            float *dst = vp + c * Lp + n * wv;
            for (int64_t j = 0; j < wv; j += VRL)
                *(vr *)(dst + j) = n < L ? *(const vr *)(vr_ + c + j) : (vr){0};
        }
    }
}

/* Query rows i0 .. i0 + QUERY_BLOCK (or to L) of head h of one segment (tokens t0 .. t0 + L, Lp = round16(L)), its
 * key/value head's K^T and V panels packed at kt and vp: out's rows, through the thread's scratch (qb, sf, of, inv). */
static inline __attribute__((always_inline)) void attention_f32_block(
    const float *q, int64_t q_t, int64_t q_h, int64_t H, int64_t D, int64_t t0, int64_t L, int64_t i0, int64_t h,
    int causal, float scale, const float *kt, const float *vp, float *qb, float *sf, float *of, float *inv,
    float *out) {
    int64_t Lp = round16(L), m = L - i0 < QUERY_BLOCK ? L - i0 : QUERY_BLOCK, mr = (m + 3) / 4 * 4;
    for (int64_t i = 0; i < mr; i++) {                       /* Q's rows, contiguous; zeros past m */
        for (int64_t c = 0; c < D; c += VRL)      /* vector moves: glibc's memcpy takes `rep movs` here */
            *(vr *)(qb + i * D + c) = i < m ? *(const vr *)(q + (t0 + i0 + i) * q_t + h * q_h + c) : (vr){0};
    }
    /* the keys row group r (rows i0 + r .. + 3) reads: all L, or up to its last row's position */
#define KEYS(r) (causal ? (i0 + (r) + 4 < L ? i0 + (r) + 4 : L) : L)
    for (int64_t p = 0; p < Lp; p += ATT_COLS) {             /* S = Q K^T, a K^T panel at a time */
        int64_t w = Lp - p < ATT_COLS ? Lp - p : ATT_COLS;
        for (int64_t r = 0; r < mr; r += 4)
            if (p < KEYS(r))
                att_cols(qb + r * D, D, kt + p * D, w, D, sf + r * Lp + p, Lp, w);
    }
    for (int64_t i = 0; i < mr; i++) {                       /* softmax over the keys row i sees */
        int64_t seen = causal ? (i0 + i + 1 < L ? i0 + i + 1 : L) : L, kd = KEYS(i / 4 * 4);
        float *row = sf + i * Lp, mx = row[0], sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 1; j < seen; j++)
            mx = row[j] > mx ? row[j] : mx;
        float c = scale * 1.44269504088896341f, cm = c * mx;      /* e^(scale (s - mx)) = 2^(c s - c mx) */
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < seen; j++) {
            row[j] = exp2_softmax(c * row[j] - cm);
            sum += row[j];
        }
        for (int64_t j = seen; j < kd; j++)
            row[j] = 0.0f;
        inv[i] = 1.0f / sum;
    }
    for (int64_t c = 0; c < D; c += ATT_COLS) {              /* O = e V, a V panel at a time */
        int64_t w = D - c < ATT_COLS ? D - c : ATT_COLS;
        for (int64_t r = 0; r < mr; r += 4)
            att_cols(sf + r * Lp, Lp, vp + c * Lp, w, KEYS(r), of + r * D + c, D, w);
    }
#undef KEYS
    for (int64_t i = 0; i < m; i++) {
        float *o = out + (t0 + i0 + i) * H * D + h * D;
        for (int64_t c = 0; c < D; c++)
            o[c] = of[i * D + c] * inv[i];
    }
}

/* pt_attention_f32's per-(segment, key/value head) schedule from this many such tasks per thread (fewer would leave
 * threads idle at the end: the decoder's one question over two key/value heads) */
#define ATTENTION_F32_TASKS_PER_THREAD 4

PT_API int pt_attention_f32(const pt_attention_args *a, float *out, float *kv, int64_t kv_floats, float *scratch,
                            int64_t scratch_floats, int nthreads) {
    const float *q = a->q, *k = a->k, *v = a->v;
    int64_t q_t = a->q_t, q_h = a->q_h, k_t = a->k_t, k_h = a->k_h, v_t = a->v_t, v_h = a->v_h, H = a->H;
    int64_t Hkv = a->Hkv, D = a->D, nseg = a->nseg;
    const int64_t *seg_start = a->seg_start, *seg_len = a->seg_len;
    int causal = a->causal;
    float scale = a->scale;
    int64_t longest = longest_segment(seg_start, seg_len, nseg), Lmax = round16(longest), sumLp = 0, ntasks = 0;
    if (longest < 0 || H < 1 || Hkv < 1 || H % Hkv || D < VL || D % VL || D > 512 || longest > MAX_ATTENTION_F32)
        return PT_DECLINE_SHAPE;
    if (scratch_floats < ATTENTION_F32_SCRATCH(Lmax, D))
        return PT_DECLINE_WORKSPACE;
    for (int64_t s = 0; s < nseg; s++) {
        sumLp += round16(seg_len[s]);
        ntasks += (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    }
    if (kv_floats < ATTENTION_F32_KV(Hkv, D, sumLp))
        return PT_DECLINE_WORKSPACE;
    int64_t group = H / Hkv, nkb = sumLp / VL;
    int per_segment = nseg * Hkv >= ATTENTION_F32_TASKS_PER_THREAD * (int64_t)nthreads;
    float *vbase = kv + Hkv * D * sumLp;
#pragma omp parallel num_threads(nthreads)
    {
        float *at = scratch + (int64_t)THREAD_NUM() * scratch_floats;
        float *sf = TAKE_F32(at, QUERY_BLOCK * Lmax), *qb = TAKE_F32(at, QUERY_BLOCK * D);
        float *of = TAKE_F32(at, QUERY_BLOCK * D), *inv = TAKE_F32(at, QUERY_BLOCK);
        if (per_segment) {
            /* (segment, key/value head) tasks: its panels, then its query heads' blocks */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < nseg * Hkv; task++) {
                int64_t s = task / Hkv, hk = task % Hkv, off = 0;
                for (int64_t r = 0; r < s; r++)
                    off += round16(seg_len[r]);
                int64_t t0 = seg_start[s], L = seg_len[s], Lp = round16(L), base = hk * D * sumLp + D * off;
                for (int64_t n0 = 0; n0 < Lp; n0 += VL)
                    attention_f32_pack(k + t0 * k_t + hk * k_h, k_t, v + t0 * v_t + hk * v_h, v_t, L, Lp, D, n0,
                                       kv + base, vbase + base);
                for (int64_t h = hk * group; h < (hk + 1) * group; h++)
                    for (int64_t i0 = 0; i0 < L; i0 += QUERY_BLOCK)
                        attention_f32_block(q, q_t, q_h, H, D, t0, L, i0, h, causal, scale, kv + base, vbase + base,
                                            qb, sf, of, inv, out);
            }
        } else {
            /* K^T and V of every (key/value head, segment), 16 keys of every key/value head a task (a token's heads
             * are read together, rows rather than one head's strided slices; the loop's end is a barrier) */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nkb; b++) {
                int64_t s = 0, off = 0;
                while (b * VL >= off + round16(seg_len[s]))      /* the segment of key block b: at most nseg steps */
                    off += round16(seg_len[s++]);
                int64_t t0 = seg_start[s];
                for (int64_t hk = 0; hk < Hkv; hk++) {
                    int64_t base = hk * D * sumLp + D * off;
                    attention_f32_pack(k + t0 * k_t + hk * k_h, k_t, v + t0 * v_t + hk * v_h, v_t, seg_len[s],
                                       round16(seg_len[s]), D, b * VL - off, kv + base, vbase + base);
                }
            }
            /* query blocks: (segment, block from the segment's end, head) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < ntasks * H; task++) {
                int64_t h = task % H, blk = task / H, s = 0, off = 0;
                while (blk >= (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK) {
                    blk -= (seg_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
                    off += round16(seg_len[s++]);
                }
                int64_t L = seg_len[s], hk = h / group, base = hk * D * sumLp + D * off;
                int64_t i0 = ((L + QUERY_BLOCK - 1) / QUERY_BLOCK - 1 - blk) * QUERY_BLOCK;
                attention_f32_block(q, q_t, q_h, H, D, seg_start[s], L, i0, h, causal, scale, kv + base,
                                    vbase + base, qb, sf, of, inv, out);
            }
        }
    }
    return PT_OK;
}
PT_CONTRACT_END
