// PipeFusion and cfg-pipefusion (core/parallel/pipefusion.h) over Flux's transformer on CPU
// virtual devices, with a tiny seeded Flux.1-dev: 2 double-stream then 3 single-stream blocks,
// one chain of 5 that the stages cut anywhere (at the join too, and across it).
#include <tuple>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>

#include "core/models/transformers/flux_transformer_2d.h"
#include "core/parallel/device_group.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/strategies.h"
// copy_weights, as the Flux pipeline makes its stage replicas; its header has a method named
// emit, Qt's keyword macro.
#pragma push_macro("emit")
#undef emit
#include "core/pipeline/pipeline_util.h"
#pragma pop_macro("emit")
#include "core/util/error.h"
#include "loop_inputs.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).norm() / b.to(at::kDouble).norm()).item<double>();
}

LoopOutput run(const Strategy& s, const LoopInputs& in) {
  auto group = DeviceGroup::virtual_cpu(s.devices());
  return s.run(*group, in);
}

PipeFusion pipefusion(int n, int m, int warm, bool cfg_split = false) {
  PipeFusion pf;
  pf.n = n;
  pf.patches = m;
  pf.warmup_steps = warm;
  pf.cfg_split = cfg_split;
  return pf;
}

}  // namespace

class TestFluxPipeFusion : public QObject {
  Q_OBJECT

  // 16x16 latents: 8x8 tokens of 2x2 latent patches, 8 token rows.
  models::FluxTransformer2DModel flux_ = test::tiny_flux(2, 3);
  test::FluxLoopInputs made_;

  LoopInputs inputs(int steps, int batch, double cfg) {
    made_ = test::flux_loop_inputs(flux_, steps, batch, cfg);
    return made_.in;
  }

  // PipeFusion as its header describes it, in one thread, written from the model's blocks: items
  // (step, patch) in order, each through every block with one K/V cache per block, the patch's
  // text copy and rope rows; the first `warm` steps whole.
  at::Tensor simulate(const LoopInputs& in, int m, int warm, double scale) {
    at::NoGradGuard no_grad;
    auto& model = flux_;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    const bool cfg = scale > 1;
    const auto context = cfg ? at::cat({made_.neg.context, made_.pos.context}) : made_.pos.context;
    const auto pooled = cfg ? at::cat({made_.neg.pooled, made_.pos.pooled}) : made_.pos.pooled;
    const std::int64_t b = context.size(0), s0 = context.size(1);
    std::vector<models::ImageKV> caches(model->num_blocks());
    auto x = in.latents.clone();
    const std::int64_t h = x.size(2), w = x.size(3), rows = h / m, patch_tokens = (rows / 2) * (w / 2);
    const auto rope = model->rope(at::zeros({s0, 3}), models::latent_image_ids(h, w, at::TensorOptions()));
    const auto guided = [&](const at::Tensor& out) {
      if (!cfg) return out;
      auto parts = out.chunk(2);
      return parts[0] + scale * (parts[1] - parts[0]);
    };
    // Latent rows [row0, row0 + count) of xin through every block.
    const auto pass = [&](const at::Tensor& xin, std::int64_t row0, std::int64_t count, double t) {
      const std::int64_t begin = (row0 / 2) * (w / 2), tokens = (count / 2) * (w / 2);
      models::FluxState s;
      s.temb = model->time_text_embed->forward(at::full({b}, t) / 1000, at::full({b}, made_.guidance), pooled);
      s.x = model->x_embedder->forward(models::pack_latents(xin.narrow(2, row0, count)));
      s.context = model->context_embedder->forward(context);
      s.text_tokens = s0;
      const auto rows_of = [&](const at::Tensor& r) {
        return at::cat({r.narrow(0, 0, s0), r.narrow(0, s0 + begin, tokens)});
      };
      s.rope = {rows_of(rope.cos), rows_of(rope.sin)};
      for (std::size_t l = 0; l < model->num_blocks(); ++l) model->run_block(l, s, caches[l], begin);
      return guided(models::unpack_latents(model->output(s), count, w));
    };
    for (int i = 0; i < in.steps; ++i) {
      const double t = sampler->timesteps()[static_cast<std::size_t>(i)];
      const auto xin = cfg ? at::cat({x, x}) : x;
      if (i < warm) {
        x = sampler->step(pass(xin, 0, h, t), i, x, {});
        continue;
      }
      auto next = x.clone();
      for (int q = 0; q < m; ++q)
        next.narrow(2, q * rows, rows).copy_(sampler->step(pass(xin, q * rows, rows, t), i, x.narrow(2, q * rows, rows), {}));
      x = next;
    }
    (void)patch_tokens;
    return x;
  }

 private slots:
  // Every step synchronous: one device's result, however the chain is cut (at the join of the
  // double- and single-stream blocks with 2 stages, across it with 3).
  void synchronousEqualsOneDevice() {
    for (double cfg : {1.0, 4.0}) {
      auto in = inputs(3, 1, cfg);
      const auto base = run(SingleDevice{}, in);
      for (auto [n, m] : {std::pair{1, 1}, std::pair{2, 2}, std::pair{2, 4}, std::pair{3, 4}, std::pair{5, 8}}) {
        const auto out = run(pipefusion(n, m, 3), in);
        qInfo("pipefusion %dx%d synchronous, cfg %.0f: max |diff| to one device %.3g", n, m, cfg,
              test::max_abs_diff(out.latents, base.latents));
        DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-5);
        QCOMPARE(out.stats.messages_per_step, std::vector<std::int64_t>(3, n < 2 ? 0 : n));
      }
      if (cfg > 1) {
        const auto split = run(pipefusion(2, 4, 3, true), in);
        DIFFRACT_COMPARE_TENSORS(split.latents, base.latents, 1e-5);
        QCOMPARE(split.stats.strategy, std::string("cfg-pipefusion"));
      }
    }
    // A batch of 2 (each image its own prompt rows).
    auto in = inputs(2, 2, 4.0);
    DIFFRACT_COMPARE_TENSORS(run(pipefusion(2, 2, 2), in).latents, run(SingleDevice{}, in).latents, 1e-5);
  }

  // Staleness on: the one-thread replay of the same algorithm, near one device; cfg-pipefusion
  // runs the batched pipeline's stale schedule.
  void staleMatchesTheReplay() {
    for (double cfg : {1.0, 4.0}) {
      for (auto [n, m, warm] : {std::tuple{2, 2, 1}, std::tuple{2, 4, 1}, std::tuple{3, 4, 2}, std::tuple{1, 2, 1},
                                std::tuple{5, 8, 1}}) {
        const int steps = 4;
        auto in = inputs(steps, 1, cfg);
        std::vector<int> reported;
        in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) { reported.push_back(i); };
        const auto out = run(pipefusion(n, m, warm), in);
        const auto replay = simulate(in, m, warm, cfg);
        DIFFRACT_COMPARE_TENSORS(out.latents, replay, 1e-5);
        QCOMPARE(reported, (std::vector<int>{0, 1, 2, 3}));
        const auto base = run(SingleDevice{}, in).latents;
        const double rel = rel_l2(out.latents, base);
        qInfo("pipefusion n=%d M=%d warm-up %d cfg %.0f: relative L2 to one device %.3g", n, m, warm, cfg, rel);
        QVERIFY(rel > 0 && rel < 0.3);
        for (int i = 0; i < steps; ++i)
          QCOMPARE(out.stats.messages_per_step[static_cast<std::size_t>(i)],
                   static_cast<std::int64_t>(PipeFusion::messages_per_step(i < warm, n, m)));
        // The activation between stages: the patch's 6 text and its image tokens, 32 wide.
        if (n == 2 && m == 4) {
          const std::int64_t rows_b = cfg > 1 ? 2 : 1, f = 4;
          const std::int64_t v_bytes = 1 * 16 * 4 * 16 * f, act = rows_b * (6 + 16) * 32 * f;
          QCOMPARE(out.stats.bytes_per_step.back(), m * (act + v_bytes));
        }
        if (cfg > 1 && n == 2) {
          const auto split = run(pipefusion(n, m, warm, true), in);
          qInfo("cfg-pipefusion 2x%d M=%d: max |diff| to batched pipefusion %.3g", n, m,
                test::max_abs_diff(split.latents, out.latents));
          DIFFRACT_COMPARE_TENSORS(split.latents, out.latents, 1e-5);
        }
      }
    }
  }

  // Each stage uses its blocks, the embedder on the first, the output on the last, the time
  // embedding everywhere; a rank given only those weights (as the pipeline's GPU replicas are)
  // runs the same job.
  void stagesHoldTheirWeights() {
    const int doubles = 2, singles = 3;
    QCOMPARE(PipeFusion::stage_blocks(1, 3, doubles + singles), (std::pair<int, int>{1, 3}));
    QVERIFY(PipeFusion::uses_weight("transformer_blocks.1.attn.to_q.weight", 1, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("single_transformer_blocks.0.proj_out.weight", 1, 3, doubles, singles));
    QVERIFY(!PipeFusion::uses_weight("single_transformer_blocks.1.proj_out.weight", 1, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("single_transformer_blocks.1.proj_out.weight", 2, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("x_embedder.weight", 0, 3, doubles, singles));
    QVERIFY(!PipeFusion::uses_weight("x_embedder.weight", 1, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("context_embedder.bias", 0, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("norm_out.linear.weight", 2, 3, doubles, singles));
    QVERIFY(!PipeFusion::uses_weight("proj_out.weight", 1, 3, doubles, singles));
    QVERIFY(PipeFusion::uses_weight("time_text_embed.guidance_embedder.linear_1.weight", 1, 3, doubles, singles));

    std::int64_t total = 0, shared = 0;
    for (const auto& kv : flux_->named_parameters(true)) {
      total += kv.value().numel();
      if (kv.key().rfind("time_text_embed.", 0) == 0) shared += kv.value().numel();
    }
    auto in = inputs(3, 1, 4.0);
    for (int n : {1, 2, 3, 5}) {
      const auto out = run(pipefusion(n, n == 3 ? 4 : 8, 1), in);
      std::int64_t sum = 0;
      for (auto w : out.stats.weights_per_rank) sum += w;
      QCOMPARE(static_cast<int>(out.stats.weights_per_rank.size()), n);
      QCOMPARE(sum, total + (n - 1) * shared);  // every weight on one stage, the time embedding on all
    }

    // Stage replicas: each rank a copy holding its stage's weights only, the others empty.
    const int n = 3;
    std::vector<models::FluxTransformer2DModel> replicas;
    for (int r = 0; r < n; ++r) {
      models::FluxTransformer2DModel copy(flux_->config);
      copy->eval();
      pipeline::detail::copy_weights(*flux_, *copy, c10::Device(c10::kCPU), [&](const std::string& name) {
        return PipeFusion::uses_weight(name, r, n, doubles, singles);
      });
      replicas.push_back(copy);
    }
    auto split_in = in;
    split_in.make_denoiser = [&](int rank, const c10::Device& d) -> std::unique_ptr<Denoiser> {
      return std::make_unique<FluxDenoiser>(replicas[static_cast<std::size_t>(rank)], made_.pos, made_.neg, 4.0,
                                            made_.guidance, at::kFloat, d);
    };
    DIFFRACT_COMPARE_TENSORS(run(pipefusion(n, 4, 1), split_in).latents, run(pipefusion(n, 4, 1), in).latents, 0);
  }

  void refusesWhatItCannotSplit() {
    auto in = inputs(2, 1, 4.0);
    DIFFRACT_EXPECT_ERROR(run(pipefusion(2, 3, 1), in), "8 rows of transformer patches", "16 latent rows / patch size 2",
                          "do not split into 3 equal patches");
    DIFFRACT_EXPECT_ERROR(run(pipefusion(6, 8, 1), in), "6 stages for a transformer of 5 blocks");
    DIFFRACT_EXPECT_ERROR(run(pipefusion(2, 4, 1, true), inputs(2, 1, 1.0)), "cfg-pipefusion", "needs CFG");
  }
};

QTEST_GUILESS_MAIN(TestFluxPipeFusion)
#include "test_flux_pipefusion.moc"
