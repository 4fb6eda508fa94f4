"""AVX-512 passes for the SiLU-gated products between the decoder's matmuls in bf16: SwiGLU's silu(gate) * up
and the Gated DeltaNet's output norm (RMSNorm times silu(z)).

Both are compute-bound (the SiLU's e^x and division) on this engine's CPUs, not memory-bound: the C kernels
(`kernels.native`, auto-vectorised) spend ~1.2-1.4 ns per element of pt_silu_mul at one thread where a copy of the
same bytes takes ~0.3 ns. Written with AVX-512 intrinsics (e^x as 2^n * p(r), the reciprocal as rcp14 and one Newton
step instead of a division, the bf16 rounding by `vcvtneps2bf16`) the same arithmetic takes ~0.9 ns. Against the C
kernels (paired medians of 40 interleaved runs at one thread, 60 at two, load 7-8): the bench-small MLP's
[2296, 6144] -> [2296, 3072] 0.66x at one thread, 0.61x at two; the output norm at [2296, 16, 128] 0.70x and 0.66x.

The source is built on first use, like `kernels.native`'s, with the same compiler, flags and switch
(`PIXELTRIAGE_NATIVE=0` turns it off too), into its own library beside theirs. Where the compiler does not target
AVX512-F/BW/VL/BF16 (`-march=native` on another CPU) the library builds without them and the kernel declines:
`available()` is False and the op keeps its other kernels. The result is float32 arithmetic rounded once to bf16,
within a few float32 ulps of the exact value before that rounding, so it differs from a correctly rounded result
only where the exact value sits next to a rounding boundary (against the C kernels, by one bf16 ulp in 6.8e-6 of
SwiGLU's elements and 9.1e-6 of the norm's).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile

import torch

from pixeltriage.kernels import native

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* e^x for x in [-87, 88] (clamped): 2^n * p(r), r = x - n ln2 (ln2 in two parts), p Cephes' degree-6 expf
 * polynomial; NaN in, a finite value out (the callers multiply by the NaN input again). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 1 / (1 + e^-y): rcp14 and one Newton step (relative error ~2^-28) in place of a division; NaN in, NaN out */
static inline __m512 sigmoid16(__m512 y) {
    __m512 d = _mm512_add_ps(exp16(_mm512_sub_ps(_mm512_setzero_ps(), y)), _mm512_set1_ps(1.0f));
    __m512 rc = _mm512_rcp14_ps(d);
    rc = _mm512_mul_ps(rc, _mm512_fnmadd_ps(d, rc, _mm512_set1_ps(2.0f)));
    __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(rc, nan, y);
}

/* y / (1 + e^-y): rcp14 and one Newton step (relative error ~2^-28) in place of a division; 0 below y = -87, as
 * pt_silu_mul (the true value is under 2e-36 there), NaN kept (the comparison is unordered-true) */
static inline __m512 silu16(__m512 y) {
    __m512 d = _mm512_add_ps(exp16(_mm512_sub_ps(_mm512_setzero_ps(), y)), _mm512_set1_ps(1.0f));
    __m512 rc = _mm512_rcp14_ps(d);
    rc = _mm512_mul_ps(rc, _mm512_fnmadd_ps(d, rc, _mm512_set1_ps(2.0f)));
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), y, rc);
}

static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store16(uint16_t *p, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

int pt_simd_available(void) { return 1; }

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: bf16 rows of stride gu_t, out: bf16 [T, I] contiguous */
int pt_simd_silu_mul(const void *gu, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads) {
    if (T < 0 || I < 0 || gu_t < 2 * I)
        return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = (const uint16_t *)gu + t * gu_t, *u = g + I;
        uint16_t *o = (uint16_t *)out + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            __mmask16 m = lanes(I - i);
            __m512 y = load16(g + i, m);
            store16(o + i, m, _mm512_mul_ps(silu16(y), load16(u + i, m)));
        }
    }
    return 0;
}

/* The Gated DeltaNet's output norm, pt_rms_norm_gated's bf16 case:
 *   out[r, h, :] = x[r, h, :] / sqrt(mean(x[r, h, :]^2) + eps) * w * silu(z[r, h, :])
 * x: float32 [R, H, D] with strides (x_r, x_h, 1); z: bf16 with strides (z_r, z_h, 1); w: float32 [D];
 * out: bf16 [R, H * D] contiguous */
int pt_simd_rms_norm_gated(const float *x, int64_t x_r, int64_t x_h, const void *z, int64_t z_r, int64_t z_h,
                           const float *w, int64_t R, int64_t H, int64_t D, float eps, void *out, int nthreads) {
    if (R < 0 || H < 0 || D < 1)
        return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            const float *xv = x + r * x_r + h * x_h;
            const uint16_t *zv = (const uint16_t *)z + r * z_r + h * z_h;
            uint16_t *o = (uint16_t *)out + (r * H + h) * D;
            __m512 sq = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                __m512 v = _mm512_maskz_loadu_ps(lanes(D - d), xv + d);
                sq = _mm512_fmadd_ps(v, v, sq);
            }
            __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(sq) / (float)D + eps));
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 m = lanes(D - d);
                __m512 normed = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xv + d), inv),
                                              _mm512_maskz_loadu_ps(m, w + d));
                store16(o + d, m, _mm512_mul_ps(normed, silu16(load16(zv + d, m))));
            }
        }
    }
    return 0;
}
/* float32 -> bf16 (round to nearest even) -> float32 */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* o[r, h, :] *= sigmoid(g[r, h, :]) in place: the gated attention's output gate, with the sigmoid rounded to bf16
 * before the product, as torch's bf16 sigmoid then multiply (and transformers) round it. o, g: bf16 [R, H, D] with
 * strides (o_r, o_h, 1) and (g_r, g_h, 1) */
int pt_simd_sigmoid_gate(void *o, int64_t o_r, int64_t o_h, const void *g, int64_t g_r, int64_t g_h, int64_t R,
                         int64_t H, int64_t D, int nthreads) {
    if (R < 0 || H < 0 || D < 0)
        return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < H; h++) {
            uint16_t *ov = (uint16_t *)o + r * o_r + h * o_h;
            const uint16_t *gv = (const uint16_t *)g + r * g_r + h * g_h;
            for (int64_t d = 0; d < D; d += 16) {
                __mmask16 m = lanes(D - d);
                store16(ov + d, m, _mm512_mul_ps(load16(ov + d, m), round16(sigmoid16(load16(gv + d, m)))));
            }
        }
    }
    return 0;
}
#else
int pt_simd_available(void) { return 0; }
int pt_simd_silu_mul(const void *gu, int64_t gu_t, int64_t T, int64_t I, void *out, int nthreads) { return 1; }
int pt_simd_rms_norm_gated(const float *x, int64_t x_r, int64_t x_h, const void *z, int64_t z_r, int64_t z_h,
                           const float *w, int64_t R, int64_t H, int64_t D, float eps, void *out, int nthreads) {
    return 1;
}
int pt_simd_sigmoid_gate(void *o, int64_t o_r, int64_t o_h, const void *g, int64_t g_r, int64_t g_h, int64_t R,
                         int64_t H, int64_t D, int nthreads) {
    return 1;
}
#endif
"""

_state: dict[str, str] = {"status": "not loaded"}


def _compile(cc: str, out) -> None:
    """Build the library at `out` atomically (concurrent builders each rename a complete file into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, src = tempfile.mkstemp(prefix=out.name + ".", suffix=".c", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write(SOURCE)
    tmp = src[:-2] + ".tmp"
    try:
        errors = []
        for openmp in (["-fopenmp"], []):              # without OpenMP the pragmas are ignored: one thread
            cmd = [cc, *native.FLAGS, *openmp, src, "-o", tmp]
            r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o755 & ~umask)
                os.replace(tmp, out)
                return
            errors.append(f"$ {' '.join(cmd)}\n{r.stderr.strip()[-2000:]}")
        raise RuntimeError("\n".join(errors))
    finally:
        for path in (src, tmp):
            if os.path.exists(path):
                os.unlink(path)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (disabled, no compiler, not Linux, or the build failed)."""
    if native._disabled():
        _state["status"] = "disabled by PIXELTRIAGE_NATIVE=0"
        return None
    cc = native._compiler()
    if platform.system() != "Linux" or cc is None:
        _state["status"] = "not built (Linux with a C compiler only)"
        return None
    key = hashlib.sha256(b"\0".join([SOURCE.encode(), os.path.realpath(cc).encode(), " ".join(native.FLAGS).encode(),
                                     native._cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:20]
    path = native._build_dir() / f"pixeltriage_simd_{key}.so"
    try:
        if not path.is_file():
            log.info("building the AVX-512 activation kernel with %s -> %s", cc, path)
            _compile(cc, path)
            for old in path.parent.glob("pixeltriage_simd_*.so"):     # other sources' builds: a new one replaces them
                if old != path:
                    old.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _state["status"] = f"build or load failed: {str(e).strip()[:4000]}"
        log.warning("AVX-512 activation kernel unavailable: %s", _state["status"])
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.pt_simd_available.argtypes, lib.pt_simd_available.restype = [], i32
    lib.pt_simd_silu_mul.argtypes, lib.pt_simd_silu_mul.restype = [ptr, i64, i64, i64, ptr, i32], i32
    lib.pt_simd_rms_norm_gated.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_float, ptr, i32]
    lib.pt_simd_rms_norm_gated.restype = i32
    lib.pt_simd_sigmoid_gate.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i32]
    lib.pt_simd_sigmoid_gate.restype = i32
    _state["status"] = f"loaded {path}" + ("" if lib.pt_simd_available() else " (no AVX-512 BF16: declines)")
    return lib


@functools.cache
def available() -> bool:
    """Built, and built for a CPU with AVX512-F/BW/VL/BF16 (otherwise its functions decline everything)."""
    lib = library()
    return lib is not None and lib.pt_simd_available() == 1


def status() -> str:
    library()
    return _state["status"]


def _takes(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1 and available()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up: bf16 [T, 2I] (gate columns first, rows contiguous) -> silu(gate) * up, bf16 [T, I]; None where the
    kernel does not apply (another dtype or layout, or no AVX-512 BF16)."""
    if not _takes(gate_up) or gate_up.shape[1] % 2:
        return None
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner, dtype=gate_up.dtype)
    ok = library().pt_simd_silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, inner, out.data_ptr(),
                                    torch.get_num_threads()) == 0
    return out if ok else None



def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """w * x / sqrt(mean(x^2) + eps) * silu(gate) over the last dim, rounded once to bf16. x: float32 [R, H, D];
    gate: bf16 [R, H, D] (each with a unit last stride); weight: [D] -> bf16 [R, H, D]; None where the kernel does
    not apply (other dtypes or layouts, or no AVX-512 BF16)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or gate.dtype != torch.bfloat16 or x.dim() != 3
            or gate.shape != x.shape or x.stride(-1) != 1 or gate.stride(-1) != 1 or x.shape[-1] == 0
            or weight.numel() != x.shape[-1] or not available()):
        return None
    rows, heads, dim = x.shape
    w = weight.float().contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    ok = library().pt_simd_rms_norm_gated(x.data_ptr(), x.stride(0), x.stride(1), gate.data_ptr(), gate.stride(0),
                                          gate.stride(1), w.data_ptr(), rows, heads, dim, eps, out.data_ptr(),
                                          torch.get_num_threads()) == 0
    return out if ok else None


def sigmoid_gate_(o: torch.Tensor, gate: torch.Tensor) -> bool:
    """o *= sigmoid(gate) in place, the sigmoid rounded to bf16 and then the product, as torch's two ops round them.
    o, gate: bf16 [R, H, D] with unit last strides. False (o untouched) where the kernel does not apply."""
    if (o.device.type != "cpu" or o.dtype != torch.bfloat16 or gate.dtype != torch.bfloat16 or o.dim() != 3
            or gate.shape != o.shape or o.stride(-1) != 1 or gate.stride(-1) != 1 or not available()):
        return False
    rows, heads, dim = o.shape
    return library().pt_simd_sigmoid_gate(o.data_ptr(), o.stride(0), o.stride(1), gate.data_ptr(), gate.stride(0),
                                          gate.stride(1), rows, heads, dim, torch.get_num_threads()) == 0
