// The 8-bit x-step's inner loop (xstep8bit.cpp: adam8_span) written with AVX-512 intrinsics, 16 entries a step.
//
// adam8_span, a plain element loop, stays the readable reference and the path of every other CPU; this is the same
// arithmetic, operation for operation (tests/admm/test_span8_avx512.py holds the two to identical p, codes and absmax, the
// portable loop forced with kernels.use_portable_loops). Why it exists: on ELSA-L's step (minifloat codes, fp8 z, bf16
// u) GCC vectorizes the plain loop 64 entries at a time with ~300 instructions, spilling its eight max accumulators to
// the stack and widening every byte array through two zero-extensions and lane extracts; the step is compute-bound
// (Zen 4 runs a 512-bit operation as two 256-bit halves), so fewer instructions is the whole gain. Here:
//   - fp8 z and the minifloat codes decode on 16-bit lanes (256-bit operations, one pass each on Zen 4) into fp16
//     bit patterns that vcvtph2ps widens: five to seven narrow operations and one conversion per 16 entries, where the
//     integer decode (load, decode below) takes eleven (z) and seven (m's codes) 512-bit ones; the powers of two the fp16
//     forms are off by fold into the scale multiplied next, and the caller keeps the integer decode (below) for the
//     rare span whose scales would not stay exact;
//   - the block's peaks stay in two registers; the last partial vector is masked, no scalar remainder loop.
// Measured on the 32M-entry flat (Zen 4, 2 threads, ABBA in one process): ELSA-L's fused step 17.8 -> 15.9 ms.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ELSA_SPAN8_AVX512 1
#include <immintrin.h>

#include <type_traits>

#include "numerics.h"

namespace elsa {
namespace span8 {

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }

inline __m512 load(const float* x, __mmask16 k) { return _mm512_maskz_loadu_ps(k, x); }

inline __m512 load(const Bf16* x, __mmask16 k) {  // bf16_to_float: the bits in the upper half
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x)), 16));
}

// fp8_to_float: e4m3fn code c = s eeee mmm. The normal formula 2^(e−7)·1.mmm, bits ((c & 0x7F) << 20) + (120 << 23),
// gives 2^−7 + m·2^−10 where e = 0; the subnormal value m·2^−9 is (that − 2^−7)·2, both steps exact. 0x7F: NaN.
inline __m512 load(const Fp8* x, __mmask16 k) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, x));
    const __m512i mag = _mm512_and_si512(_mm512_slli_epi32(c, 20), _mm512_set1_epi32(0x7F << 20));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F << 20));
    const __mmask16 sub = _mm512_testn_epi32_mask(c, _mm512_set1_epi32(0x78));
    __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(mag, _mm512_set1_epi32(120 << 23)));
    v = _mm512_mask_sub_ps(v, sub, v, _mm512_set1_ps(0x1p-7f));
    v = _mm512_mask_add_ps(v, sub, v, v);
    v = _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(v), _mm512_slli_epi32(c, 24),
                                                         _mm512_set1_epi32(int(0x80000000u)), 0xF8));  // v | (c<<24 & sign)
}

// ---- the same values through fp16 (vcvtph2ps), most of the work on 16-bit lanes: a 256-bit operation is one pass
// through Zen 4's 256-bit units where a 512-bit one takes two. Each gives the value times a power of two that the
// caller folds into the scale it multiplies by next (exact while that scale stays in the normal range: the caller
// checks), so the product, one rounding of the same real number, is bit for bit the one above.

// s eeee mmm as fp16 s 0eeee mmm0000000: 2^−8 times the e4m3 value, subnormals included (2^−8·m/8·2^−6 is an fp16
// subnormal); NaN (0x7F, 0xFF) to fp16's quiet NaN 0x7E00 with the sign, which converts to fp8_to_float's 0x7FC00000
inline __m512 load_fp8_div256(const Fp8* x, __mmask16 k) {
    const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(k, x)), 8);  // the code in bits 8..15
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(short(0xBFFF)));  // sign, then bits 7..13
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(high, _mm256_set1_epi16(0x7F00)), _mm256_set1_epi16(0x7F00));
    h = _mm256_mask_add_epi16(h, nan, h, _mm256_set1_epi16(0x7E00 - 0x3F80));
    return _mm512_cvtph_ps(h);
}

// MiniFloat8<M, SIGNED>::decode · 2 of 16 codes: magnitude c ≥ 1 is fp16 exponent (c >> M) + 1, mantissa c & (2^M − 1)
// (2·2^((c >> M) − 15)·(1 + mantissa/2^M), octave 0 included); magnitude 0 stays ±0
template <class Q>
inline __m512 decode_times2(const uint8_t* codes, __mmask16 k) {
    constexpr int M = 23 - Q::kShift;
    const __m256i c = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(k, codes));
    __m256i h;
    if constexpr (Q::kMagnitude != 0xFFu) {  // signed, M = 3: the code to bits 8..15, then s to bit 15, magnitude to 7..13
        static_assert(M == 3, "the signed minifloat has 3 mantissa bits");
        h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(c, 8), 1), _mm256_set1_epi16(short(0xBFFF)));
    } else
        h = _mm256_slli_epi16(c, 10 - M);
    const __mmask16 nonzero = _mm256_test_epi16_mask(c, _mm256_set1_epi16(short(Q::kMagnitude)));
    h = _mm256_mask_add_epi16(h, nonzero, h, _mm256_set1_epi16(1 << 10));
    return _mm512_cvtph_ps(h);
}

// MiniFloat8<M, SIGNED>::decode of 16 codes
template <class Q>
inline __m512 decode(const uint8_t* codes, __mmask16 k) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
    const __m512i mask = _mm512_set1_epi32(int(Q::kMagnitude));
    const __mmask16 nonzero = _mm512_test_epi32_mask(c, mask);
    __m512i bits = _mm512_slli_epi32(c, Q::kShift);
    if constexpr (Q::kMagnitude != 0xFFu) bits = _mm512_and_si512(bits, _mm512_set1_epi32(int(Q::kMagnitude << Q::kShift)));
    bits = _mm512_maskz_add_epi32(nonzero, bits, _mm512_set1_epi32(112 << 23));
    if constexpr (Q::kMagnitude != 0xFFu)  // signed: bit 7 is the sign
        bits = _mm512_ternarylogic_epi32(bits, _mm512_slli_epi32(c, 24), _mm512_set1_epi32(int(0x80000000u)), 0xF8);
    return _mm512_castsi512_ps(bits);
}

// the fp16 route's folded scales are exact: 256·z_scale neither overflows nor (absmax / 2) loses a bit
inline bool fp16_scales_exact(float z_scale, float absmax1, float absmax2) {
    const auto halves = [](float a) { return a == 0.0f || a >= 0x1p-125f; };  // a / 2 is a normal number (or 0)
    return z_scale * 256.0f <= 0x1p127f && halves(absmax1) && halves(absmax2);
}

// adam8_span's loop (same arguments, same result); Consts is xstep8bit.cpp's Adam8Consts. FP16: decode z and the codes
// through fp16 (fp16_scales_exact must hold for this span's scales)
template <class Q1, class Q2, class ZT, class UT, bool PENALTY, bool DECAY, bool FP16, class Consts>
void adam8_span(float* __restrict p, const float* __restrict g, const uint8_t* __restrict c1, const uint8_t* __restrict c2,
                const float absmax1, const float absmax2, float* __restrict m, float* __restrict v, const ZT* __restrict z,
                const UT* __restrict u, const float z_scale, const float u_scale, const float lam, const Consts& c,
                const int64_t n, float& peak1, float& peak2) {
    constexpr bool kInline = Q1::kInlineDecode && Q2::kInlineDecode;
    const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
    const __m512 corr2 = _mm512_set1_ps(kInline ? c.inv_correction2 : c.correction2), eps = _mm512_set1_ps(c.eps);
    const __m512 decay = _mm512_set1_ps(c.decay), step = _mm512_set1_ps(c.step), lambda = _mm512_set1_ps(lam);
    constexpr bool kZ16 = FP16 && std::is_same_v<ZT, Fp8>;  // z through fp16: 2^−8 times its value, 256 folded into zs
    const __m512 zs = _mm512_set1_ps(kZ16 ? z_scale * 256.0f : z_scale), us = _mm512_set1_ps(u_scale);
    const __m512 am1 = _mm512_set1_ps(FP16 ? absmax1 * 0.5f : absmax1), am2 = _mm512_set1_ps(FP16 ? absmax2 * 0.5f : absmax2);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 pk1 = _mm512_set1_ps(peak1), pk2 = _mm512_set1_ps(peak2);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lanes(n - i);
        __m512 grad = _mm512_maskz_loadu_ps(k, g + i), param = _mm512_maskz_loadu_ps(k, p + i);
        if constexpr (PENALTY) {
            __m512 zi, ui = load(u + i, k);
            if constexpr (kZ16) zi = load_fp8_div256(z + i, k);
            else zi = load(z + i, k);
            if constexpr (!std::is_same_v<ZT, float>) zi = _mm512_mul_ps(zi, zs);
            if constexpr (!std::is_same_v<UT, float>) ui = _mm512_mul_ps(ui, us);
            grad = _mm512_fmadd_ps(_mm512_add_ps(_mm512_sub_ps(param, zi), ui), lambda, grad);
        }
        __m512 m0, v0;
        if constexpr (kInline && FP16) {  // am1, am2: absmax / 2
            m0 = _mm512_mul_ps(decode_times2<Q1>(c1 + i, k), am1);
            v0 = _mm512_mul_ps(decode_times2<Q2>(c2 + i, k), am2);
        } else if constexpr (kInline) {
            m0 = _mm512_mul_ps(decode<Q1>(c1 + i, k), am1);
            v0 = _mm512_mul_ps(decode<Q2>(c2 + i, k), am2);
        } else {
            m0 = _mm512_maskz_loadu_ps(k, m + i);
            v0 = _mm512_maskz_loadu_ps(k, v + i);
        }
        const __m512 mi = _mm512_fmadd_ps(grad, omb1, _mm512_mul_ps(m0, b1));
        const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, grad), grad, _mm512_mul_ps(v0, b2));
        const __m512 root = _mm512_sqrt_ps(vi);
        const __m512 denom = _mm512_add_ps(kInline ? _mm512_mul_ps(root, corr2) : _mm512_div_ps(root, corr2), eps);
        if constexpr (DECAY) param = _mm512_mul_ps(param, decay);
        _mm512_mask_storeu_ps(p + i, k, _mm512_add_ps(param, _mm512_div_ps(_mm512_mul_ps(step, mi), denom)));
        _mm512_mask_storeu_ps(m + i, k, mi);
        _mm512_mask_storeu_ps(v + i, k, vi);
        if constexpr (kInline) {  // std::max(peak, |x|): a NaN x leaves the peak (vmaxps returns its second operand)
            pk1 = _mm512_mask_max_ps(pk1, k, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mi), abs_mask)), pk1);
            pk2 = _mm512_mask_max_ps(pk2, k, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vi), abs_mask)), pk2);
        }
    }
    if constexpr (kInline) {
        peak1 = _mm512_reduce_max_ps(pk1);
        peak2 = _mm512_reduce_max_ps(pk2);
    }
}

}  // namespace span8
}  // namespace elsa
#endif
