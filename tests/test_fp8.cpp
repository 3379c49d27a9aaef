// FP8 linear layers (core/models/common/fp8_linear.h) on the CPU, where the arithmetic is
// emulated in fp32: e4m3 rounding against PyTorch's own float8_e4m3fn conversion (which the
// CPU path and the CUDA kernel are written to match), the layers' gating (allowed, wanted,
// eligible), invalidation after in-place weight changes, and a job's precision through the
// pipeline, presets, PNG parameters and lanes.
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/engine/lanes.h"
#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/fused_linears.h"
#include "core/models/common/layers.h"
#include "core/pipeline/factory.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "strategy_job.h"
#include "test_util.h"

using namespace diffract;

namespace {

// A job-scope override of DIFFRACT_PRECISION on this thread.
struct Precision {
  explicit Precision(const std::string& p) : overrides{{"DIFFRACT_PRECISION", p}}, scope(overrides) {}
  options::Overrides overrides;
  options::JobOptionsScope scope;
};

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).norm() / b.to(at::kDouble).norm()).item<double>();
}

}  // namespace

class TestFp8 : public QObject {
  Q_OBJECT
 private slots:
  // Per-row scales and e4m3 values: every element within e4m3's half-ulp (2^-4 relative) of the
  // original once scaled back, the row's largest at 448, zero rows zero, and the same values as
  // PyTorch's float8_e4m3fn conversion of x / scale.
  void quantisesRowsAsE4M3() {
    at::Generator g = at::detail::createCPUGenerator(3);
    auto x = at::randn({64, 96}, g) * at::linspace(0.01, 30, 64).unsqueeze(1);
    x[5].zero_();
    x[7][3] = 1e4;  // an outlier sets its row's scale
    const auto [q, scale] = models::quantize_rows_fp8(x);
    QCOMPARE(q.scalar_type(), at::kFloat8_e4m3fn);
    QCOMPARE(scale.sizes(), (at::IntArrayRef{64, 1}));
    const auto back = q.to(at::kFloat) * scale;
    QVERIFY(back[5].abs().max().item<float>() == 0);
    // e4m3 has 3 mantissa bits: relative rounding error at most 2^-4 for normal values; the
    // subnormals below 2^-6 * scale are off by at most half their spacing.
    const auto err = (back - x).abs();
    const auto bound = at::maximum(x.abs() * 0.0625, scale * 0.0009765625);
    QVERIFY2((err <= bound * 1.0001).all().item<bool>(), qPrintable(QString("worst %1").arg((err / bound).max().item<float>())));
    QCOMPARE(q.to(at::kFloat).abs().amax(1)[7].item<float>(), 448.0f);
    // The scale is the row's amax / 448 (1e-12 for a zero row), the values x / scale cast by
    // PyTorch's own conversion (round to nearest even).
    const auto amax = x.abs().amax(1, true);
    DIFFRACT_COMPARE_TENSORS(scale, (amax * static_cast<float>(1.0 / 448)).clamp_min(1e-12), 0);
    QVERIFY(at::equal(q.to(at::kFloat), (x * scale.reciprocal()).to(at::kFloat8_e4m3fn).to(at::kFloat)));
    // Weights: per output channel, the scale as a row.
    const auto w = models::quantize_weight_fp8(x);
    QCOMPARE(w.scale.sizes(), (at::IntArrayRef{1, 64}));
    QVERIFY(at::equal(w.weight.to(at::kFloat), q.to(at::kFloat)));
  }

  // A Linear runs in fp8 only where it is allowed, the job wants it and K, N divide by 16; the
  // emulation is the reference product of the e4m3 operands, near the exact one.
  void linearRunsInFp8WhereAllowedAndWanted() {
    at::NoGradGuard no_grad;
    at::Generator g = at::detail::createCPUGenerator(5);
    models::Linear layer(64, 48);
    models::init_random(*layer, g);
    const auto x = at::randn({2, 10, 64}, g);
    const auto exact = layer->forward(x);
    {
      Precision fp8("fp8");
      QVERIFY(models::fp8_wanted());
      QVERIFY(at::equal(layer->forward(x), exact));  // not allowed yet
      QCOMPARE(models::allow_fp8(*layer), 1);
      const auto got = layer->forward(x);
      const auto [q, s] = models::quantize_rows_fp8(x.reshape({20, 64}));
      const auto want = models::scaled_linear_fp8_reference(q, s, models::quantize_weight_fp8(layer->weight), layer->bias,
                                                            at::kFloat);
      DIFFRACT_COMPARE_TENSORS(got.reshape({20, 48}), want, 0);
      qInfo("fp8 Linear 64 -> 48: relative L2 to fp32 %.3g", rel(got, exact));
      QVERIFY(rel(got, exact) > 1e-4 && rel(got, exact) < 0.05);
      // A weight changed in place: the e4m3 copy is remade only once invalidated.
      layer->weight.mul_(2);
      const auto stale = layer->forward(x);
      models::invalidate_fp8_weights();
      const auto fresh = layer->forward(x);
      QVERIFY(!at::equal(stale, fresh));
      QVERIFY(rel(fresh, layer->forward(x)) == 0);
      QVERIFY(rel(fresh, at::linear(x, layer->weight, layer->bias)) < 0.05);
      // K or N not a multiple of 16: the layer's own dtype.
      models::Linear odd(60, 48);
      models::init_random(*odd, g);
      models::allow_fp8(*odd);
      const auto x60 = at::randn({3, 60}, g);
      QVERIFY(at::equal(odd->forward(x60), at::linear(x60, odd->weight, odd->bias)));
    }
    Precision bf16("bf16");
    QVERIFY(!models::fp8_wanted());
    QVERIFY(at::equal(layer->forward(x), at::linear(x, layer->weight, layer->bias)));
  }

  // Rows offered for an activation (by the kernel that wrote it, on a GPU) are what an fp8 layer
  // reads of that very tensor, as it is now: here the offer is deliberately not x's own rows, so
  // the output shows which the layer read. A copy, a view of other data, an x changed since and
  // a dropped offer read x itself; offers past the few held push out the oldest.
  void offeredRowsStandForTheirTensorAsItIs() {
    at::NoGradGuard no_grad;
    at::Generator g = at::detail::createCPUGenerator(9);
    models::Linear layer(32, 16);
    models::init_random(*layer, g);
    models::allow_fp8(*layer);
    const auto w = models::quantize_weight_fp8(layer->weight);
    Precision fp8("fp8");
    models::drop_fp8_rows();
    // The layer's output from given rows (x's shape: [2, 3, 32]).
    const auto from = [&](const models::Fp8Rows& r) {
      return models::scaled_linear_fp8_reference(r.q, r.scale, w, layer->bias, at::kFloat).view({2, 3, 16});
    };
    const auto own = [&](const at::Tensor& x) {
      const auto [q, s] = models::quantize_rows_fp8(x.reshape({6, 32}));
      return from({q, s});
    };
    auto x = at::randn({2, 3, 32}, g);
    const auto other = at::randn({6, 32}, g);
    const auto [oq, os] = models::quantize_rows_fp8(other);
    const models::Fp8Rows offered{oq, os};
    QVERIFY(!at::equal(own(x), from(offered)));

    const auto before = models::fp8_rows_counts();
    models::offer_fp8_rows(x, offered);
    QVERIFY(models::offered_fp8_rows(x).has_value());
    DIFFRACT_COMPARE_TENSORS(layer->forward(x), from(offered), 0);
    DIFFRACT_COMPARE_TENSORS(layer->forward(x), from(offered), 0);  // every layer reading x takes them
    DIFFRACT_COMPARE_TENSORS(layer->forward(x.clone()), own(x), 0);
    const auto after = models::fp8_rows_counts();
    QCOMPARE(after.offered, before.offered + 1);
    QCOMPARE(after.taken, before.taken + 2);
    QCOMPARE(after.quantised, before.quantised + 1);

    // Changed by an ATen op since the offer: quantised anew, and the offer is gone.
    x.add_(1);
    DIFFRACT_COMPARE_TENSORS(layer->forward(x), own(x), 0);
    QVERIFY(!models::offered_fp8_rows(x).has_value());

    // Rows of the wrong shape for x: named.
    models::offer_fp8_rows(x, {oq.narrow(0, 0, 5), os.narrow(0, 0, 5)});
    QVERIFY_THROWS_EXCEPTION(Error, layer->forward(x));
    models::drop_fp8_rows();
    QVERIFY(!models::offered_fp8_rows(x).has_value());
    DIFFRACT_COMPARE_TENSORS(layer->forward(x), own(x), 0);

    // A few offers stand at a time, the oldest pushed out first.
    std::vector<at::Tensor> xs;
    for (int i = 0; i < 5; ++i) {
      xs.push_back(at::randn({2, 3, 32}, g));
      models::offer_fp8_rows(xs.back(), offered);
    }
    QVERIFY(!models::offered_fp8_rows(xs.front()).has_value());
    for (int i = 1; i < 5; ++i) QVERIFY(models::offered_fp8_rows(xs[i]).has_value());
    DIFFRACT_COMPARE_TENSORS(layer->forward(xs[1]), from(offered), 0);
    // A bf16 job reads no offer.
    {
      Precision bf16("bf16");
      QVERIFY(at::equal(layer->forward(xs[2]), at::linear(xs[2], layer->weight, layer->bias)));
    }
    models::drop_fp8_rows();
    // On the CPU no kernel writes rows: nothing is wanted.
    QVERIFY(!models::fp8_rows_wanted(x));
    QVERIFY(!models::activation_with_fp8_rows(x, models::Fp8RowsActivation::GeluTanh).defined());
  }

  // Fused projections quantise their fused weight as one (per row: the same as each layer's).
  void fusedProjectionsRunInFp8() {
    at::NoGradGuard no_grad;
    at::Generator g = at::detail::createCPUGenerator(6);
    models::Linear a(32, 16), b(32, 32);
    models::init_random(*a, g);
    models::init_random(*b, g);
    const auto fused = models::FusedLinears::fuse({{&a, {a.get()}}, {&b, {b.get()}}});
    QVERIFY(fused);
    models::allow_fp8(*a);
    models::allow_fp8(*b);
    const auto x = at::randn({7, 32}, g);
    Precision fp8("fp8");
    const auto y = fused->project(x);
    DIFFRACT_COMPARE_TENSORS(fused->part(y, &a, 0), a->forward(x), 1e-6);
    DIFFRACT_COMPARE_TENSORS(fused->part(y, &b, 0), b->forward(x), 1e-6);
  }

  // A job's precision: fp8 changes the tiny SD model's latents a little, says so in the
  // metadata, and leaves the next bf16 job as it was; an unknown precision is named.
  void jobsRunInTheirPrecision() {
    auto pipe = pipeline::load_pipeline(test::fixtures() / "tiny-sd", "cpu");
    job::GenerationRequest r;
    r.model = (test::fixtures() / "tiny-sd").string();
    r.prompt = "a red apple";
    r.negative_prompt = "blurry";
    r.steps = 4;
    r.width = r.height = 64;
    r.seed = 2;
    const auto run = [&](const std::string& precision) {
      r.precision = precision;
      const auto g = pipe->generate(r, {}, job::CancelToken{});
      return std::make_pair(test::latents_tensor(g), nlohmann::json::parse(g.metadata_json));
    };
    const auto [bf16, bf16_meta] = run("");
    const auto [fp8, fp8_meta] = run("fp8");
    const auto [again, again_meta] = run("bf16");
    QCOMPARE(bf16_meta["precision"].get<std::string>(), std::string("bf16"));
    QCOMPARE(fp8_meta["precision"].get<std::string>(), std::string("fp8"));
    qInfo("tiny SD, 4 steps, fp8 (emulated) vs bf16 latents: relative L2 %.3g", rel(fp8, bf16));
    QVERIFY(rel(fp8, bf16) > 1e-5 && rel(fp8, bf16) < 0.1);
    QVERIFY(at::equal(again, bf16));
    r.precision = "fp16";
    DIFFRACT_EXPECT_ERROR(pipe->generate(r, {}, job::CancelToken{}), "precision 'fp16' is neither bf16 nor fp8");
  }

  // Presets, PNG parameters and lanes carry the precision; bad values are named.
  void precisionTravelsWithPresetsPngsAndLanes() {
    job::GenerationRequest r;
    r.precision = "fp8";
    const auto preset = engine::preset_from_request("p", "{subject}", r);
    QCOMPARE(preset.precision, std::string("fp8"));
    const auto parsed = engine::parse_preset(engine::preset_to_json(preset), "p.json");
    QCOMPARE(parsed.precision, std::string("fp8"));
    job::GenerationRequest back;
    engine::apply_preset(parsed, "x", back);
    QCOMPARE(back.precision, std::string("fp8"));
    DIFFRACT_EXPECT_ERROR(engine::parse_preset(R"({"name": "p", "prompt_template": "{subject}", "width": 64,
        "height": 64, "steps": 4, "sampler": "", "cfg": 5, "precision": "int4"})", "p.json"),
                          "p.json: field 'precision'", "'int4' is neither bf16 nor fp8");
    const auto png = engine::parse_png_parameters({{"diffract", R"({"prompt": "x", "precision": "fp8"})"}}, "x.png");
    QCOMPARE(*png.precision, std::string("fp8"));
    const auto set = engine::parse_lane_set(R"({"name": "s", "lanes": [{"strategy": "single"},
        {"strategy": "single", "precision": "fp8"}]})", "s.json");
    QCOMPARE(set.lanes[1].precision, std::string("fp8"));
    QCOMPARE(engine::lane_label(set.lanes[1]), std::string("single, fp8"));
    job::GenerationRequest group;
    const auto plans = engine::plan_lanes(group, set, {});
    QCOMPARE(plans[1].request.precision, std::string("fp8"));
    QCOMPARE(engine::lane_differences(plans[1], plans[0]), (std::vector<std::string>{"precision bf16 -> fp8"}));
    DIFFRACT_EXPECT_ERROR(engine::parse_lane_set(R"({"name": "s", "lanes": [{"strategy": "single", "precision": "fp4"}]})",
                                                 "s.json"),
                          "s.json", "precision", "bf16 or fp8");
  }
};

QTEST_GUILESS_MAIN(TestFp8)
#include "test_fp8.moc"
