// bitsandbytes' blockwise 8-bit state format on the CPU: codes <-> fp32, per block of 256 entries.
//
//   dequantize:  value = qmap[code] · absmax
//   quantize:    code  = lut[(u16)((clamp(value / absmax, ±1) + 1) / 2 · 65535 + ½)]   (absmax 0: code 0)
//
// lut is bitsandbytes' CPU quantizer table (csrc/cpu_ops.cpp: build_quantize_lut): grid point i maps to
// the number of qmap midpoints below −1 + 2i/65535. lut is non-decreasing, so lut[i] is also the number
// of "breakpoints" B[k] = min{i : lut[i] ≥ k} at or below i; the AVX-512 path finds it by an 8-level
// binary search over B in registers (16-bit lanes, vpermw/vpermi2w), and reads qmap from registers
// too (vpermi2ps), instead of gathering from memory. Without AVX-512 (AVX2: Zen 2/3, most Intel before Ice Lake) the
// quantizer computes the same grid index 8 lanes at a time and reads lut by a gather (lut padded by 3 bytes, since a
// 32-bit gather reads 4); dequantizing stays a table read (a gather of qmap was no faster on Zen 3).
// The scalar loops are the reference both are tested to.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ELSA_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define ELSA_AVX2 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "numerics.h"

namespace elsa {

constexpr int kLut = 65536;

class Quantizer8 {
public:
    static constexpr bool kInlineDecode = false;  // a table read (AVX-512: register permutes): its own loop

    explicit Quantizer8(const float* qmap) : qmap_(qmap), lut_(kLut + 3, 0) {
        // bitsandbytes' build_quantize_lut, in the same float arithmetic
        float midpoints[255];
        for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (qmap[i] + qmap[i + 1]);
        int k = 0;
        for (int i = 0; i < kLut; ++i) {
            const float val = -1.0f + (2.0f * i) / (kLut - 1);
            while (k < 255 && midpoints[k] < val) ++k;
            lut_[i] = uint8_t(k);
        }
#ifdef ELSA_AVX512
        for (int r = 0; r < 16; ++r) qmap_regs_[r] = _mm512_loadu_ps(qmap + 16 * r);
        simd_ = lut_[kLut - 1] == 255;  // every code reachable: the breakpoint search is exact (bitsandbytes' maps)
        if (simd_) build_tables();
#endif
    }

    static uint32_t as_bits_(float f) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        return u;
    }

    static int grid_index(float normed) {
        float x = std::min(std::max(normed, -1.0f), 1.0f);  // NaN: the int conversion below gives index 0
        return int(uint16_t(int32_t((x + 1.0f) * 0.5f * float(kLut - 1) + 0.5f)));
    }

    void dequantize(const uint8_t* codes, float absmax, float* out, int64_t n) const {
        int64_t i = 0;
#ifdef ELSA_AVX512
        const __m512 s = _mm512_set1_ps(absmax);
#ifdef __AVX512VBMI__
        for (; i + 64 <= n; i += 64) dequantize64(codes + i, s, out + i);
#endif
        for (; i + 16 <= n; i += 16) {
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(qmap_at(idx), s));
        }
#endif
        for (; i < n; ++i) out[i] = qmap_[codes[i]] * absmax;
    }

    void quantize(const float* values, float absmax, uint8_t* codes, int64_t n) const {
        if (absmax == 0.0f) {
            std::fill(codes, codes + n, uint8_t(0));
            return;
        }
        const float inv = 1.0f / absmax;
        int64_t i = 0;
#ifdef ELSA_AVX512
        for (; simd_ && i + 32 <= n; i += 32) {
            const __m256i lo = _mm512_cvtepi32_epi16(grid_indices(values + i, inv));
            const __m256i hi = _mm512_cvtepi32_epi16(grid_indices(values + i + 16, inv));
            const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtepi16_epi8(search(idx)));
        }
#elif defined(ELSA_AVX2)
        const int* lut = reinterpret_cast<const int*>(lut_.data());  // unaligned 4-byte reads; the low byte is lut[idx]
        const __m256i low = _mm256_set1_epi32(0xFF);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit lane interleave
        for (; i + 32 <= n; i += 32) {
            __m256i c[4];
            for (int k = 0; k < 4; ++k)
                c[k] = _mm256_and_si256(_mm256_i32gather_epi32(lut, grid_indices8(values + i + 8 * k, inv), 1), low);
            const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_permutevar8x32_epi32(bytes, order));
        }
#endif
        for (; i < n; ++i) codes[i] = lut_[grid_index(values[i] * inv)];
    }

private:
    const float* qmap_;
    std::vector<uint8_t> lut_;  // kLut entries, then 3 bytes of padding for the AVX2 gather

#ifdef ELSA_AVX2
    // (int32) grid indices of 8 values: grid_index's float arithmetic; vmaxps returns −1 for NaN, hence index 0
    static __m256i grid_indices8(const float* v, float inv) {
        const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(v), _mm256_set1_ps(inv));
        x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-1.0f)), one);
        const __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(x, one), half), _mm256_set1_ps(float(kLut - 1))), half);
        return _mm256_cvttps_epi32(f);
    }
#endif

#ifdef ELSA_AVX512
    bool simd_ = false;
    __m512 qmap_regs_[16];
    uint16_t top_;         // B[128]
    __m512i level_[5];     // bits 6..2 of the code: B[(j << (b+1)) | 1 << b] for j < 2^(7−b), one register
    __m512i level1_[2];    // bit 1: 64 entries
    __m512i level0_[4];    // bit 0: 128 entries
#ifdef __AVX512VBMI__
    __m512i planes_[4][4];  // byte k of every qmap entry, 4 x 64 entries per byte plane
    __m512i order_;         // the input permutation that makes the byte-plane unpacks come out in order

    // 64 codes at once: each byte of qmap[code] by two 128-entry byte permutes, then interleaved to fp32
    void dequantize64(const uint8_t* codes, __m512 absmax, float* out) const {
        const __m512i c = _mm512_permutexvar_epi8(order_, _mm512_loadu_si512(codes));
        const __mmask64 high = _mm512_movepi8_mask(c);  // code >= 128
        __m512i b[4];
        for (int k = 0; k < 4; ++k)
            b[k] = _mm512_mask_mov_epi8(_mm512_permutex2var_epi8(planes_[k][0], c, planes_[k][1]), high,
                                        _mm512_permutex2var_epi8(planes_[k][2], c, planes_[k][3]));
        const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
        const __m512i w2 = _mm512_unpacklo_epi8(b[2], b[3]), w3 = _mm512_unpackhi_epi8(b[2], b[3]);
        const __m512i d[4] = {_mm512_unpacklo_epi16(w0, w2), _mm512_unpackhi_epi16(w0, w2), _mm512_unpacklo_epi16(w1, w3),
                              _mm512_unpackhi_epi16(w1, w3)};
        for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(d[k]), absmax));
    }
#endif

    void build_tables() {
        uint16_t b[256];
        b[0] = 0;
        for (int k = 1, i = 0; k < 256; ++k) {  // lut[65535] = 255: every code is reached
            while (lut_[i] < k) ++i;
            b[k] = uint16_t(i);
        }
        top_ = b[128];
#ifdef __AVX512VBMI__
        alignas(64) uint8_t bytes[4][256];
        for (int e = 0; e < 256; ++e)
            for (int k = 0; k < 4; ++k) bytes[k][e] = uint8_t(as_bits_(qmap_[e]) >> (8 * k));
        for (int k = 0; k < 4; ++k)
            for (int r = 0; r < 4; ++r) planes_[k][r] = _mm512_load_si512(bytes[k] + 64 * r);
        // unpack output k, 128-bit lane L, dword j holds input byte 16L + 4k + j: feed it code 16k + 4L + j
        alignas(64) uint8_t perm[64];
        for (int k = 0; k < 4; ++k)
            for (int lane = 0; lane < 4; ++lane)
                for (int j = 0; j < 4; ++j) perm[16 * lane + 4 * k + j] = uint8_t(16 * k + 4 * lane + j);
        order_ = _mm512_load_si512(perm);
#endif
        auto fill = [&](int bit, int first, __m512i& reg) {
            alignas(64) uint16_t words[32] = {};
            for (int j = first; j < std::min(first + 32, 1 << (7 - bit)); ++j) words[j - first] = b[(j << (bit + 1)) | (1 << bit)];
            reg = _mm512_load_si512(words);
        };
        for (int bit = 6; bit >= 2; --bit) fill(bit, 0, level_[6 - bit]);
        fill(1, 0, level1_[0]);
        fill(1, 32, level1_[1]);
        for (int r = 0; r < 4; ++r) fill(0, 32 * r, level0_[r]);
    }

    // qmap[idx] for 16 indices in 0..255: 8 two-register permutes, then a select on index bits 5..7
    __m512 qmap_at(__m512i idx) const {
        __m512 r[8];
        for (int k = 0; k < 8; ++k) r[k] = _mm512_permutex2var_ps(qmap_regs_[2 * k], idx, qmap_regs_[2 * k + 1]);
        for (int bit = 5, width = 8; bit <= 7; ++bit, width /= 2) {
            const __mmask16 take = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(1 << bit));
            for (int k = 0; k < width / 2; ++k) r[k] = _mm512_mask_mov_ps(r[2 * k], take, r[2 * k + 1]);
        }
        return r[0];
    }

    // (int32) grid indices of 16 values: bitsandbytes' float arithmetic, NaN to index 0 like its cast
    static __m512i grid_indices(const float* v, float inv) {
        const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(inv));
        x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-1.0f)), one);  // vmaxps returns −1 for NaN
        const __m512 f = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(x, one), half), _mm512_set1_ps(float(kLut - 1))), half);
        return _mm512_cvttps_epi32(f);
    }

    // lut[idx] for 32 16-bit grid indices: the largest code c with B[c] <= idx, one bit at a time
    __m512i search(__m512i idx) const {
        __m512i c = _mm512_maskz_mov_epi16(_mm512_cmple_epu16_mask(_mm512_set1_epi16(short(top_)), idx), _mm512_set1_epi16(128));
        auto step = [&](__m512i bound, int bit) {
            c = _mm512_mask_add_epi16(c, _mm512_cmple_epu16_mask(bound, idx), c, _mm512_set1_epi16(short(1 << bit)));
        };
        for (int bit = 6; bit >= 2; --bit) step(_mm512_permutexvar_epi16(_mm512_srli_epi16(c, bit + 1), level_[6 - bit]), bit);
        step(_mm512_permutex2var_epi16(level1_[0], _mm512_srli_epi16(c, 2), level1_[1]), 1);
        const __m512i j = _mm512_srli_epi16(c, 1);
        const __m512i low = _mm512_permutex2var_epi16(level0_[0], j, level0_[1]);
        const __m512i high = _mm512_permutex2var_epi16(level0_[2], j, level0_[3]);
        step(_mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(j, _mm512_set1_epi16(64)), high), 0);
        return c;
    }
#endif
};


// elsa_ds's own 8-bit moment format, "minifloat" (adam8bit.py: minifloat_map, minifloat_encode): a code is a 4-bit
// octave and an M-bit mantissa of the value relative to its block's absmax, with a sign bit for m:
//
//   magnitude c = 0 → 0;   c ≥ 1 → 2^((c >> M) − 15) · (1 + (c & (2^M − 1)) / 2^M)      (c = 15·2^M is 1.0)
//   byte        = signed (m, M = 3): sign << 7 | c;   unsigned (v, M = 4): c
//
// Encoding is arithmetic, no table: the nearest code (ties away from zero) is the fp32 bit pattern of |x|/absmax
// rounded to M mantissa bits (add half a code step, shift), re-biased. Below the smallest code a signed value goes to
// the nearer of 0 and that code; an unsigned positive one goes to the smallest code, so v never becomes 0 while the
// gradient that made it was not (the Adam denominator keeps its floor). Decoding is the same bits shifted back.
// Both loops are plain element loops the compiler vectorizes; the torch reference does the same integer arithmetic.
template <int M, bool SIGNED>
class MiniFloat8 {
public:
    static constexpr int kShift = 23 - M;
    static constexpr int32_t kOffset = 112 << M;               // fp32 exponent bias 127 − 15, in code units
    static constexpr uint32_t kMagnitude = SIGNED ? 0x7Fu : 0xFFu;

    static constexpr bool kInlineDecode = true;  // cheap enough to decode inside the step's own loop

    static float decode(uint8_t code) {
        const uint32_t c = code, mag = c & kMagnitude;
        uint32_t bits = mag != 0 ? (mag << kShift) + (112u << 23) : 0u;
        if constexpr (SIGNED) bits |= (c & 0x80u) << 24;
        return as_float(bits);
    }

    void dequantize(const uint8_t* codes, float absmax, float* out, int64_t n) const {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] = decode(codes[i]) * absmax;
    }

    void quantize(const float* values, float absmax, uint8_t* codes, int64_t n) const {
        if (absmax == 0.0f) {
            std::fill(codes, codes + n, uint8_t(0));
            return;
        }
        const float inv = 1.0f / absmax;
        const float floor = SIGNED ? as_float((112u << 23) + (1u << kShift)) * 0.5f : 0.0f;  // half the smallest code
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float x = values[i];
            float a = std::fabs(x) * inv;
            const bool keep = SIGNED ? a >= floor : a > 0.0f;  // false for NaN
            a = std::min(a, 1.0f);
            int32_t c = int32_t((as_bits(a) + (1u << (kShift - 1))) >> kShift) - kOffset;
            c = std::max(c, int32_t(1));
            if constexpr (SIGNED) c |= int32_t(as_bits(x) >> 31) << 7;
            codes[i] = uint8_t(keep ? c : 0);
        }
    }
};
using MiniFloatM = MiniFloat8<3, true>;
using MiniFloatV = MiniFloat8<4, false>;

}  // namespace elsa
