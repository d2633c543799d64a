// Element conversions shared by the fused ADMM kernels: bf16 and fp8 (e4m3fn) storage of z and u.
//
// Each conversion reproduces torch's own tensor casts (round to nearest even for bf16,
// c10's fp8e4m3fn_from_fp32_value for fp8) bit for bit, but is written without branches so that the
// element loops around it vectorize (tests compare them with torch over every fp8 code and over
// random and edge-case fp32 bit patterns).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace elsa {

inline float as_float(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint32_t as_bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

// ---- bf16: the upper half of an fp32, rounded to nearest even; NaN -> 0xFFFF (as torch's vectorized cast)
inline float bf16_to_float(uint16_t h) { return as_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
    uint32_t b = as_bits(f);
    uint32_t rounded = (b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16;
    return uint16_t(f != f ? 0xFFFFu : rounded);
}

// ---- fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; 0x7F / 0xFF are NaN -----
inline float fp8_to_float(uint8_t code) {
    uint32_t c = code;
    uint32_t sign = (c & 0x80u) << 24;
    uint32_t exponent = (c >> 3) & 0xFu;
    float normal = as_float(((c & 0x7Fu) << 20) + (120u << 23));  // 2^(e-7) * 1.mmm
    float subnormal = float(c & 7u) * 0x1p-9f;                    // 0.mmm * 2^-6
    float magnitude = exponent ? normal : subnormal;
    magnitude = (c & 0x7Fu) == 0x7Fu ? NAN : magnitude;
    return as_float(as_bits(magnitude) | sign);
}

inline uint8_t float_to_fp8(float f) {
    const uint32_t fp8_max = 1087u << 20;   // 480.0f: the first magnitude that no longer rounds to 448
    const uint32_t denorm_mask = 141u << 23;
    uint32_t bits = as_bits(f);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    // below 2^-6: let an fp32 addition do the rounding into the subnormal grid
    uint32_t subnormal = as_bits(as_float(bits) + as_float(denorm_mask)) - denorm_mask;
    uint32_t normal = (bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
    normal = normal == 0x7Fu ? 0x7Eu : normal;  // a carry into the NaN pattern saturates to 448
    uint32_t big = bits > 0x7F800000u ? 0x7Fu : 0x7Eu;  // NaN stays NaN, overflow and inf saturate
    uint32_t result = bits >= fp8_max ? big : (bits < (121u << 23) ? subnormal : normal);
    return uint8_t(result | (sign >> 24));
}

// ---- typed loads / stores of a state element as fp32 --------------------------------------------
struct Bf16 { uint16_t bits; };
struct Fp8 { uint8_t bits; };

inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) { return bf16_to_float(v.bits); }
inline float to_float(Fp8 v) { return fp8_to_float(v.bits); }

template <class T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline Bf16 from_float<Bf16>(float v) { return Bf16{float_to_bf16(v)}; }
template <> inline Fp8 from_float<Fp8>(float v) { return Fp8{float_to_fp8(v)}; }

// the largest finite value of a storage type: fp8 stores v / s clamped to +-448 (as state.py does)
template <class T> constexpr float storage_max() { return INFINITY; }
template <> constexpr float storage_max<Fp8>() { return 448.0f; }

}  // namespace elsa
