// How a flat tensor is cut into work for the OpenMP threads.
//
// A flat (one rank's fp32 partition of a ZeRO-3 sub-group) holds pruned-layer slices at given offsets,
// and entries outside any slice (biases, norms, padding). A plan lists pieces of at most kChunk
// entries, each inside one slice or inside one gap, in index order, so every piece runs one
// branch-free vectorized loop and a static OpenMP schedule hands each thread a contiguous range.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace elsa {

constexpr int64_t kChunk = 1 << 15;  // 32K entries: 128 KiB of fp32 per stream, amortizes the loop setup

struct Piece {
    int64_t begin, end;  // [begin, end) in the flat
    int64_t slice;       // index into the slice list, or -1 outside every slice
};

// the pruned-layer slices of one flat: slice j holds entries [offsets[j], offsets[j] + lengths[j])
struct Slices {
    const int64_t* offsets;
    const int64_t* lengths;
    int64_t count;
};

// pieces covering [0, numel) (with_gaps) or only the slices' entries, in index order
inline std::vector<Piece> make_plan(const Slices& slices, int64_t numel, bool with_gaps) {
    const int64_t* o = slices.offsets;
    const int64_t* l = slices.lengths;
    std::vector<int64_t> order(slices.count);
    for (int64_t j = 0; j < slices.count; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return o[a] < o[b]; });
    std::vector<Piece> plan;
    // cut at multiples of kChunk (not every kChunk from a slice's start): a chunk then holds whole
    // 256-entry blocks of 8-bit state, whoever owns the pieces around it
    auto emit = [&](int64_t begin, int64_t end, int64_t slice) {
        for (int64_t b = begin; b < end;) {
            const int64_t e = std::min(end, (b / kChunk + 1) * kChunk);
            plan.push_back({b, e, slice});
            b = e;
        }
    };
    int64_t cursor = 0;
    for (int64_t j : order) {
        if (l[j] == 0) continue;
        if (l[j] < 0 || o[j] < cursor || o[j] + l[j] > numel)
            throw std::invalid_argument("slices must be disjoint and inside the flat");
        if (with_gaps) emit(cursor, o[j], -1);
        emit(o[j], o[j] + l[j], j);
        cursor = o[j] + l[j];
    }
    if (with_gaps) emit(cursor, numel, -1);
    return plan;
}


}  // namespace elsa
