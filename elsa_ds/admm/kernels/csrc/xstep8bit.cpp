// The fused ADMM x-step with 8-bit blockwise Adam moments: one pass over a flat reads p, g, the 8-bit codes of m
// and v (and z, u on the pruned slices), writes p and the codes. Two code formats, the same update:
// bitsandbytes' (below) and elsa_ds's own "minifloat" (quant8.h: MiniFloat8; arithmetic codes, no table), which
// differs only in how m and v are dequantized and quantized.
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

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "quant8.h"
#include "span8_avx512.h"

namespace elsa {

static bool g_portable_loops = false;
void use_portable_loops(bool on) { g_portable_loops = on; }
bool has_span8_avx512() {
#ifdef ELSA_SPAN8_AVX512
    return true;
#else
    return false;
#endif
}

namespace {

constexpr int64_t kBlock = 256;  // bitsandbytes' block size for optimizer states

struct Adam8Consts {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;  // as bitsandbytes passes them: python floats to fp32
    float correction2, eps, decay, step;                      // decay = 1 − lr·wd, step = −lr / c1
    float inv_correction2;                                    // 1 / correction2 (the minifloat step multiplies)
    bool decayed;
};

template <class Q1_, class Q2_>
struct Flat8 {
    using Q1 = Q1_;
    using Q2 = Q2_;
    float* p; const float* g; uint8_t* c1; uint8_t* c2; float* absmax1; float* absmax2;
    const Q1_* q1; const Q2_* q2;
};

// one span of a block: the penalty (on pruned slices) and the Adam update of m, v (fp32, in the block's buffers) and p.
// Codes that decode arithmetically (minifloat) are decoded here from the flat's codes instead of from buffers a
// dequantize loop filled, and the block's new peaks are taken here too: a minifloat block is this loop and the two
// quantize loops (bitsandbytes' codes: five). The minifloat step also multiplies √v by 1/c2 where bitsandbytes
// divides by c2 (adam8bit_reference does the same for minifloat).
template <class Q1, class Q2, class ZT, class UT, bool PENALTY, bool DECAY>
void adam8_span(float* __restrict p, const float* __restrict g, const uint8_t* __restrict c1, const uint8_t* __restrict c2,
                const float absmax1, const float absmax2, float* __restrict m, float* __restrict v, const ZT* __restrict z,
                const UT* __restrict u, const float z_scale, const float u_scale, const float lam, const Adam8Consts c,
                const int64_t n, float& peak1, float& peak2) {
    constexpr bool kInline = Q1::kInlineDecode && Q2::kInlineDecode;
    float pk1 = peak1, pk2 = peak2;
#pragma omp simd reduction(max : pk1, pk2)
    for (int64_t i = 0; i < n; ++i) {
        float grad = g[i], param = p[i];
        if constexpr (PENALTY) {
            const float zi = std::is_same_v<ZT, float> ? to_float(z[i]) : to_float(z[i]) * z_scale;
            const float ui = std::is_same_v<UT, float> ? to_float(u[i]) : to_float(u[i]) * u_scale;
            grad = std::fma((param - zi) + ui, lam, grad);
        }
        float m0, v0;
        if constexpr (kInline) {
            m0 = Q1::decode(c1[i]) * absmax1;
            v0 = Q2::decode(c2[i]) * absmax2;
        } else {
            m0 = m[i];
            v0 = v[i];
        }
        const float mi = std::fma(grad, c.one_minus_beta1, m0 * c.beta1);
        const float vi = std::fma(c.one_minus_beta2 * grad, grad, v0 * c.beta2);
        const float denom = kInline ? std::sqrt(vi) * c.inv_correction2 + c.eps : std::sqrt(vi) / c.correction2 + c.eps;
        if constexpr (DECAY) param = param * c.decay;
        p[i] = param + (c.step * mi) / denom;
        m[i] = mi;
        v[i] = vi;
        if constexpr (kInline) {
            pk1 = std::max(pk1, std::fabs(mi));
            pk2 = std::max(pk2, std::fabs(vi));
        }
    }
    peak1 = pk1;
    peak2 = pk2;
}

// the block-by-block loop stalls on loads the hardware prefetcher starts too late: ask a few blocks ahead
constexpr int64_t kPrefetch = 4 * kBlock;
template <class F>
inline void prefetch_block(const F& f, int64_t b0, int64_t numel) {
    if (b0 >= numel) return;
    for (int64_t i = 0; i < kBlock; i += 16) {
        __builtin_prefetch(f.p + b0 + i, 1);
        __builtin_prefetch(f.g + b0 + i, 0);
    }
    for (int64_t i = 0; i < kBlock; i += 64) {
        __builtin_prefetch(f.c1 + b0 + i, 1);
        __builtin_prefetch(f.c2 + b0 + i, 1);
    }
}

// z and u of the same block (read on pruned slices; their lines over the flat, like p's: fp8 z 4 lines, bf16 u 8)
template <class ZT, class UT>
inline void prefetch_zu(const ZT* z, const UT* u, int64_t b0, int64_t numel) {
    if (b0 >= numel) return;
    for (int64_t i = 0; i < kBlock; i += 64 / int64_t(sizeof(ZT))) __builtin_prefetch(z + b0 + i, 0);
    for (int64_t i = 0; i < kBlock; i += 64 / int64_t(sizeof(UT))) __builtin_prefetch(u + b0 + i, 0);
}

inline float block_absmax(const float* x, int64_t n) {
    float peak = 0.0f;
#pragma omp simd reduction(max : peak)
    for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(x[i]));
    return peak;
}

// one block [b0, b0 + n): dequantize, step every piece it overlaps, re-quantize
template <class ZT, class UT, class F>
void adam8_block(const F& f, const ZT* z, const UT* u, const float* zs, const float* us, float lam,
                 const Adam8Consts& c, int64_t b0, int64_t n, const Piece* pieces, int64_t n_pieces) {
    using Q1 = typename F::Q1;
    using Q2 = typename F::Q2;
    constexpr bool kInline = Q1::kInlineDecode && Q2::kInlineDecode;
    alignas(64) float m[kBlock], v[kBlock];
    const int64_t block = b0 / kBlock;
    const float absmax1 = f.absmax1[block], absmax2 = f.absmax2[block];
    float peak1 = 0.0f, peak2 = 0.0f;
    if constexpr (!kInline) {
        f.q1->dequantize(f.c1 + b0, absmax1, m, n);
        f.q2->dequantize(f.c2 + b0, absmax2, v, n);
    }
    for (int64_t k = 0; k < n_pieces; ++k) {
        const int64_t lo = std::max(pieces[k].begin, b0), hi = std::min(pieces[k].end, b0 + n);
        if (lo >= hi) continue;
        const int64_t j = pieces[k].slice, at = lo - b0;
        const bool penalty = j >= 0 && lam != 0.0f;
        auto run = [&](auto pen, auto decay) {
            constexpr bool P = decltype(pen)::value, D = decltype(decay)::value;
            const ZT* zp = penalty ? z + lo : z;
            const UT* up = penalty ? u + lo : u;
            const float zsj = penalty ? zs[j] : 1.0f, usj = penalty ? us[j] : 1.0f;
#ifdef ELSA_SPAN8_AVX512
            if (!g_portable_loops) {
                if (kInline && span8::fp16_scales_exact(std::is_same_v<ZT, Fp8> ? zsj : 1.0f, absmax1, absmax2))
                    span8::adam8_span<Q1, Q2, ZT, UT, P, D, kInline>(f.p + lo, f.g + lo, f.c1 + lo, f.c2 + lo, absmax1, absmax2,
                                                                     m + at, v + at, zp, up, zsj, usj, lam, c, hi - lo, peak1, peak2);
                else
                    span8::adam8_span<Q1, Q2, ZT, UT, P, D, false>(f.p + lo, f.g + lo, f.c1 + lo, f.c2 + lo, absmax1, absmax2,
                                                                   m + at, v + at, zp, up, zsj, usj, lam, c, hi - lo, peak1, peak2);
                return;
            }
#endif
            adam8_span<Q1, Q2, ZT, UT, P, D>(f.p + lo, f.g + lo, f.c1 + lo, f.c2 + lo, absmax1, absmax2, m + at, v + at, zp, up,
                                             zsj, usj, lam, c, hi - lo, peak1, peak2);
        };
        if (penalty) {
            if (c.decayed) run(std::true_type{}, std::true_type{});
            else run(std::true_type{}, std::false_type{});
        } else {
            if (c.decayed) run(std::false_type{}, std::true_type{});
            else run(std::false_type{}, std::false_type{});
        }
    }
    if constexpr (!kInline) {
        peak1 = block_absmax(m, n);
        peak2 = block_absmax(v, n);
    }
    f.absmax1[block] = peak1;
    f.absmax2[block] = peak2;
    f.q1->quantize(m, f.absmax1[block], f.c1 + b0, n);
    f.q2->quantize(v, f.absmax2[block], f.c2 + b0, n);
}

template <class ZT, class UT, class F>
void adam8_flat(const F& f, int64_t numel, const ZU& zu, const Slices& slices, float lam, const Adam8Consts& c) {
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
    const bool with_zu = slices.count > 0 && z != nullptr && u != nullptr && lam != 0.0f;
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
        const Piece* pieces = plan.data() + first[k];
        const int64_t n_pieces = first[k + 1] - first[k];
        const int64_t begin = pieces[0].begin, end = pieces[n_pieces - 1].end;
        for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
            prefetch_block(f, b0 + kPrefetch, numel);
            if (with_zu) prefetch_zu(z, u, b0 + kPrefetch, numel);
            adam8_block<ZT, UT>(f, z, u, zu.z_scale, zu.u_scale, lam, c, b0, std::min(kBlock, end - b0), pieces, n_pieces);
        }
    }
}

}  // namespace

void adam8bit_step(float* p, const float* g, const Adam8State& st, int64_t n, const ZU& zu, const Slices& slices, float lam,
                   const Adam8Hyper& h) {
    // bitsandbytes computes these scalars in Python (double) and torch casts them to fp32
    const double c1 = 1.0 - std::pow(h.beta1, double(h.step)), c2 = std::sqrt(1.0 - std::pow(h.beta2, double(h.step)));
    const Adam8Consts c{float(h.beta1), float(1.0 - h.beta1), float(h.beta2), float(1.0 - h.beta2), float(c2), float(h.eps),
                        float(1.0 - h.lr * h.weight_decay), float(-h.lr / c1), 1.0f / float(c2), h.weight_decay > 0.0};
    auto run = [&](const auto& f) {
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
    };
    if (st.format == Adam8Format::kMiniFloat) {
        const MiniFloatM q1;
        const MiniFloatV q2;
        run(Flat8<MiniFloatM, MiniFloatV>{p, g, st.state1, st.state2, st.absmax1, st.absmax2, &q1, &q2});
    } else {
        const Quantizer8 q1(st.qmap1), q2(st.qmap2);
        run(Flat8<Quantizer8, Quantizer8>{p, g, st.state1, st.state2, st.absmax1, st.absmax2, &q1, &q2});
    }
}

}  // namespace elsa
