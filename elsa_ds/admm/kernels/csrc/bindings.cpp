// Thin Python binding of the fused ADMM kernels (JIT-built by kernels/build.py): checks the tensors,
// hands raw pointers to the kernels (kernels.h), which know nothing of torch.
#include <omp.h>
#include <torch/extension.h>

#include "kernels.h"

namespace elsa {
namespace {

using torch::Tensor;

Storage storage_of(const Tensor& t) {
    if (t.numel() == 0) return Storage::kNone;
    switch (t.scalar_type()) {
        case torch::kFloat32: return Storage::kFp32;
        case torch::kBFloat16: return Storage::kBf16;
        case torch::kFloat8_e4m3fn: return Storage::kFp8;
        default: TORCH_CHECK(false, "z/u storage must be float32, bfloat16 or float8_e4m3fn, got ", t.scalar_type());
    }
}

void check_flat(const Tensor& t, const char* name, int64_t n, torch::ScalarType dtype) {
    TORCH_CHECK(t.is_cpu() && t.is_contiguous() && t.numel() == n && t.scalar_type() == dtype, name,
                " must be a contiguous CPU tensor of ", n, " ", dtype, " entries");
}

template <class T>
T* data_or_null(const Tensor& t) {
    return t.numel() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

Slices slices_of(const Tensor& offsets, const Tensor& lengths) {
    TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 && offsets.is_contiguous()
                    && lengths.is_contiguous() && offsets.numel() == lengths.numel(), "slice offsets and lengths: contiguous int64, one each per slice");
    return Slices{offsets.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), offsets.numel()};
}

ZU zu_of(Tensor& z, Tensor& u, const Tensor& z_scale, const Tensor& u_scale, int64_t n, const Slices& s) {
    if (s.count) {
        TORCH_CHECK(z.numel() == n && u.numel() == n && z.is_contiguous() && u.is_contiguous(), "z and u must be contiguous and as long as the flat");
        check_flat(z_scale, "z_scale", s.count, torch::kFloat32);
        check_flat(u_scale, "u_scale", s.count, torch::kFloat32);
    }
    return ZU{data_or_null<void>(z), storage_of(z), data_or_null<void>(u), storage_of(u), data_or_null<const float>(z_scale),
              data_or_null<const float>(u_scale)};
}

void adam_step_t(Tensor p, Tensor g, Tensor m, Tensor v, Tensor z, Tensor u, Tensor z_scale, Tensor u_scale, Tensor offsets,
                 Tensor lengths, double lam, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                 double bias_correction1, double bias_correction2) {
    const int64_t n = p.numel();
    for (auto [t, name] : {std::pair{&p, "p"}, {&g, "grad"}, {&m, "exp_avg"}, {&v, "exp_avg_sq"}}) check_flat(*t, name, n, torch::kFloat32);
    const Slices s = slices_of(offsets, lengths);
    adam_step(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n, zu_of(z, u, z_scale, u_scale, n, s),
              s, float(lam), AdamHyper{lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1, bias_correction2});
}

void adam8bit_step_t(Tensor p, Tensor g, Tensor state1, Tensor state2, Tensor qmap1, Tensor qmap2, Tensor absmax1, Tensor absmax2,
                     Tensor z, Tensor u, Tensor z_scale, Tensor u_scale, Tensor offsets, Tensor lengths, double lam, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step, int64_t format) {
    const int64_t n = p.numel(), blocks = (n + 255) / 256;
    TORCH_CHECK(format == 0 || format == 1, "adam8bit_step: format must be 0 (bitsandbytes) or 1 (minifloat), got ", format);
    check_flat(p, "p", n, torch::kFloat32);
    check_flat(g, "grad", n, torch::kFloat32);
    check_flat(state1, "state1", n, torch::kUInt8);
    check_flat(state2, "state2", n, torch::kUInt8);
    check_flat(qmap1, "qmap1", 256, torch::kFloat32);
    check_flat(qmap2, "qmap2", 256, torch::kFloat32);
    check_flat(absmax1, "absmax1 (one per block of 256)", blocks, torch::kFloat32);
    check_flat(absmax2, "absmax2 (one per block of 256)", blocks, torch::kFloat32);
    if (format == 1) {  // the kernel decodes minifloat codes arithmetically: the maps the readers use must agree
        const float* q1 = qmap1.data_ptr<float>();
        const float* q2 = qmap2.data_ptr<float>();
        TORCH_CHECK(q1[1] == 0x1.2p-15f && q1[120] == 1.0f && q1[0x81] == -0x1.2p-15f && q2[1] == 0x1.1p-15f && q2[240] == 1.0f,
                    "adam8bit_step: format 1 (minifloat) with maps that are not adam8bit.minifloat_map's");
    }
    const Slices s = slices_of(offsets, lengths);
    const Adam8State st{Adam8Format(format), state1.data_ptr<uint8_t>(), state2.data_ptr<uint8_t>(), qmap1.data_ptr<float>(), qmap2.data_ptr<float>(),
                        absmax1.data_ptr<float>(), absmax2.data_ptr<float>()};
    adam8bit_step(p.data_ptr<float>(), g.data_ptr<float>(), st, n, zu_of(z, u, z_scale, u_scale, n, s), s, float(lam),
                  Adam8Hyper{lr, beta1, beta2, eps, weight_decay, step});
}

ScoreSource source_of(Tensor& x, Tensor& u, const Tensor& u_scale, const Tensor& f, const Tensor& f_qmap, const Tensor& f_absmax,
                      int64_t n_slices) {
    const int64_t n = x.numel();
    check_flat(x, "x", n, torch::kFloat32);
    TORCH_CHECK(u.numel() == 0 || (u.numel() == n && u.is_contiguous()), "u must be empty or as long as x");
    if (u.numel()) check_flat(u_scale, "u_scale", n_slices, torch::kFloat32);
    const bool bnb = f.numel() && f.scalar_type() == torch::kUInt8;
    if (f.numel()) check_flat(f, "F", n, bnb ? torch::kUInt8 : torch::kFloat32);
    if (bnb) {
        check_flat(f_qmap, "qmap2", 256, torch::kFloat32);
        check_flat(f_absmax, "absmax2 (one per block of 256)", (n + 255) / 256, torch::kFloat32);
    }
    return ScoreSource{x.data_ptr<float>(), data_or_null<const void>(u), storage_of(u), data_or_null<const float>(u_scale),
                       f.numel() && !bnb ? f.data_ptr<float>() : nullptr, bnb ? f.data_ptr<uint8_t>() : nullptr,
                       bnb ? f_qmap.data_ptr<float>() : nullptr, bnb ? f_absmax.data_ptr<float>() : nullptr};
}

std::vector<Tensor> select_histogram_t(Tensor x, Tensor u, Tensor u_scale, Tensor f, Tensor f_qmap, Tensor f_absmax, Tensor offsets,
                                       Tensor lengths, Tensor prefix, int64_t stride) {
    const Slices s = slices_of(offsets, lengths);
    const ScoreSource src = source_of(x, u, u_scale, f, f_qmap, f_absmax, s.count);
    if (prefix.numel()) check_flat(prefix, "prefix", s.count, torch::kInt64);
    auto hist = torch::zeros({s.count, 65536}, torch::kInt32);
    auto peaks = torch::zeros({s.count}, torch::kFloat32);
    select_histogram(src, x.numel(), s, data_or_null<const int64_t>(prefix), stride, hist.data_ptr<int32_t>(), peaks.data_ptr<float>());
    return {hist, peaks};
}

std::vector<Tensor> select_bracket_t(Tensor x, Tensor u, Tensor u_scale, Tensor f, Tensor f_qmap, Tensor f_absmax, Tensor offsets,
                                     Tensor lengths, Tensor lo, Tensor hi) {
    const Slices s = slices_of(offsets, lengths);
    const ScoreSource src = source_of(x, u, u_scale, f, f_qmap, f_absmax, s.count);
    check_flat(lo, "lo", s.count, torch::kInt64);
    check_flat(hi, "hi", s.count, torch::kInt64);
    auto counts = torch::zeros({s.count, 2}, torch::kInt64);
    auto peaks = torch::zeros({s.count}, torch::kFloat32);
    auto found = torch::zeros({s.count}, torch::kInt64);
    auto overflow = torch::zeros({s.count}, torch::kBool);
    auto high = torch::empty({s.count, 65536}, torch::kInt32);
    Tensor out;
    select_bracket(src, x.numel(), s, lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), counts.data_ptr<int64_t>(), peaks.data_ptr<float>(),
                   found.data_ptr<int64_t>(), overflow.data_ptr<bool>(),
                   [&](int64_t total) {
                       out = torch::empty({total}, torch::kInt32);
                       return out.data_ptr<int32_t>();
                   },
                   high.data_ptr<int32_t>());
    return {counts, peaks, out, found, overflow, high};
}

Tensor select_key_histogram_t(Tensor keys, Tensor found, Tensor prefix) {
    const int64_t n_slices = found.numel();
    check_flat(found, "found", n_slices, torch::kInt64);
    check_flat(prefix, "prefix", n_slices, torch::kInt64);
    check_flat(keys, "keys", found.sum().item<int64_t>(), torch::kInt32);
    auto hist = torch::zeros({n_slices, 65536}, torch::kInt32);
    select_key_histogram(keys.data_ptr<int32_t>(), found.data_ptr<int64_t>(), n_slices, prefix.data_ptr<int64_t>(), hist.data_ptr<int32_t>());
    return hist;
}

void check_hist(const Tensor& hist) {
    TORCH_CHECK(hist.dim() == 2 && hist.is_cpu() && hist.is_contiguous() && hist.scalar_type() == torch::kInt32 && hist.size(1) > 0,
                "hist must be a contiguous int32 CPU tensor [rows, bins] with bins > 0");
}

Tensor select_row_totals_t(Tensor hist) {
    check_hist(hist);
    auto totals = torch::empty({hist.size(0)}, torch::kInt64);
    select_row_totals(hist.data_ptr<int32_t>(), hist.size(0), hist.size(1), totals.data_ptr<int64_t>());
    return totals;
}

std::vector<Tensor> select_cum_search_t(Tensor hist, Tensor target, bool from_top, bool right) {
    check_hist(hist);
    check_flat(target, "target", hist.size(0), torch::kInt64);
    auto index = torch::empty({hist.size(0)}, torch::kInt64);
    auto cum = torch::empty({hist.size(0)}, torch::kInt64);
    select_cum_search(hist.data_ptr<int32_t>(), hist.size(0), hist.size(1), target.data_ptr<int64_t>(), from_top, right,
                      index.data_ptr<int64_t>(), cum.data_ptr<int64_t>());
    return {index, cum};
}

std::vector<Tensor> select_split_t(Tensor x, Tensor u, Tensor u_scale_old, Tensor f, Tensor f_qmap, Tensor f_absmax, Tensor z,
                                   Tensor z_scale_old, Tensor z_scale, Tensor u_scale, Tensor offsets, Tensor lengths,
                                   Tensor threshold, Tensor take, int64_t mode) {
    TORCH_CHECK(mode >= 0 && mode <= 2, "mode: 0 update, 1 init, 2 final");
    const Slices s = slices_of(offsets, lengths);
    const ScoreSource src = source_of(x, u, u_scale_old, f, f_qmap, f_absmax, s.count);
    TORCH_CHECK(z.numel() == x.numel() && z.is_contiguous(), "z must be contiguous and as long as x");
    TORCH_CHECK(mode != 0 || u.numel() == x.numel(), "the z/u update needs u");
    for (auto [t, name] : {std::pair{&z_scale_old, "z_scale_old"}, {&z_scale, "z_scale"}, {&u_scale, "u_scale"}})
        check_flat(*t, name, s.count, torch::kFloat32);
    check_flat(threshold, "threshold", s.count, torch::kInt64);
    check_flat(take, "take", s.count, torch::kInt64);
    auto metrics = torch::zeros({3}, torch::kFloat64);
    auto seen = torch::zeros({s.count}, torch::kInt64);
    select_split(src, x.numel(), s, z.data_ptr(), storage_of(z), z_scale_old.data_ptr<float>(), z_scale.data_ptr<float>(),
                 data_or_null<void>(u), storage_of(u), u_scale.data_ptr<float>(), threshold.data_ptr<int64_t>(),
                 take.data_ptr<int64_t>(), SplitMode(mode), metrics.data_ptr<double>(),
                 seen.data_ptr<int64_t>());
    return {metrics, seen};
}

// the storage conversions on their own, for the tests that hold them to torch's
template <class Out, class F>
Tensor convert(const Tensor& in, torch::ScalarType out_type, F&& f) {
    auto src = in.contiguous();
    auto out = torch::empty(src.sizes(), out_type);
    const int64_t n = src.numel();
    auto* dst = reinterpret_cast<Out*>(out.data_ptr());
    const auto* s = src.data_ptr();
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) dst[i] = f(s, i);
    return out;
}

}  // namespace
}  // namespace elsa

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace elsa;
    m.def("adam_step", &adam_step_t, "fused ADMM penalty + DeepSpeed CPU Adam step on one flat");
    m.def("adam8bit_step", &adam8bit_step_t, "fused ADMM penalty + 8-bit Adam step (bitsandbytes or minifloat codes) on one flat");
    m.def("select_histogram", &select_histogram_t, "16-bit digit histograms of the projection scores, per slice; peak |v|");
    m.def("select_bracket", &select_bracket_t, "count keys above a bracket, collect those inside it, per slice; peak |v|");
    m.def("select_key_histogram", &select_key_histogram_t, "low-half histogram of bracket keys under each slice's high-half prefix");
    m.def("select_row_totals", &select_row_totals_t, "per row, the sum of an int32 histogram (int64)");
    m.def("select_cum_search", &select_cum_search_t, "per row, the first bin where the running count passes a target (searchsorted on cumsum)");
    m.def("select_split", &select_split_t, "z = v*[key > T] (+ this rank's tied share), u = v - z; metrics, ties met");
    m.def("to_fp8", [](const torch::Tensor& x) {
        return convert<uint8_t>(x.to(torch::kFloat32), torch::kUInt8, [](const void* s, int64_t i) { return float_to_fp8(static_cast<const float*>(s)[i]); });
    });
    m.def("from_fp8", [](const torch::Tensor& c) {
        return convert<float>(c, torch::kFloat32, [](const void* s, int64_t i) { return fp8_to_float(static_cast<const uint8_t*>(s)[i]); });
    });
    m.def("to_bf16", [](const torch::Tensor& x) {
        return convert<int16_t>(x.to(torch::kFloat32), torch::kInt16, [](const void* s, int64_t i) { return int16_t(float_to_bf16(static_cast<const float*>(s)[i])); });
    });
    m.def("simd_level", []() -> std::string {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        return "AVX512";
#elif defined(__AVX2__)
        return "AVX2";
#else
        return "scalar";
#endif
    });
    m.def("use_portable_loops", &use_portable_loops, "true: the 8-bit x-step runs its portable loop, not the AVX-512 one (tests)");
    m.def("has_span8_avx512", &has_span8_avx512, "whether the 8-bit x-step's AVX-512 loop was compiled (AVX-512 F, BW, VL)");
    m.def("max_threads", []() { return omp_get_max_threads(); });
    m.def("deepspeed_adam_simd_width", []() { return kDeepSpeedAdamSimdWidth; });
}
