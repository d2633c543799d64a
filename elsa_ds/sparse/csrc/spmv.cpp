// Sparse weight times a few activation rows for decode: y[b, r] = sum_k value[k] * x[b, col(k)] over row r's entries.
//
// The weight is in elsa-sparse's delta8 code (docs: README, "Sparse checkpoint"): per row, entries in column order,
// col(first) = delta[first], col(k) = col(k-1) + 1 + delta[k]; row r's entries are [row_offsets[r], row_offsets[r+1]).
// Gaps longer than 256 columns carry explicit zero-valued filler entries, so every entry is one byte of position
// and one value (bf16 or fp32), read once, in order: the loop streams 3 (bf16) or 5 (fp32) bytes per entry.
//
// OpenMP splits the output rows; each row is independent (no atomics). x is fp32, transposed to [cols][NB] with the
// batch padded to NB in {1, 2, 4, 8, 16}: the portable loops do one NB-wide multiply-add per entry, four entries in
// flight, on every CPU. Batch 1 has a second loop on AVX-512 (`portable` false): 16 entries' columns at once by a prefix
// sum, x gathered at them. Which is faster depends on the CPU's gathers (docs/results.md: on an AMD EPYC the portable
// loop); elsa_ds.sparse.kernels.prefer_portable picks. A hand-vectorized batch > 1 loop (each value broadcast against
// its contiguous x^T row, columns by the prefix sum) was measured slower than the portable one there and dropped.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ELSA_SPARSE_AVX512 1
#endif

namespace {

inline float load_value(const float* v, int64_t k) { return v[k]; }

inline float load_value(const uint16_t* v, int64_t k) {  // bf16 -> fp32 is exact: the bits, shifted up
    uint32_t bits = static_cast<uint32_t>(v[k]) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

#ifdef ELSA_SPARSE_AVX512
// 16 entries at a time: their columns by a prefix sum of (1 + delta) across the lanes, x gathered at those columns,
// one fused multiply-add; the last lane's column carries into the next 16. Masked loads take a row's tail.
inline __m512 load16(const float* v, __mmask16 m) { return _mm512_maskz_loadu_ps(m, v); }

inline __m512 load16(const uint16_t* v, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v)), 16));
}

inline __m512i columns16(const uint8_t* d, __mmask16 m, __m512i base) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i c = _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, d)), _mm512_set1_epi32(1));
    c = _mm512_add_epi32(c, _mm512_alignr_epi32(c, zero, 15));
    c = _mm512_add_epi32(c, _mm512_alignr_epi32(c, zero, 14));
    c = _mm512_add_epi32(c, _mm512_alignr_epi32(c, zero, 12));
    c = _mm512_add_epi32(c, _mm512_alignr_epi32(c, zero, 8));
    return _mm512_add_epi32(c, base);
}

template <typename V>
void spmv_rows_avx512(const V* values, const uint8_t* deltas, const int64_t* offsets, const float* x, float* y, int64_t rows) {
    const __m512i last = _mm512_set1_epi32(15);
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t begin = offsets[r], end = offsets[r + 1];
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        __m512i base = _mm512_set1_epi32(-1);
        int64_t k = begin;
        for (; k + 32 <= end; k += 32) {
            const __m512i c0 = columns16(deltas + k, 0xFFFF, base);
            const __m512i c1 = columns16(deltas + k + 16, 0xFFFF, _mm512_permutexvar_epi32(last, c0));
            base = _mm512_permutexvar_epi32(last, c1);
            acc0 = _mm512_fmadd_ps(load16(values + k, 0xFFFF), _mm512_i32gather_ps(c0, x, 4), acc0);
            acc1 = _mm512_fmadd_ps(load16(values + k + 16, 0xFFFF), _mm512_i32gather_ps(c1, x, 4), acc1);
        }
        for (; k < end; k += 16) {
            const __mmask16 m = end - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (end - k)) - 1);
            const __m512i c = columns16(deltas + k, m, base);
            base = _mm512_permutexvar_epi32(last, c);
            acc0 = _mm512_fmadd_ps(load16(values + k, m), _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, c, x, 4), acc0);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}
#endif

// the portable loops: every batch above 1 on every CPU, and batch 1 without AVX-512 or with `portable` (the tests hold
// them and the AVX-512 loop to the readable reference)
template <typename V>
void spmv_rows_portable(const V* values, const uint8_t* deltas, const int64_t* offsets, const float* x, float* y, int64_t rows) {
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t begin = offsets[r], end = offsets[r + 1];
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        int64_t col = -1, k = begin;
        for (; k + 4 <= end; k += 4) {
            for (int j = 0; j < 4; ++j) {
                col += 1 + deltas[k + j];
                acc[j] += load_value(values, k + j) * x[col];
            }
        }
        for (; k < end; ++k) {
            col += 1 + deltas[k];
            acc[0] += load_value(values, k) * x[col];
        }
        y[r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
}

template <typename V, int NB>
void spmm_rows_portable(const V* values, const uint8_t* deltas, const int64_t* offsets, const float* xt, float* yt, int64_t rows) {
#pragma omp parallel for schedule(dynamic, 64)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t end = offsets[r + 1];
        float acc[4][NB] = {};  // four entries in flight: each NB-wide add waits on its own chain, not on the last one
        int64_t col = -1, k = offsets[r];
        for (; k + 4 <= end; k += 4) {
            for (int j = 0; j < 4; ++j) {
                col += 1 + deltas[k + j];
                const float v = load_value(values, k + j);
                const float* xc = xt + col * NB;
#pragma omp simd
                for (int b = 0; b < NB; ++b) acc[j][b] += v * xc[b];
            }
        }
        for (; k < end; ++k) {
            col += 1 + deltas[k];
            const float v = load_value(values, k);
            const float* xc = xt + col * NB;
#pragma omp simd
            for (int b = 0; b < NB; ++b) acc[0][b] += v * xc[b];
        }
        float* out = yt + r * NB;
        for (int b = 0; b < NB; ++b) out[b] = (acc[0][b] + acc[1][b]) + (acc[2][b] + acc[3][b]);
    }
}

template <typename V, int NB>
void rows_nb(const V* values, const uint8_t* deltas, const int64_t* offsets, const float* x, float* y, int64_t rows, bool portable) {
    if constexpr (NB == 1) {
#ifdef ELSA_SPARSE_AVX512
        if (!portable) return spmv_rows_avx512<V>(values, deltas, offsets, x, y, rows);
#endif
        spmv_rows_portable<V>(values, deltas, offsets, x, y, rows);
    } else {
        spmm_rows_portable<V, NB>(values, deltas, offsets, x, y, rows);
    }
}

template <typename V>
void dispatch(const V* values, const uint8_t* deltas, const int64_t* offsets, const float* x, float* y, int64_t rows, int64_t nb,
              bool portable) {
    switch (nb) {
        case 1: rows_nb<V, 1>(values, deltas, offsets, x, y, rows, portable); break;
        case 2: rows_nb<V, 2>(values, deltas, offsets, x, y, rows, portable); break;
        case 4: rows_nb<V, 4>(values, deltas, offsets, x, y, rows, portable); break;
        case 8: rows_nb<V, 8>(values, deltas, offsets, x, y, rows, portable); break;
        case 16: rows_nb<V, 16>(values, deltas, offsets, x, y, rows, portable); break;
        default: TORCH_CHECK(false, "delta8 kernel: padded batch must be 1, 2, 4, 8 or 16, got ", nb);
    }
}

}  // namespace

// xt: fp32 [cols, nb] (nb = 1: just x), yt: fp32 [rows, nb]. The codes' contents (offsets rising, each row's columns
// within xt) are the caller's to check (format.check_layout, again whenever a part changed); the sizes are checked here.
// portable: the plain loops even where the AVX-512 ones are built
void delta8_matmul(torch::Tensor values, torch::Tensor deltas, torch::Tensor row_offsets, torch::Tensor xt, torch::Tensor yt,
                   bool portable) {
    TORCH_CHECK(xt.scalar_type() == torch::kFloat32 && yt.scalar_type() == torch::kFloat32, "delta8 kernel: x and y are fp32");
    TORCH_CHECK(xt.is_contiguous() && yt.is_contiguous() && values.is_contiguous() && deltas.is_contiguous(), "contiguous");
    TORCH_CHECK(xt.is_cpu() && yt.is_cpu() && values.is_cpu() && deltas.is_cpu() && row_offsets.is_cpu(),
                "delta8 kernel: CPU tensors only");
    TORCH_CHECK(row_offsets.scalar_type() == torch::kInt64 && row_offsets.dim() == 1 && row_offsets.is_contiguous() &&
                deltas.scalar_type() == torch::kUInt8 && xt.dim() == 2 && yt.dim() == 2, "delta8 kernel: parts' dtypes and dims");
    const int64_t rows = row_offsets.numel() - 1, nb = xt.size(1);
    TORCH_CHECK(rows >= 0 && rows == yt.size(0) && nb == yt.size(1) && values.numel() == deltas.numel(),
                "delta8 kernel: sizes disagree");
    const uint8_t* d = deltas.data_ptr<uint8_t>();
    const int64_t* off = row_offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[rows] == values.numel(), "delta8 kernel: row_offsets do not run from 0 to the values' count");
    if (values.scalar_type() == torch::kBFloat16) {
        dispatch(reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), d, off, xt.data_ptr<float>(),
                 yt.data_ptr<float>(), rows, nb, portable);
    } else {
        TORCH_CHECK(values.scalar_type() == torch::kFloat32, "delta8 kernel: values are bf16 or fp32");
        dispatch(values.data_ptr<float>(), d, off, xt.data_ptr<float>(), yt.data_ptr<float>(), rows, nb, portable);
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("delta8_matmul", &delta8_matmul, "y = W x for a delta8-coded sparse W and 1-16 fp32 activation columns",
          pybind11::arg("values"), pybind11::arg("deltas"), pybind11::arg("row_offsets"), pybind11::arg("xt"), pybind11::arg("yt"),
          pybind11::arg("portable") = false);
    m.attr("avx512") = pybind11::bool_(
#ifdef ELSA_SPARSE_AVX512
        true
#else
        false
#endif
    );
}
