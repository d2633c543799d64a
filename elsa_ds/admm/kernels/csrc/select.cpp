// The passes of the fused projection Π (projection.py holds the eager reference, select_masks).
//
// Scores are never stored: every pass recomputes, per entry,
//   v = x + u (the z/u update) or v = x (initial z, final projection),
//   key = bits(|nan_to_num(F · v²)|)       (F: exp_avg_sq, bitsandbytes' 8-bit state2, or 1)
// whose integer order is the scores' order. Two histogram passes of 16-bit digits (high half, then low
// half among the entries whose high half is the threshold's) give each layer's exact threshold key T;
// the split pass then writes z = v·[key > T], u = v − z with the tied entries (key == T) kept in index
// order up to this rank's share, and counts the metrics. Each pass reads x, u, F once.
#include <omp.h>

#include <cfloat>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace elsa {
namespace {

constexpr int64_t kBins = 1 << 16;
constexpr int64_t kKeys = 1024;  // keys computed (vectorized) per batch before the scalar histogram loop

enum Fisher { kMagnitude = 0, kFp32 = 1, kBnb8 = 2 };
constexpr int kUpdate = int(SplitMode::kUpdate), kInit = int(SplitMode::kInit), kFinal = int(SplitMode::kFinal);
using Src = ScoreSource;

// one piece of one slice, as the inner loops see it: restrict pointers at the piece's first entry
template <class UT, int FK>
struct Row {
    float* __restrict x;
    const UT* __restrict u;          // kUpdate only (NoU otherwise)
    const float* __restrict f;       // kFp32
    const uint8_t* __restrict codes; // kBnb8, with its qmap and the absmax of each 256-entry block
    const float* __restrict qmap;
    const float* __restrict absmax;
    int64_t first;                   // the piece's first index in the flat (for the 8-bit blocks)
    float u_scale;

    Row(const Src& s, const Piece& pc)
        : x(s.x + pc.begin), u(nullptr), f(s.f ? s.f + pc.begin : nullptr), codes(s.f_codes ? s.f_codes + pc.begin : nullptr),
          qmap(s.f_qmap), absmax(s.f_absmax), first(pc.begin), u_scale(1.0f) {
        if constexpr (!std::is_same_v<UT, NoU>) {
            u = static_cast<const UT*>(s.u) + pc.begin;
            u_scale = s.u_scale[pc.slice];
        }
    }

    // v = x + u (as load() dequantizes u) or v = x
    inline float value(int64_t i) const {
        if constexpr (std::is_same_v<UT, NoU>) return x[i];
        else if constexpr (std::is_same_v<UT, float>) return x[i] + u[i];
        else return x[i] + to_float(u[i]) * u_scale;
    }

    // scores() in projection.py: F·v² with F clamped at 0, NaN -> 0, inf -> FLT_MAX, sign cleared
    inline uint32_t key(int64_t i, float v) const {
        float score = v * v;
        if constexpr (FK != kMagnitude) {
            float fi;
            if constexpr (FK == kFp32) fi = f[i];
            else fi = qmap[codes[i]] * absmax[(first + i) / 256];
            score = score * (fi < 0.0f ? 0.0f : fi);
        }
        score = score != score ? 0.0f : score;
        score = score == INFINITY ? FLT_MAX : score;
        return as_bits(score) & 0x7FFFFFFFu;
    }
};

// ---- histogram passes --------------------------------------------------------------------------
template <class UT, int FK>
void histogram_piece(const Row<UT, FK> r, int64_t n, int64_t prefix, int32_t* __restrict hist, float& peak) {
    alignas(64) uint32_t keys[kKeys];
    for (int64_t b = 0; b < n; b += kKeys) {
        const int64_t m = std::min(kKeys, n - b);
        float pk = peak;
#pragma omp simd reduction(max : pk)
        for (int64_t i = 0; i < m; ++i) {
            const float v = r.value(b + i);
            keys[i] = r.key(b + i, v);
            pk = std::max(pk, std::fabs(v));
        }
        peak = pk;
        if (prefix < 0) {
            for (int64_t i = 0; i < m; ++i) ++hist[keys[i] >> 16];
        } else {
            for (int64_t i = 0; i < m; ++i)
                if (int64_t(keys[i] >> 16) == prefix) ++hist[keys[i] & 0xFFFFu];
        }
    }
}

template <class UT, int FK>
void histogram(const Src& s, const std::vector<Piece>& plan, const int64_t* prefix, int64_t n_slices, int32_t* out,
               float* peaks) {
    const int threads = omp_get_max_threads();
    std::vector<int32_t> local(size_t(threads) * n_slices * kBins, 0);
    std::vector<float> local_peak(size_t(threads) * n_slices, 0.0f);
    const int64_t pieces = int64_t(plan.size());
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < pieces; ++k) {
        const Piece& pc = plan[k];
        const size_t slot = size_t(omp_get_thread_num()) * n_slices + pc.slice;
        const int64_t p = prefix ? prefix[pc.slice] : -1;
        if (prefix && p < 0) continue;  // a layer that keeps nothing needs no second digit
        histogram_piece<UT, FK>(Row<UT, FK>(s, pc), pc.end - pc.begin, p, local.data() + slot * kBins, local_peak[slot]);
    }
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < n_slices * kBins; ++e) {
        int32_t sum = 0;
        for (int t = 0; t < threads; ++t) sum += local[size_t(t) * n_slices * kBins + e];
        out[e] = sum;
    }
    for (int64_t j = 0; j < n_slices; ++j) {
        float pk = 0.0f;
        for (int t = 0; t < threads; ++t) pk = std::max(pk, local_peak[size_t(t) * n_slices + j]);
        peaks[j] = pk;
    }
}

// ---- the split pass ----------------------------------------------------------------------------
struct Dest {
    void* z;
    const float* z_scale_old;
    const float* z_scale;  // new scales: fp8 stores clamp(value / s, ±448)
    void* u;
    const float* u_scale;
};

template <class T>
inline T store_as(float value, float scale) {
    if constexpr (std::is_same_v<T, Fp8>) {
        float q = value / scale;
        q = std::min(std::max(q, -storage_max<T>()), storage_max<T>());
        return from_float<Fp8>(q);
    } else {
        return from_float<T>(value);  // fp32 and bf16 are stored plainly
    }
}

struct Tally {
    double residual_sq = 0.0, x_sq = 0.0;
    int64_t flips = 0, ties = 0;
};

// z and u (or x) of one piece; ALL: every entry is decided (the tie pass), else ties are skipped
template <class ZT, class UT, int FK, int MODE, bool ALL>
struct Splitter {
    using VT = std::conditional_t<MODE == kUpdate, UT, NoU>;
    Row<VT, FK> r;
    ZT* __restrict z;
    UT* __restrict u;
    float z_scale_old, z_scale, u_scale;
    uint32_t threshold;

    Splitter(const Src& s, const Dest& d, const Piece& pc, uint32_t th)
        : r(s, pc), z(static_cast<ZT*>(d.z) + pc.begin), u(nullptr), z_scale_old(d.z_scale_old[pc.slice]),
          z_scale(d.z_scale[pc.slice]), u_scale(d.u_scale[pc.slice]), threshold(th) {
        if constexpr (MODE == kUpdate) u = static_cast<UT*>(d.u) + pc.begin;
    }

    // entry i: kept if its key beats the threshold (or, for a tie, if `tie_kept`); skip = leave untouched
    inline void entry(int64_t i, float v, bool keep, bool skip, Tally& t) const {
        const float mask = keep ? 1.0f : 0.0f;
        const float zn = v * mask;  // v · mask as in the eager z = v * mask (−0.0 for a dropped negative)
        const ZT z_old = z[i];
        if constexpr (MODE == kUpdate) {
            const float x = r.x[i];
            const float zo = std::is_same_v<ZT, float> ? to_float(z_old) : to_float(z_old) * z_scale_old;
            z[i] = skip ? z_old : store_as<ZT>(zn, z_scale);
            u[i] = skip ? u[i] : store_as<UT>(v - zn, u_scale);
            const float res = (x - zn) * (x - zn), xx = x * x;
            t.residual_sq += skip ? 0.0 : double(res);
            t.x_sq += skip ? 0.0 : double(xx);
            t.flips += (!skip && keep != (zo != 0.0f)) ? 1 : 0;
        } else {
            if constexpr (MODE == kFinal) r.x[i] = skip ? r.x[i] : zn;  // x ← x ⊙ mask
            z[i] = skip ? z_old : store_as<ZT>(zn, z_scale);
        }
    }
};

template <class ZT, class UT, int FK, int MODE>
void split_piece(const Src& s, const Dest& d, const Piece& pc, uint32_t threshold, Tally& t) {
    const Splitter<ZT, UT, FK, MODE, false> sp(s, d, pc, threshold);
    const int64_t n = pc.end - pc.begin;
    double res = 0.0, xsq = 0.0;
    int64_t flips = 0, ties = 0;
#pragma omp simd reduction(+ : res, xsq, flips, ties)
    for (int64_t i = 0; i < n; ++i) {
        const float v = sp.r.value(i);
        const uint32_t key = sp.r.key(i, v);
        Tally e;
        sp.entry(i, v, key > threshold, key == threshold, e);
        res += e.residual_sq;
        xsq += e.x_sq;
        flips += e.flips;
        ties += key == threshold ? 1 : 0;
    }
    t.residual_sq += res;
    t.x_sq += xsq;
    t.flips += flips;
    t.ties += ties;
}

// the tied entries of one piece, in index order: this rank's ties number `rank` on, the first `take` kept
template <class ZT, class UT, int FK, int MODE>
void split_ties(const Src& s, const Dest& d, const Piece& pc, uint32_t threshold, int64_t rank, int64_t take, Tally& t) {
    const Splitter<ZT, UT, FK, MODE, true> sp(s, d, pc, threshold);
    for (int64_t i = 0; i < pc.end - pc.begin; ++i) {
        const float v = sp.r.value(i);
        if (sp.r.key(i, v) == threshold) sp.entry(i, v, rank++ < take, false, t);
    }
}

template <class ZT, class UT, int FK, int MODE>
void split(const Src& s, const Dest& d, const std::vector<Piece>& plan, const int64_t* threshold, const int64_t* take,
           int64_t n_slices, double* metrics, int64_t* ties_out) {
    const int64_t pieces = int64_t(plan.size());
    std::vector<Tally> per_piece(pieces), tallies(omp_get_max_threads());
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < pieces; ++k)
        split_piece<ZT, UT, FK, MODE>(s, d, plan[k], uint32_t(threshold[plan[k].slice]), per_piece[k]);
    // this rank's ties before each piece, per slice, in index order
    std::vector<int64_t> rank(pieces, 0), seen(n_slices, 0);
    for (int64_t k = 0; k < pieces; ++k) {
        rank[k] = seen[plan[k].slice];
        seen[plan[k].slice] += per_piece[k].ties;
    }
#pragma omp parallel for schedule(dynamic)
    for (int64_t k = 0; k < pieces; ++k)
        if (per_piece[k].ties)
            split_ties<ZT, UT, FK, MODE>(s, d, plan[k], uint32_t(threshold[plan[k].slice]), rank[k], take[plan[k].slice],
                                         per_piece[k]);
    for (const Tally& t : per_piece) {
        metrics[0] += t.residual_sq;
        metrics[1] += t.x_sq;
        metrics[2] += double(t.flips);
    }
    for (int64_t j = 0; j < n_slices; ++j) ties_out[j] = seen[j];
}

// ---- dispatch ----------------------------------------------------------------------------------
template <class F>
void with_fisher(const Src& s, F&& f) {
    if (s.f) return f(std::integral_constant<int, kFp32>{});
    if (s.f_codes) return f(std::integral_constant<int, kBnb8>{});
    return f(std::integral_constant<int, kMagnitude>{});
}

}  // namespace

void select_histogram(const ScoreSource& src, int64_t n, const Slices& slices, const int64_t* prefix, int32_t* hist,
                      float* peaks) {
    const auto plan = make_plan(slices, n, /*with_gaps=*/false);
    with_storage(src.u ? src.u_type : Storage::kNone, [&](auto ut) {
        with_fisher(src, [&](auto fk) { histogram<decltype(ut), decltype(fk)::value>(src, plan, prefix, slices.count, hist, peaks); });
    });
}

void select_split(const ScoreSource& src, int64_t n, const Slices& slices, void* z, Storage z_type, const float* z_scale_old,
                  const float* z_scale, void* u, Storage u_type, const float* u_scale, const int64_t* threshold,
                  const int64_t* take, SplitMode mode, double* metrics, int64_t* ties) {
    const auto plan = make_plan(slices, n, /*with_gaps=*/false);
    const Dest d{z, z_scale_old, z_scale, u, u_scale};
    with_storage(z_type, [&](auto zt) {
        using ZT = decltype(zt);
        if constexpr (!std::is_same_v<ZT, NoU>) {
            with_fisher(src, [&](auto fk) {
                constexpr int FK = decltype(fk)::value;
                auto run = [&](auto ut, auto md) {
                    split<ZT, decltype(ut), FK, decltype(md)::value>(src, d, plan, threshold, take, slices.count, metrics, ties);
                };
                if (mode == SplitMode::kUpdate) {
                    with_storage(u_type, [&](auto ut) {
                        if constexpr (!std::is_same_v<decltype(ut), NoU>) run(ut, std::integral_constant<int, kUpdate>{});
                    });
                } else if (mode == SplitMode::kInit) {
                    run(float{}, std::integral_constant<int, kInit>{});
                } else {
                    run(float{}, std::integral_constant<int, kFinal>{});
                }
            });
        }
    });
}

}  // namespace elsa
