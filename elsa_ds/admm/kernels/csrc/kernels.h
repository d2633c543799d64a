// The fused ADMM kernels' C++ interface: raw pointers and plain structs, no torch headers, so the kernel
// translation units compile in seconds; bindings.cpp checks tensors and calls these.
#pragma once

#include <cstdint>
#include <functional>

#include "numerics.h"
#include "plan.h"

namespace elsa {

enum class Storage : int { kNone = 0, kFp32 = 1, kBf16 = 2, kFp8 = 3 };

// DeepSpeed's SIMD_WIDTH for cpu_adam on this CPU (its op builder: __AVX512__ where the CPU has AVX-512, 16 floats;
// __AVX256__ with AVX2, 8); 0: a CPU whose DeepSpeedCPUAdam the fused x-step does not reproduce (aarch64 NEON/SVE,
// x86 without AVX2: fused.py keeps DeepSpeedCPUAdam on the eager path there)
#if defined(__AVX512F__)
constexpr int64_t kDeepSpeedAdamSimdWidth = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kDeepSpeedAdamSimdWidth = 8;
#else
constexpr int64_t kDeepSpeedAdamSimdWidth = 0;
#endif

struct NoU {};  // "no u": the projection of x alone

// call f with a value of the element type a Storage holds (NoU for kNone)
template <class F>
void with_storage(Storage s, F&& f) {
    switch (s) {
        case Storage::kFp32: return f(float{});
        case Storage::kBf16: return f(Bf16{});
        case Storage::kFp8: return f(Fp8{});
        default: return f(NoU{});
    }
}

// z and u of one flat as stored (any Storage), with their per-slice scales
struct ZU {
    void* z;
    Storage z_type;
    void* u;
    Storage u_type;
    const float* z_scale;
    const float* u_scale;
};

// DeepSpeedCPUAdam's hyper-parameters for one step (bias corrections as DeepSpeed computes them)
struct AdamHyper {
    double lr, beta1, beta2, eps, weight_decay;
    bool adamw;
    double bias_correction1, bias_correction2;  // 1 − β1^t and 1/sqrt(1 − β2^t), in DeepSpeed's float arithmetic
};

// 8-bit Adam's hyper-parameters and its blockwise state
struct Adam8Hyper {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
};
// the 8-bit moments' code format: bitsandbytes' dynamic maps (qmap1/qmap2 read), or elsa_ds's minifloat (quant8.h)
enum class Adam8Format : int { kBitsandbytes = 0, kMiniFloat = 1 };
struct Adam8State {
    Adam8Format format;
    uint8_t* state1;
    uint8_t* state2;
    const float* qmap1;
    const float* qmap2;
    float* absmax1;
    float* absmax2;
};

// x ← Adam(x, g + λ((x − z) + u) on the slices, g elsewhere), m and v updated in place
void adam_step(float* p, const float* g, float* m, float* v, int64_t n, const ZU& zu, const Slices& slices, float lam,
               const AdamHyper& h);
void adam8bit_step(float* p, const float* g, const Adam8State& st, int64_t n, const ZU& zu, const Slices& slices, float lam,
                   const Adam8Hyper& h);
// the 8-bit x-step's hand-written AVX-512 loop off (true) or on (false, the default where it is compiled): the
// portable element loop it reproduces then runs, so tests can hold one to the other on an AVX-512 machine
void use_portable_loops(bool on);
bool has_span8_avx512();

// where the projection reads its scores: v = x + u (u may be absent), F = fp32, 8-bit (bnb) or none
struct ScoreSource {
    float* x;
    const void* u;
    Storage u_type;
    const float* u_scale;
    const float* f;          // exp_avg_sq, or null
    const uint8_t* f_codes;  // bitsandbytes' state2, or null
    const float* f_qmap;
    const float* f_absmax;
};

enum class SplitMode : int { kUpdate = 0, kInit = 1, kFinal = 2 };

// per slice: a 65536-bin histogram of the scores' high 16 key bits (prefix == null), or of the low 16
// bits of the keys whose high half equals prefix[j]; and each slice's peak |v|
// (stride > 1: the high-half histogram of a sample, one block of 256 entries at a pseudo-random place in
// every stride·256 entries of the flat; peaks are then left at 0)
void select_histogram(const ScoreSource& src, int64_t n, const Slices& slices, const int64_t* prefix, int64_t stride,
                      int32_t* hist, float* peaks);
// per slice: counts[2j] = keys above hi[j], counts[2j+1] = keys in [lo[j], hi[j]] (none when lo > hi; the
// peak is still found); the in-bracket keys themselves (grouped by slice, found[j] each, in index order, unless
// overflow[j]: more than 1/4 of a piece), written where keys_out(total) says, and their high halves' histogram
// (high_hist, [slices, 65536], overwritten; an overflowed slice's is partial); peaks[j] = peak |v|
void select_bracket(const ScoreSource& src, int64_t n, const Slices& slices, const int64_t* lo, const int64_t* hi, int64_t* counts,
                    float* peaks, int64_t* found, bool* overflow, const std::function<int32_t*(int64_t)>& keys_out,
                    int32_t* high_hist);
// per slice j with prefix[j] >= 0: the histogram (hist, zeroed, [slices, 65536]) of the low halves of its keys
// (keys grouped by slice, found[j] each) whose high half is prefix[j]
void select_key_histogram(const int32_t* keys, const int64_t* found, int64_t n_slices, const int64_t* prefix, int32_t* hist);
// per row r of hist ([rows, bins], counts): the sum of its counts
void select_row_totals(const int32_t* hist, int64_t rows, int64_t bins, int64_t* totals);
// per row r of hist ([rows, bins], counts): the first bin, in scan order (ascending bins, or descending when from_top),
// at which the running sum of counts exceeds target[r] (right) or reaches it (!right), as a scan position clamped at
// bins - 1 (torch.searchsorted on the row's cumsum, flipped first when from_top); cum[r]: the running sum there
void select_cum_search(const int32_t* hist, int64_t rows, int64_t bins, const int64_t* target, bool from_top, bool right,
                       int64_t* index, int64_t* cum);
// z, u (or x) from the threshold keys; of slice j's entries equal to its threshold (this rank's ties), the
// first take[j] in index order are kept; metrics[0..2] += residual², x², flips; ties_seen[j]: the ties met
// (the caller holds them to the histogram's count)
void select_split(const ScoreSource& src, int64_t n, const Slices& slices, void* z, Storage z_type, const float* z_scale_old,
                  const float* z_scale, void* u, Storage u_type, const float* u_scale, const int64_t* threshold,
                  const int64_t* take, SplitMode mode, double* metrics, int64_t* ties_seen);

}  // namespace elsa
