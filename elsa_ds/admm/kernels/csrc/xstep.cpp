// The fused ADMM x-step with fp32 Adam moments: one pass over a flat reads p, g, m, v (and z, u on
// the pruned slices) and writes p, m, v.
//
//   g' = g + λ ((x − z) + u)                        on pruned slices (z, u dequantized in registers)
//   DeepSpeedCPUAdam's update on g'                  everywhere (cpu_adam.h, Step_AVX / Step_1)
//
// The Adam arithmetic is DeepSpeed's, operation for operation: fused multiply-adds where its SIMD body
// has them, and for the scalar tail (the last numel % SIMD_WIDTH entries of a flat: 16 with AVX-512, 8 with
// AVX2) the ones GCC's default fp contraction gives its Step_1 loop; the bias corrections come from the
// caller exactly as DeepSpeed computes them (kernels/xstep.py). Tests hold the kernel to DeepSpeedCPUAdam bit
// for bit.
#include <omp.h>

#include <type_traits>

#include "kernels.h"

namespace elsa {
namespace {

enum Decay { kNoDecay = 0, kL2 = 1, kAdamW = 2 };

struct AdamConsts {
    float beta1, beta2, one_minus_beta1, one_minus_beta2;
    float eps, bias2, step_size;     // bias2 = 1/sqrt(1 − β2^t), step_size = −lr / (1 − β1^t)
    float weight_decay, decay_step;  // decay_step = −lr·wd (AdamW)
    int decay;
};

// DeepSpeed's per-entry update: cpu_adam.h Step_AVX (TAIL: cpu_adam_impl.cpp Step_1's scalar loop)
template <int DECAY, bool TAIL>
inline float adam_update(float param, float grad, float& m, float& v, const AdamConsts c) {
    if constexpr (DECAY == kL2) grad = std::fma(param, c.weight_decay, grad);
    const float g2 = grad * grad;
    if constexpr (TAIL) {  // m = m·β1 + g·(1 − β1) contracted the other way round
        m = std::fma(m, c.beta1, grad * c.one_minus_beta1);
        v = std::fma(v, c.beta2, g2 * c.one_minus_beta2);
    } else {
        m = std::fma(grad, c.one_minus_beta1, m * c.beta1);
        v = std::fma(g2, c.one_minus_beta2, v * c.beta2);
    }
    const float update = m / std::fma(std::sqrt(v), c.bias2, c.eps);
    if constexpr (DECAY == kAdamW) param = std::fma(param, c.decay_step, param);
    return std::fma(update, c.step_size, param);
}

// one piece [begin, end) of a flat; PENALTY on a pruned slice, with its z/u scales
template <class ZT, class UT, bool PENALTY, int DECAY, bool TAIL>
void adam_piece(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                const ZT* __restrict z, const UT* __restrict u, const float z_scale, const float u_scale, const float lam,
                const AdamConsts c, const int64_t begin, const int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        float grad = g[i], mi = m[i], vi = v[i];
        if constexpr (PENALTY) {
            // eager: grad.add_((x − z) + u, alpha=λ) with z = stored·s_z, u = stored·s_u (fp32: as stored)
            const float zi = std::is_same_v<ZT, float> ? to_float(z[i]) : to_float(z[i]) * z_scale;
            const float ui = std::is_same_v<UT, float> ? to_float(u[i]) : to_float(u[i]) * u_scale;
            grad = std::fma((p[i] - zi) + ui, lam, grad);
        }
        p[i] = adam_update<DECAY, TAIL>(p[i], grad, mi, vi, c);
        m[i] = mi;
        v[i] = vi;
    }
}

template <class ZT, class UT, bool PENALTY, int DECAY>
void adam_span(float* p, const float* g, float* m, float* v, const ZT* z, const UT* u, float sz, float su, float lam,
               const AdamConsts& c, int64_t begin, int64_t mid, int64_t end) {
    adam_piece<ZT, UT, PENALTY, DECAY, false>(p, g, m, v, z, u, sz, su, lam, c, begin, mid);
    adam_piece<ZT, UT, PENALTY, DECAY, true>(p, g, m, v, z, u, sz, su, lam, c, mid, end);
}

template <class ZT, class UT>
void adam_flat(float* p, const float* g, float* m, float* v, int64_t n, const ZU& zu, const Slices& slices, float lam,
               const AdamConsts& c) {
    // where DeepSpeed's vector body ends and its scalar tail starts (kernels.h: its SIMD width on this CPU; 0 never
    // reaches here, fused.py keeps such CPUs on the eager path)
    const int64_t simd_end = n - n % std::max<int64_t>(kDeepSpeedAdamSimdWidth, 1);
    const auto plan = make_plan(slices, n, /*with_gaps=*/true);
    const ZT* z = static_cast<const ZT*>(zu.z);
    const UT* u = static_cast<const UT*>(zu.u);
    const int64_t pieces = int64_t(plan.size());
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < pieces; ++k) {
        const Piece& pc = plan[k];
        const int64_t mid = std::clamp(simd_end, pc.begin, pc.end);
        const bool penalty = pc.slice >= 0 && lam != 0.0f;
        const float sz = penalty ? zu.z_scale[pc.slice] : 1.0f, su = penalty ? zu.u_scale[pc.slice] : 1.0f;
        auto run = [&](auto pen, auto decay) {
            adam_span<ZT, UT, decltype(pen)::value, decltype(decay)::value>(p, g, m, v, z, u, sz, su, lam, c, pc.begin, mid, pc.end);
        };
        auto with_decay = [&](auto pen) {
            if (c.decay == kL2) run(pen, std::integral_constant<int, kL2>{});
            else if (c.decay == kAdamW) run(pen, std::integral_constant<int, kAdamW>{});
            else run(pen, std::integral_constant<int, kNoDecay>{});
        };
        if (penalty) with_decay(std::true_type{});
        else with_decay(std::false_type{});
    }
}

}  // namespace

void adam_step(float* p, const float* g, float* m, float* v, int64_t n, const ZU& zu, const Slices& slices, float lam,
               const AdamHyper& h) {
    AdamConsts c;
    // float arithmetic exactly as DeepSpeed's Step_AVX sets its constants up
    c.beta1 = float(h.beta1);
    c.beta2 = float(h.beta2);
    c.one_minus_beta1 = 1.0f - c.beta1;
    c.one_minus_beta2 = 1.0f - c.beta2;
    c.eps = float(h.eps);
    c.bias2 = float(h.bias_correction2);
    c.step_size = -1.0f * float(h.lr) / float(h.bias_correction1);
    c.weight_decay = float(h.weight_decay);
    c.decay_step = -1.0f * float(h.lr) * c.weight_decay;
    c.decay = c.weight_decay > 0.0f ? (h.adamw ? kAdamW : kL2) : kNoDecay;
    with_storage(zu.z_type, [&](auto zt) {
        with_storage(zu.u_type, [&](auto ut) {
            using ZT = decltype(zt);
            using UT = decltype(ut);
            if constexpr (!std::is_same_v<ZT, NoU> && !std::is_same_v<UT, NoU>)
                adam_flat<ZT, UT>(p, g, m, v, n, zu, slices, lam, c);
            else  // no z/u (no slices): plain DeepSpeed Adam
                adam_flat<float, float>(p, g, m, v, n, zu, Slices{nullptr, nullptr, 0}, 0.0f, c);
        });
    });
}

}  // namespace elsa
