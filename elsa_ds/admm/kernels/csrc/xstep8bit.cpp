// The fused ADMM x-step with 8-bit Adam moments in bitsandbytes' blockwise format: one pass over a
// flat reads p, g, the 8-bit codes of m and v (and z, u on the pruned slices), writes p and the codes.
//
// bitsandbytes 0.50 (backends/cpu/ops.py: _optimizer_update_8bit_blockwise_cpu; csrc/cpu_ops.cpp:
// quantize_cpu_impl), per block of 256 entries, reproduced operation for operation:
//   m = qmap1[c1] · absmax1,  v = qmap2[c2] · absmax2                       dequantize
//   g' = g + λ ((x − z) + u)                                               on pruned slices only
//   m = fma(g', 1 − β1, m·β1);  v = fma((1 − β2)·g', g', v·β2)              mul_/add_, mul_/addcmul_
//   x = x·(1 − lr·wd);  x = x + (−lr/c1 · m) / (√v / c2 + ε)               mul_, addcdiv_
//   absmax = max|·| over the block;  code = lut[(u16)((clamp(·/absmax) + 1)/2 · 65535 + ½)]
// where lut[i] counts the midpoints of adjacent qmap entries below −1 + 2i/65535: bitsandbytes' CPU
// quantizer, a 65536-bin grid, not the exact nearest code. An all-zero block stores absmax 0, codes 0.
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ELSA_AVX512 1
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace elsa {
namespace {

constexpr int64_t kBlock = 256;  // bitsandbytes' block size for optimizer states
constexpr int kLut = 65536;

struct Adam8Consts {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;  // as bitsandbytes passes them: python floats to fp32
    float correction2, eps, decay, step;                      // decay = 1 − lr·wd, step = −lr / c1
    bool decayed;
};

// bitsandbytes' build_quantize_lut, in the same float arithmetic
std::vector<uint8_t> quantize_lut(const float* code) {
    std::vector<uint8_t> lut(kLut + 4, 0);  // +4: room for a 32-bit gather at the last index
    float midpoints[255];
    for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
    int k = 0;
    for (int i = 0; i < kLut; ++i) {
        float val = -1.0f + (2.0f * i) / (kLut - 1);
        while (k < 255 && midpoints[k] < val) ++k;
        lut[i] = uint8_t(k);
    }
    return lut;
}

inline int lut_index(float normed) {
    float x = std::min(std::max(normed, -1.0f), 1.0f);
    x = x != x ? normed : x;  // std::clamp lets NaN through
    return int(uint16_t(int32_t((x + 1.0f) * 0.5f * float(kLut - 1) + 0.5f)));
}

void dequantize(const uint8_t* codes, const float* table, float scale, float* out, int64_t n) {
    int64_t i = 0;
#ifdef ELSA_AVX512
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, table, 4), s));
    }
#endif
    for (; i < n; ++i) out[i] = table[codes[i]] * scale;
}

void quantize(const float* values, const uint8_t* lut, float absmax, uint8_t* codes, int64_t n) {
    if (absmax == 0.0f) {
        std::fill(codes, codes + n, uint8_t(0));
        return;
    }
    const float inv = 1.0f / absmax;
    int64_t i = 0;
#ifdef ELSA_AVX512
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    const __m512 half = _mm512_set1_ps(0.5f), grid = _mm512_set1_ps(float(kLut - 1));
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(values + i), vinv);
        x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);  // NaN becomes −1 here, 0 in bitsandbytes: see below
        __m512 f = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(x, hi), half), grid), half);
        __m512i idx = _mm512_and_si512(_mm512_cvttps_epi32(f), _mm512_set1_epi32(0xFFFF));
        __m512i code = _mm512_and_si512(_mm512_i32gather_epi32(idx, lut, 1), _mm512_set1_epi32(0xFF));
        __mmask16 nan = _mm512_cmp_ps_mask(_mm512_loadu_ps(values + i), _mm512_loadu_ps(values + i), _CMP_UNORD_Q);
        code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(lut[0]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
    }
#endif
    for (; i < n; ++i) codes[i] = lut[lut_index(values[i] * inv)];
}

template <class ZT, class UT, bool PENALTY>
void adam8_span(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                const ZT* __restrict z, const UT* __restrict u, const float z_scale, const float u_scale, const float lam,
                const Adam8Consts c, const int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        float grad = g[i], param = p[i];
        if constexpr (PENALTY) {
            const float zi = std::is_same_v<ZT, float> ? to_float(z[i]) : to_float(z[i]) * z_scale;
            const float ui = std::is_same_v<UT, float> ? to_float(u[i]) : to_float(u[i]) * u_scale;
            grad = std::fma((param - zi) + ui, lam, grad);
        }
        const float mi = std::fma(grad, c.one_minus_beta1, m[i] * c.beta1);
        const float vi = std::fma(c.one_minus_beta2 * grad, grad, v[i] * c.beta2);
        const float denom = std::sqrt(vi) / c.correction2 + c.eps;
        param = c.decayed ? param * c.decay : param;
        p[i] = param + (c.step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

struct Flat8 {
    float* p; const float* g; uint8_t* c1; uint8_t* c2; float* absmax1; float* absmax2;
    const float* code1; const float* code2; const uint8_t* lut1; const uint8_t* lut2;
};

inline float block_absmax(const float* x, int64_t n) {
    float peak = 0.0f;
#pragma omp simd reduction(max : peak)
    for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(x[i]));
    return peak;
}

// one block [b0, b0 + n): dequantize, step every piece it overlaps, re-quantize
template <class ZT, class UT>
void adam8_block(const Flat8& f, const ZT* z, const UT* u, const float* zs, const float* us, float lam,
                 const Adam8Consts& c, int64_t b0, int64_t n, const Piece* pieces, int64_t n_pieces) {
    alignas(64) float m[kBlock], v[kBlock];
    const int64_t block = b0 / kBlock;
    dequantize(f.c1 + b0, f.code1, f.absmax1[block], m, n);
    dequantize(f.c2 + b0, f.code2, f.absmax2[block], v, n);
    for (int64_t k = 0; k < n_pieces; ++k) {
        const int64_t lo = std::max(pieces[k].begin, b0), hi = std::min(pieces[k].end, b0 + n);
        if (lo >= hi) continue;
        const int64_t j = pieces[k].slice, at = lo - b0;
        if (j >= 0 && lam != 0.0f)
            adam8_span<ZT, UT, true>(f.p + lo, f.g + lo, m + at, v + at, z + lo, u + lo, zs[j], us[j], lam, c, hi - lo);
        else
            adam8_span<ZT, UT, false>(f.p + lo, f.g + lo, m + at, v + at, z, u, 1.0f, 1.0f, 0.0f, c, hi - lo);
    }
    f.absmax1[block] = block_absmax(m, n);
    f.absmax2[block] = block_absmax(v, n);
    quantize(m, f.lut1, f.absmax1[block], f.c1 + b0, n);
    quantize(v, f.lut2, f.absmax2[block], f.c2 + b0, n);
}

template <class ZT, class UT>
void adam8_flat(const Flat8& f, int64_t numel, const ZU& zu, const Slices& slices, float lam, const Adam8Consts& c) {
    // pieces never straddle a kChunk boundary, and kChunk is a multiple of the block: the blocks of a
    // chunk see only that chunk's pieces, and one thread owns each block
    static_assert(kChunk % kBlock == 0, "chunks must hold whole blocks");
    const auto plan = make_plan(slices, numel, /*with_gaps=*/true);
    std::vector<int64_t> first(1, 0);
    for (int64_t k = 1; k <= int64_t(plan.size()); ++k)
        if (k == int64_t(plan.size()) || plan[k].begin / kChunk != plan[k - 1].begin / kChunk) first.push_back(k);
    const ZT* z = static_cast<const ZT*>(zu.z);
    const UT* u = static_cast<const UT*>(zu.u);
    const int64_t chunks = int64_t(first.size()) - 1;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
        const Piece* pieces = plan.data() + first[k];
        const int64_t n_pieces = first[k + 1] - first[k];
        const int64_t begin = pieces[0].begin, end = pieces[n_pieces - 1].end;
        for (int64_t b0 = begin; b0 < end; b0 += kBlock)
            adam8_block<ZT, UT>(f, z, u, zu.z_scale, zu.u_scale, lam, c, b0, std::min(kBlock, end - b0), pieces, n_pieces);
    }
}

}  // namespace

void adam8bit_step(float* p, const float* g, const Adam8State& st, int64_t n, const ZU& zu, const Slices& slices, float lam,
                   const Adam8Hyper& h) {
    const auto lut1 = quantize_lut(st.qmap1), lut2 = quantize_lut(st.qmap2);
    // bitsandbytes computes these scalars in Python (double) and torch casts them to fp32
    const double c1 = 1.0 - std::pow(h.beta1, double(h.step)), c2 = std::sqrt(1.0 - std::pow(h.beta2, double(h.step)));
    const Adam8Consts c{float(h.beta1), float(1.0 - h.beta1), float(h.beta2), float(1.0 - h.beta2), float(c2), float(h.eps),
                        float(1.0 - h.lr * h.weight_decay), float(-h.lr / c1), h.weight_decay > 0.0};
    const Flat8 f{p, g, st.state1, st.state2, st.absmax1, st.absmax2, st.qmap1, st.qmap2, lut1.data(), lut2.data()};
    with_storage(zu.z_type, [&](auto zt) {
        with_storage(zu.u_type, [&](auto ut) {
            using ZT = decltype(zt);
            using UT = decltype(ut);
            if constexpr (!std::is_same_v<ZT, NoU> && !std::is_same_v<UT, NoU>)
                adam8_flat<ZT, UT>(f, n, zu, slices, lam, c);
            else  // no z/u (no slices): plain 8-bit Adam
                adam8_flat<float, float>(f, n, zu, Slices{nullptr, nullptr, 0}, 0.0f, c);
        });
    });
}

}  // namespace elsa
