// The passes of the fused projection Π (projection.py holds the eager reference, select_masks).
//
// Scores are never stored: every pass recomputes, per entry,
//   v = x + u (the z/u update) or v = x (initial z, final projection),
//   key = bits(|nan_to_num(F · v²)|)       (F: exp_avg_sq, bitsandbytes' 8-bit state2, or 1)
// whose integer order is the scores' order. An 8-bit F's block scale (absmax, one per 256 entries) is read once per
// block (keys_of: the inner loops run per block with it broadcast), and minifloat codes (quant8.h) are decoded by
// their arithmetic rather than read from the 256-entry map: the same fp32 values, bit for bit (is_minifloat_map). Two histogram passes of 16-bit digits (high half, then low
// half among the entries whose high half is the threshold's) give each layer's exact threshold key T;
// the split pass then writes z = v·[key > T], u = v − z with the tied entries (key == T) kept in index
// order up to this rank's share, and counts the metrics. Each pass reads x, u, F once.
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cfloat>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "quant8.h"

namespace elsa {
namespace {

constexpr int64_t kBins = 1 << 16;
constexpr int64_t kKeys = 1024;  // keys computed (vectorized) per batch before the scalar histogram loop
constexpr int64_t kSample = 256;  // entries per sampled block (select_histogram with stride > 1)

enum Fisher { kMagnitude = 0, kFp32 = 1, kBnb8 = 2, kMini8 = 3 };  // kMini8: 8-bit codes of minifloat V
constexpr int64_t kCodeBlock = 256;  // entries per absmax of the 8-bit F
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

    // the x, u and fp32 F lines that value(i) and key(i) read (8-bit F: prefetch_codes)
    inline void prefetch(int64_t i) const {
        __builtin_prefetch(x + i);
        if constexpr (!std::is_same_v<UT, NoU>) __builtin_prefetch(u + i);
        if constexpr (FK == kFp32) __builtin_prefetch(f + i);
    }

    // the 8-bit F's lines from entry i on: its codes (one byte per entry, 64 to a line) and its block's absmax
    inline void prefetch_codes(int64_t i) const {
        if constexpr (FK == kBnb8 || FK == kMini8) {
            __builtin_prefetch(codes + i);
            __builtin_prefetch(absmax + (first + i) / 256);
        }
    }

    // scores() in projection.py: F·v² with F clamped at 0, NaN -> 0, inf -> FLT_MAX, sign cleared; block_absmax: the
    // absmax of entry i's 8-bit block (8-bit F only)
    inline uint32_t key(int64_t i, float v, float block_absmax) const {
        float score = v * v;
        if constexpr (FK != kMagnitude) {
            float fi;
            if constexpr (FK == kFp32) fi = f[i];
            else if constexpr (FK == kBnb8) fi = qmap[codes[i]] * block_absmax;
            else fi = MiniFloatV::decode(codes[i]) * block_absmax;
            score = score * (fi < 0.0f ? 0.0f : fi);
        }
        score = score != score ? 0.0f : score;
        score = score == INFINITY ? FLT_MAX : score;
        return as_bits(score) & 0x7FFFFFFFu;
    }
};

// keys of a row's entries [b, b + m) into keys[0, m), their values v = value_of(i) into values[0, m) (when VALUES), and
// the peak |v| from `peak` on (returned): one vectorized loop per run of entries that share an 8-bit block (its absmax
// broadcast), one loop in all otherwise
template <bool VALUES, class UT, int FK, class V>
inline float keys_of(const Row<UT, FK>& r, const V& value_of, int64_t b, int64_t m, float* __restrict values,
                     uint32_t* __restrict keys, float peak = 0.0f) {
    for (int64_t s = 0; s < m;) {
        int64_t e = m;
        float am = 0.0f;
        if constexpr (FK == kBnb8 || FK == kMini8) {
            const int64_t block = (r.first + b + s) / kCodeBlock;
            e = std::min(m, (block + 1) * kCodeBlock - r.first - b);
            am = r.absmax[block];
        }
        float pk = peak;
#pragma omp simd reduction(max : pk)
        for (int64_t i = s; i < e; ++i) {
            const float v = value_of(b + i);
            if constexpr (VALUES) values[i] = v;
            keys[i] = r.key(b + i, v, am);
            pk = std::max(pk, std::fabs(v));
        }
        peak = pk;
        s = e;
    }
    return peak;
}

// ---- histogram passes --------------------------------------------------------------------------
// the keys of keys[0, m) in [lo, hi], packed to the front of keys (in order); how many
inline int64_t pack_inside(uint32_t* keys, int64_t m, uint32_t lo, uint32_t hi) {
    int64_t found = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i vlo = _mm512_set1_epi32(int(lo)), vhi = _mm512_set1_epi32(int(hi));
    for (; i + 16 <= m; i += 16) {
        const __m512i k = _mm512_loadu_si512(keys + i);
        const __mmask16 hit = _mm512_cmpge_epu32_mask(k, vlo) & _mm512_cmple_epu32_mask(k, vhi);
        // compress in a register, then a full store (found <= i: lanes past the hits land on keys already read);
        // a compress straight to memory is microcoded and slow on AMD Zen 4. No branch on an empty mask: with a
        // few % of keys inside, a third of the vectors hold one, and the mispredictions cost more than the stores
        _mm512_storeu_si512(keys + found, _mm512_maskz_compress_epi32(hit, k));
        found += __builtin_popcount(hit);
    }
#endif
    for (; i < m; ++i) {  // branch-free: found <= i, so the write never overtakes the read
        const uint32_t k = keys[i];
        keys[found] = k;
        found += (k >= lo) & (k <= hi);
    }
    return found;
}

template <class UT, int FK>
__attribute__((noinline)) void histogram_piece(const Row<UT, FK> r, int64_t n, int64_t prefix, int32_t* __restrict hist, float& peak) {
    alignas(64) uint32_t keys[kKeys];
    for (int64_t b = 0; b < n; b += kKeys) {
        const int64_t m = std::min(kKeys, n - b);
        peak = keys_of<false>(r, [&](int64_t i) { return r.value(i); }, b, m, nullptr, keys, peak);
        if (prefix < 0) {
            for (int64_t i = 0; i < m; ++i) ++hist[keys[i] >> 16];
        } else {
            const uint32_t lo = uint32_t(prefix) << 16;  // the keys whose high half is prefix: few, T's bin only
            const int64_t found = pack_inside(keys, m, lo, lo | 0xFFFFu);
            for (int64_t i = 0; i < found; ++i) ++hist[keys[i] & 0xFFFFu];
        }
    }
}

// the sample: in every window of stride·kSample entries (windows counted from the flat's start, so a sample
// does not depend on how the flat is cut into pieces), the kSample entries of one block at a pseudo-random
// position; blocks are short and scattered so rows and columns of a weight are sampled evenly
template <class UT, int FK>
__attribute__((noinline)) void sample_piece(const Row<UT, FK> r, int64_t n, int64_t stride, int32_t* __restrict hist) {
    const int64_t window = stride * kSample;
    alignas(64) uint32_t keys[kSample];
    const auto start_of = [&](int64_t w) {
        const uint64_t h = uint64_t(w) * 0x9E3779B97F4A7C15ull;
        return w * window + int64_t((h >> 32) % uint64_t(stride)) * kSample - r.first;
    };
    for (int64_t w = r.first / window; w * window < r.first + n; ++w) {
        const int64_t start = start_of(w);
        const int64_t b = std::max<int64_t>(start, 0), e = std::min(start + kSample, n);
        if (const int64_t next = start_of(w + 1); next >= 0 && next + kSample <= n) {
            // the next block's lines, requested now: blocks are 1 KiB apart by 15 KiB, too short for the hardware
            // prefetcher to lock on, so without this every block waits on DRAM latency
            for (int64_t i = next; i < next + kSample; i += 16) {
                r.prefetch(i);
                if (((i - next) & 63) == 0) r.prefetch_codes(i);
            }
        }
        if (b >= e) continue;
        // (one 8-bit block: windows and blocks are 256-aligned)
        keys_of<false>(r, [&](int64_t i) { return r.value(i); }, b, e - b, nullptr, keys);
        for (int64_t i = 0; i < e - b; ++i) ++hist[keys[i] >> 16];
    }
}

// The pieces are cut into one contiguous range per thread; a range keeps one 2^16-bin block per slice it meets (pieces
// of a slice are adjacent in the plan, so it meets each of its slices once, in one run), then every output bin sums
// the blocks that cover its slice. Memory and reduction are ~(slices + threads) blocks: one block per thread per slice
// (threads x slices x 256 KiB, zeroed by the calling thread) made the sample pass cost 2.7 ms on 2 threads and 28 ms
// on 16 (a 32M flat of 8 slices), and grow with every slice a flat holds. The blocks are allocated before the parallel
// region (a failed allocation is then an exception the caller sees) and zeroed inside it, by the thread that fills them.
template <class UT, int FK>
void histogram(const Src& s, const std::vector<Piece>& plan, const int64_t* prefix, int64_t stride, int64_t n_slices,
               int32_t* out, float* peaks) {
    struct Block {
        int64_t slice;
        int32_t* bins;
        float peak;
    };
    const int64_t ranges = omp_get_max_threads(), pieces = int64_t(plan.size());
    const auto first = [&](int64_t r) { return pieces * r / ranges; };
    // piece k opens a block of range r: the range's first piece, or the first of another slice
    const auto starts_run = [&](int64_t k, int64_t r) { return k == first(r) || plan[k].slice != plan[k - 1].slice; };
    std::vector<std::vector<Block>> blocks(ranges);
    std::vector<std::unique_ptr<int32_t[]>> storage(ranges);
    for (int64_t r = 0; r < ranges; ++r) {
        int64_t runs = 0;
        for (int64_t k = first(r); k < first(r + 1); ++k) runs += starts_run(k, r) ? 1 : 0;
        storage[r].reset(new int32_t[size_t(runs) * kBins]);  // uninitialized: zeroed by the thread that fills it
        blocks[r].reserve(size_t(runs));
    }
    std::vector<std::vector<const Block*>> cover(n_slices);  // per slice, the blocks that hold its counts
#pragma omp parallel
    {
#pragma omp for schedule(static, 1)
        for (int64_t r = 0; r < ranges; ++r) {
            std::vector<Block>& mine = blocks[r];
            for (int64_t k = first(r); k < first(r + 1); ++k) {
                const Piece& pc = plan[k];
                if (starts_run(k, r)) {
                    int32_t* bins = storage[r].get() + mine.size() * kBins;
                    std::fill(bins, bins + kBins, 0);
                    mine.push_back({pc.slice, bins, 0.0f});
                }
                Block& b = mine.back();
                const int64_t p = prefix ? prefix[pc.slice] : -1;
                if (prefix && p < 0) continue;  // a layer that keeps nothing needs no second digit
                if (stride > 1 && !prefix) sample_piece<UT, FK>(Row<UT, FK>(s, pc), pc.end - pc.begin, stride, b.bins);
                else histogram_piece<UT, FK>(Row<UT, FK>(s, pc), pc.end - pc.begin, p, b.bins, b.peak);
            }
        }
#pragma omp single
        for (int64_t r = 0; r < ranges; ++r)
            for (const Block& b : blocks[r]) cover[b.slice].push_back(&b);
        constexpr int64_t kSpan = 4096;  // bins per reduction task
#pragma omp for schedule(static)
        for (int64_t e = 0; e < n_slices * kBins; e += kSpan) {
            const int64_t j = e / kBins;
            int32_t* o = out + e;
            std::fill(o, o + kSpan, 0);
            for (const Block* b : cover[j]) {
                const int32_t* in = b->bins + (e - j * kBins);
#pragma omp simd
                for (int64_t i = 0; i < kSpan; ++i) o[i] += in[i];
            }
        }
    }
    for (int64_t j = 0; j < n_slices; ++j) {
        float pk = 0.0f;
        for (const Block* b : cover[j]) pk = std::max(pk, b->peak);
        peaks[j] = pk;
    }
}

// ---- the bracket pass --------------------------------------------------------------------------
struct Bracket {  // per piece
    int64_t above = 0, inside = 0;
    float peak = 0.0f;
    bool overflow = false;
    size_t begin = 0, end = 0;  // its keys in [lo, hi]: [begin, end) of the buffer of the thread that ran it
};

// each OpenMP thread's collected keys, kept across calls so no projection allocates (or page-faults) them afresh
thread_local std::vector<uint32_t> t_keys;

// count the keys above hi, keep those in [lo, hi] (at most kChunk / 4 per piece) in this thread's buffer, and the
// peak |v|
template <class UT, int FK>
__attribute__((noinline)) void bracket_piece(const Row<UT, FK> r, int64_t n, uint32_t lo, uint32_t hi, Bracket& out) {
    alignas(64) uint32_t keys[kKeys];
    const size_t cap = size_t(kChunk / 4);
    for (int64_t b = 0; b < n; b += kKeys) {
        const int64_t m = std::min(kKeys, n - b);
        out.peak = keys_of<false>(r, [&](int64_t i) { return r.value(i); }, b, m, nullptr, keys, out.peak);
        int32_t above = 0, inside = 0;  // a batch's counts fit 32 bits, and 32-bit sums need no widening per vector
#pragma omp simd reduction(+ : above, inside)
        for (int64_t i = 0; i < m; ++i) {
            const uint32_t key = keys[i];
            above += key > hi ? 1 : 0;
            inside += (key >= lo) & (key <= hi) ? 1 : 0;
        }
        out.above += above;
        out.inside += inside;
        if (inside == 0 || out.overflow) continue;
        if (t_keys.size() - out.begin + size_t(inside) > cap) {
            out.overflow = true;
            continue;
        }
        const int64_t found = pack_inside(keys, m, lo, hi);
        t_keys.insert(t_keys.end(), keys, keys + found);
    }
    out.end = t_keys.size();
}

// The bracket pass and everything after it in one parallel region, so each thread copies its own buffer's keys (a
// buffer is never read by another thread, nor after its thread could have left the pool):
//   every piece's counts and keys (static schedule)  ->  the master totals them per slice and asks keys_out for the
//   output  ->  each thread copies the keys of the pieces it ran to their place (grouped by slice, in index order)  ->
//   per slice, the high halves' histogram of its keys (a piece that overflowed keeps the keys it collected: the caller
//   ignores an overflowed slice's histogram, the projection then takes the exact passes)
template <class UT, int FK>
void bracket(const Src& s, const std::vector<Piece>& plan, const Slices& slices, const int64_t* lo, const int64_t* hi,
             int64_t* counts, float* peaks, int64_t* found, bool* overflow,
             const std::function<int32_t*(int64_t)>& keys_out, int32_t* high_hist) {
    const int64_t pieces = int64_t(plan.size()), n_slices = slices.count;
    std::vector<Bracket> out(pieces);
    std::vector<int> ran_by(pieces, 0);
    std::vector<int64_t> at(pieces, 0), slice_at(n_slices + 1, 0);
    int32_t* keys = nullptr;
#pragma omp parallel
    {
        const int t = omp_get_thread_num();
        t_keys.clear();
#pragma omp for schedule(static)
        for (int64_t k = 0; k < pieces; ++k) {
            const int64_t j = plan[k].slice;  // (lo > hi, a layer that keeps nothing: only its peak is wanted)
            ran_by[k] = t;
            out[k].begin = t_keys.size();
            bracket_piece<UT, FK>(Row<UT, FK>(s, plan[k]), plan[k].end - plan[k].begin, uint32_t(lo[j]), uint32_t(hi[j]), out[k]);
        }
#pragma omp master
        {
            for (int64_t j = 0; j < n_slices; ++j) {
                counts[2 * j] = counts[2 * j + 1] = found[j] = 0;
                peaks[j] = 0.0f;
                overflow[j] = false;
            }
            std::vector<std::vector<int64_t>> pieces_of(n_slices);
            for (int64_t k = 0; k < pieces; ++k) pieces_of[plan[k].slice].push_back(k);
            int64_t total = 0;
            for (int64_t j = 0; j < n_slices; ++j) {
                slice_at[j] = total;
                for (const int64_t k : pieces_of[j]) {
                    const Bracket& b = out[k];
                    counts[2 * j] += b.above;
                    counts[2 * j + 1] += b.inside;
                    peaks[j] = std::max(peaks[j], b.peak);
                    overflow[j] = overflow[j] || b.overflow;
                    at[k] = total;
                    total += int64_t(b.end - b.begin);
                    found[j] += int64_t(b.end - b.begin);
                }
            }
            slice_at[n_slices] = total;
            keys = keys_out(total);
        }
#pragma omp barrier
        for (int64_t k = 0; k < pieces; ++k)
            if (ran_by[k] == t) std::copy(t_keys.begin() + out[k].begin, t_keys.begin() + out[k].end, keys + at[k]);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < n_slices; ++j) {
            int32_t* hist = high_hist + j * kBins;
            std::fill(hist, hist + kBins, 0);
            for (int64_t i = slice_at[j]; i < slice_at[j + 1]; ++i) ++hist[uint32_t(keys[i]) >> 16];
        }
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

// skip ? old : fresh, for a storage element. fp8 / bf16 codes are chosen as 32-bit integers and narrowed after: a
// select of 8- or 16-bit structs is a branch GCC if-converts only into a masked byte store, which AVX2 lacks (the
// split loop then stayed scalar there, 6x slower than with AVX-512)
template <class T>
inline T pick(bool skip, T old, T fresh) {
    if constexpr (std::is_same_v<T, float>) return skip ? old : fresh;
    else return T{decltype(old.bits)(skip ? uint32_t(old.bits) : uint32_t(fresh.bits))};
}

struct Tally {  // per piece
    double residual_sq = 0.0, x_sq = 0.0;
    int64_t flips = 0, ties = 0;
};

struct Contribution {  // of one entry (flips as 0.0/1.0: GCC 12 vectorizes no int-from-mixed-compare sums here)
    float residual_sq, x_sq, flips;
};

// z and u (or x) of one piece
template <class ZT, class UT, int FK, int MODE>
struct Splitter {
    Row<NoU, FK> r;     // x and F; u is read and written through `u` alone (one restrict pointer per array)
    ZT* __restrict z;
    UT* __restrict u;
    float z_scale_old, z_scale, u_scale_old, u_scale;
    uint32_t threshold;

    Splitter(const Src& s, const Dest& d, const Piece& pc, uint32_t th)
        : r(s, pc), z(static_cast<ZT*>(d.z) + pc.begin), u(nullptr), z_scale_old(d.z_scale_old[pc.slice]),
          z_scale(d.z_scale[pc.slice]), u_scale_old(1.0f), u_scale(d.u_scale[pc.slice]), threshold(th) {
        if constexpr (MODE == kUpdate) {
            u = static_cast<UT*>(d.u) + pc.begin;
            u_scale_old = s.u_scale[pc.slice];
        }
    }

    // v = x + u (the z/u update, u dequantized as load() does) or v = x
    inline float value(int64_t i) const {
        if constexpr (MODE != kUpdate) return r.x[i];
        else if constexpr (std::is_same_v<UT, float>) return r.x[i] + u[i];
        else return r.x[i] + to_float(u[i]) * u_scale_old;
    }

    // whether an old fp8 z is nonzero can be read off its code (magnitude bits, NaN included) instead of decoding it:
    // true when code · z_scale_old is nonzero for every nonzero code, i.e. the scale is finite and its product with the
    // smallest fp8 magnitude (2^-9) does not underflow (layer_scales floors it at 2^-126)
    bool code_flips() const {
        if constexpr (std::is_same_v<ZT, Fp8>) return std::isfinite(z_scale_old) && z_scale_old * 0x1p-9f != 0.0f;
        else return false;
    }

    // entry i, kept or not; skip: leave it untouched (a tie, decided afterwards); CODE_FLIPS: see code_flips()
    template <bool CODE_FLIPS>
    inline Contribution entry(int64_t i, float v, bool keep, bool skip) const {
        Contribution t{0.0f, 0.0f, 0.0f};
        const float mask = keep ? 1.0f : 0.0f;
        const float zn = v * mask;  // v · mask as in the eager z = v * mask (−0.0 for a dropped negative)
        const ZT z_old = z[i];
        if constexpr (MODE == kUpdate) {
            const float x = r.x[i];
            float zo;
            if constexpr (CODE_FLIPS && std::is_same_v<ZT, Fp8>) zo = (uint32_t(z_old.bits) & 0x7Fu) != 0 ? 1.0f : 0.0f;
            else zo = std::is_same_v<ZT, float> ? to_float(z_old) : to_float(z_old) * z_scale_old;
            z[i] = pick(skip, z_old, store_as<ZT>(zn, z_scale));
            u[i] = pick(skip, u[i], store_as<UT>(v - zn, u_scale));
            const float res = (x - zn) * (x - zn), xx = x * x;
            t.residual_sq = skip ? 0.0f : res;
            t.x_sq = skip ? 0.0f : xx;
            const float old = zo != 0.0f ? 1.0f : 0.0f, flip = (mask - old) * (mask - old);
            t.flips = skip ? 0.0f : flip;
        } else {
            if constexpr (MODE == kFinal) r.x[i] = skip ? r.x[i] : zn;  // x ← x ⊙ mask
            z[i] = pick(skip, z_old, store_as<ZT>(zn, z_scale));
        }
        return t;
    }
};

// one piece, every entry but the ties (key == threshold: left untouched; their places are noted), in batches:
// keys first (into a local buffer: the writes change u, so a key recomputed later could differ), then one
// vectorized loop (in fp32 sums of at most kKeys terms, added to the fp64 tally); a batch holding ties is
// scanned once more for their places
// (noinline: inlined into the OpenMP region, GCC 12 no longer vectorizes these loops)
template <class ZT, class UT, int FK, int MODE>
__attribute__((noinline)) void split_untied(const Splitter<ZT, UT, FK, MODE> sp, int64_t n, Tally& t,
                                            std::vector<int32_t>& tie_at) {
    alignas(64) float values[kKeys];
    alignas(64) uint32_t keys[kKeys];
    const uint32_t threshold = sp.threshold;
    const bool code_flips = sp.code_flips();
    for (int64_t b = 0; b < n; b += kKeys) {
        const int64_t m = std::min(kKeys, n - b);
        keys_of<true>(sp.r, [&](int64_t i) { return sp.value(i); }, b, m, values, keys);
        float res = 0.0f, xsq = 0.0f, flips = 0.0f;
        int32_t ties = 0;  // (as in bracket_piece: 32-bit batch sums)
        const auto batch = [&](auto code_flips) {
#pragma omp simd reduction(+ : res, xsq, flips, ties)
            for (int64_t i = 0; i < m; ++i) {
                const Contribution e = sp.template entry<decltype(code_flips)::value>(b + i, values[i], keys[i] > threshold,
                                                                                       keys[i] == threshold);
                res += e.residual_sq;
                xsq += e.x_sq;
                flips += e.flips;
                ties += keys[i] == threshold ? 1 : 0;
            }
        };
        if (code_flips) batch(std::true_type{});
        else batch(std::false_type{});
        t.residual_sq += res;
        t.x_sq += xsq;
        t.flips += int64_t(flips);
        t.ties += ties;
        if (ties == 0) continue;
        for (int64_t i = 0; i < m; ++i)
            if (keys[i] == threshold) tie_at.push_back(int32_t(b + i));
    }
}

// the ties of one piece at the places split_untied noted (untouched: their v is as it was), in index order:
// this rank's ties number `rank` on here, the first `take` of the slice's are kept
template <class ZT, class UT, int FK, int MODE>
__attribute__((noinline)) void split_ties(const Splitter<ZT, UT, FK, MODE> sp, const std::vector<int32_t>& tie_at, int64_t rank,
                                          int64_t take, Tally& t) {
    for (const int32_t i : tie_at) {
        const Contribution e = sp.template entry<false>(i, sp.value(i), rank++ < take, false);
        t.residual_sq += e.residual_sq;
        t.x_sq += e.x_sq;
        t.flips += int64_t(e.flips);
    }
}

// pass A (parallel): every piece without its ties, counting them; pass B (parallel, the pieces that hold ties
// only, usually one per slice): the ties, each piece's rank among this rank's ties from pass A's counts
template <class ZT, class UT, int FK, int MODE>
void split(const Src& s, const Dest& d, const std::vector<Piece>& plan, const int64_t* threshold, const int64_t* take,
           int64_t n_slices, double* metrics, int64_t* ties_seen) {
    const int64_t pieces = int64_t(plan.size());
    std::vector<Tally> per_piece(pieces);
    std::vector<std::vector<int32_t>> tie_at(pieces);  // piece-relative places of the ties (pieces are < 2^31 long)
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < pieces; ++k) {
        const Splitter<ZT, UT, FK, MODE> sp(s, d, plan[k], uint32_t(threshold[plan[k].slice]));
        split_untied(sp, plan[k].end - plan[k].begin, per_piece[k], tie_at[k]);
    }
    std::vector<int64_t> before(pieces, 0), seen(n_slices, 0), tied;
    for (int64_t k = 0; k < pieces; ++k) {  // ranks of each piece's first tie, in index order
        before[k] = seen[plan[k].slice];
        seen[plan[k].slice] += per_piece[k].ties;
        if (per_piece[k].ties > 0) tied.push_back(k);
    }
    const int64_t n_tied = int64_t(tied.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t q = 0; q < n_tied; ++q) {
        const int64_t k = tied[q];
        const Splitter<ZT, UT, FK, MODE> sp(s, d, plan[k], uint32_t(threshold[plan[k].slice]));
        split_ties(sp, tie_at[k], before[k], take[plan[k].slice], per_piece[k]);
    }
    for (int64_t j = 0; j < n_slices; ++j) ties_seen[j] = seen[j];
    for (int64_t k = 0; k < pieces; ++k) {
        metrics[0] += per_piece[k].residual_sq;
        metrics[1] += per_piece[k].x_sq;
        metrics[2] += double(per_piece[k].flips);
    }
}

// ---- dispatch ----------------------------------------------------------------------------------
// true when qmap[c] is the minifloat V decode of c, bit for bit, for every code: the arithmetic decode then gives the
// map's values exactly
bool is_minifloat_map(const float* qmap) {
    for (int c = 0; c < 256; ++c)
        if (as_bits(qmap[c]) != as_bits(MiniFloatV::decode(uint8_t(c)))) return false;
    return true;
}

template <class F>
void with_fisher(const Src& s, F&& f) {
    if (s.f) return f(std::integral_constant<int, kFp32>{});
    if (s.f_codes && is_minifloat_map(s.f_qmap)) return f(std::integral_constant<int, kMini8>{});
    if (s.f_codes) return f(std::integral_constant<int, kBnb8>{});
    return f(std::integral_constant<int, kMagnitude>{});
}

}  // namespace

void select_histogram(const ScoreSource& src, int64_t n, const Slices& slices, const int64_t* prefix, int64_t stride,
                      int32_t* hist, float* peaks) {
    const auto plan = make_plan(slices, n, /*with_gaps=*/false);
    with_storage(src.u ? src.u_type : Storage::kNone, [&](auto ut) {
        with_fisher(src, [&](auto fk) {
            histogram<decltype(ut), decltype(fk)::value>(src, plan, prefix, std::max<int64_t>(stride, 1), slices.count, hist, peaks);
        });
    });
}

void select_bracket(const ScoreSource& src, int64_t n, const Slices& slices, const int64_t* lo, const int64_t* hi, int64_t* counts,
                    float* peaks, int64_t* found, bool* overflow, const std::function<int32_t*(int64_t)>& keys_out,
                    int32_t* high_hist) {
    const auto plan = make_plan(slices, n, /*with_gaps=*/false);
    with_storage(src.u ? src.u_type : Storage::kNone, [&](auto ut) {
        with_fisher(src, [&](auto fk) {
            bracket<decltype(ut), decltype(fk)::value>(src, plan, slices, lo, hi, counts, peaks, found, overflow, keys_out, high_hist);
        });
    });
}

void select_key_histogram(const int32_t* keys, const int64_t* found, int64_t n_slices, const int64_t* prefix, int32_t* hist) {
    std::vector<int64_t> at(n_slices + 1, 0);  // slice j's keys: [at[j], at[j + 1])
    for (int64_t j = 0; j < n_slices; ++j) at[j + 1] = at[j] + found[j];
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t j = 0; j < n_slices; ++j) {
        if (prefix[j] < 0) continue;
        int32_t* row = hist + j * kBins;
        for (int64_t i = at[j]; i < at[j + 1]; ++i)
            if ((uint32_t(keys[i]) >> 16) == uint32_t(prefix[j])) ++row[uint32_t(keys[i]) & 0xFFFFu];
    }
}

void select_row_totals(const int32_t* hist, int64_t rows, int64_t bins, int64_t* totals) {
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t* h = hist + r * bins;
        int64_t sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < bins; ++i) sum += h[i];
        totals[r] = sum;
    }
}

void select_cum_search(const int32_t* hist, int64_t rows, int64_t bins, const int64_t* target, bool from_top, bool right,
                       int64_t* index, int64_t* cum) {
    for (int64_t r = 0; r < rows; ++r) {
        const int32_t* h = hist + r * bins;
        int64_t sum = 0, at = bins - 1;
        for (int64_t i = 0; i < bins; ++i) {
            sum += h[from_top ? bins - 1 - i : i];
            if (right ? sum > target[r] : sum >= target[r]) {
                at = i;
                break;
            }
        }
        index[r] = at;  // not found: clamped to the last position, where the running sum is the row's total
        cum[r] = sum;
    }
}

void select_split(const ScoreSource& src, int64_t n, const Slices& slices, void* z, Storage z_type, const float* z_scale_old,
                  const float* z_scale, void* u, Storage u_type, const float* u_scale, const int64_t* threshold,
                  const int64_t* take, SplitMode mode, double* metrics, int64_t* ties_seen) {
    const auto plan = make_plan(slices, n, /*with_gaps=*/false);
    const Dest d{z, z_scale_old, z_scale, u, u_scale};
    with_storage(z_type, [&](auto zt) {
        using ZT = decltype(zt);
        if constexpr (!std::is_same_v<ZT, NoU>) {
            with_fisher(src, [&](auto fk) {
                constexpr int FK = decltype(fk)::value;
                auto run = [&](auto ut, auto md) {
                    split<ZT, decltype(ut), FK, decltype(md)::value>(src, d, plan, threshold, take, slices.count, metrics, ties_seen);
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
