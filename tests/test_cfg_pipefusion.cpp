// cfg-pipefusion (CFG-parallel x PipeFusion, core/parallel/pipefusion.h) on CPU virtual devices
// with a tiny seeded MMDiT: one pipeline per CFG branch, the heads swapping patch outputs.
#include <atomic>
#include <tuple>

#include <ATen/CPUGeneratorImpl.h>

#include <nlohmann/json.hpp>

#include "core/engine/devices.h"
#include "core/models/common/layers.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/parallel/device_group.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/strategies.h"
// copy_weights, as the SD3 pipeline makes its stage replicas; its header has a method named
// emit, Qt's keyword macro.
#pragma push_macro("emit")
#undef emit
#include "core/pipeline/pipeline_util.h"
#pragma pop_macro("emit")
#include "core/pipeline/stable_diffusion_3.h"
#include "core/util/error.h"
#include "loop_inputs.h"
#include "strategy_job.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;

namespace {

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).norm() / b.to(at::kDouble).norm()).item<double>();
}

}  // namespace

class TestCfgPipeFusion : public QObject {
  Q_OBJECT

  // test_parallel's tiny MMDiT: 4 joint blocks, qk norm, SD3.5's second attention in blocks 0
  // and 1; 16x16 latents are 8x8 tokens (8 rows of transformer patches).
  models::SD3Transformer2DConfig config_;
  models::SD3Transformer2DModel sd3_{nullptr};
  SD3Conditioning pos_, neg_;

  models::SD3Transformer2DModel& sd3() {
    if (!sd3_) {
      sd3_ = test::tiny_sd3(4, /*sd35=*/true);
      config_ = sd3_->config;
    }
    return sd3_;
  }

  LoopInputs sd3_inputs(int steps, int batch, double cfg) {
    auto made = test::sd3_loop_inputs(sd3(), steps, batch, cfg);
    pos_ = made.pos;
    neg_ = made.neg;
    return made.in;
  }

  static LoopOutput run(const Strategy& s, const LoopInputs& in) {
    auto group = DeviceGroup::virtual_cpu(s.devices());
    return s.run(*group, in);
  }

  static PipeFusion cfg_pipefusion(int n, int m, int warm) {
    PipeFusion pf;
    pf.cfg_split = true;
    pf.n = n;
    pf.patches = m;
    pf.warmup_steps = warm;
    return pf;
  }

  // The split design in one thread, written from the header rather than from the loop: two
  // independent pipelines (one per branch, batch B, each with its own K/V cache per block) that
  // see the same items (step, patch) in order; each patch's two outputs are combined and the
  // patch stepped at once. The first `warm` steps whole.
  at::Tensor replay_split(const LoopInputs& in, int m, int warm, double scale) {
    at::NoGradGuard no_grad;
    auto& model = sd3();
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    const auto layers = static_cast<std::size_t>(model->config.num_layers);
    std::vector<models::SD3BlockCache> caches[2] = {std::vector<models::SD3BlockCache>(layers),
                                                    std::vector<models::SD3BlockCache>(layers)};
    const SD3Conditioning* branch[2] = {&pos_, &neg_};
    auto x = in.latents.clone();
    const std::int64_t h = x.size(2), rows = h / m, p = model->config.patch_size;
    const std::int64_t patch_tokens = (rows / p) * (x.size(3) / p);
    // Branch b's output for latent rows [q rows, (q + 1) rows) (all rows when whole).
    const auto pass = [&](int b, int i, const at::Tensor& xin, bool whole, int q) {
      const auto& c = *branch[b];
      const auto t = at::full({xin.size(0)}, sampler->timesteps()[static_cast<std::size_t>(i)], at::kFloat);
      models::SD3State s;
      s.temb = model->time_text_embed->forward(t, c.pooled);
      s.width = x.size(3);
      s.context = model->context_embedder->forward(c.context);
      if (whole) {
        s.x = model->pos_embed->forward(xin);
        s.height = h;
      } else {
        s.x = model->pos_embed->forward_rows(xin.narrow(2, q * rows, rows), q * rows, h);
        s.height = rows;
      }
      for (std::size_t l = 0; l < layers; ++l) model->run_block(l, s, caches[b][l], whole ? 0 : q * patch_tokens);
      return model->unpatchify_output(s);
    };
    const auto guided = [&](const at::Tensor& c, const at::Tensor& u) { return u + scale * (c - u); };
    for (int i = 0; i < in.steps; ++i) {
      if (i < warm) {
        x = sampler->step(guided(pass(0, i, x, true, 0), pass(1, i, x, true, 0)), i, x, {});
        continue;
      }
      auto next = x.clone();
      for (int q = 0; q < m; ++q)
        next.narrow(2, q * rows, rows)
            .copy_(sampler->step(guided(pass(0, i, x, false, q), pass(1, i, x, false, q)), i, x.narrow(2, q * rows, rows), {}));
      x = next;
    }
    return x;
  }

 private slots:
  // (1) Staleness off (every step synchronous): one device's result, and CFG-parallel's for one
  // stage per pipeline.
  void synchronousEqualsOneDevice() {
    for (int batch : {1, 2}) {
      auto in = sd3_inputs(4, batch, 4.0);
      const auto base = run(SingleDevice{}, in);
      DIFFRACT_COMPARE_TENSORS(run(CfgParallel{}, in).latents, base.latents, 1e-5);
      for (auto [n, m] : {std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 2}, std::pair{2, 4}, std::pair{4, 4}}) {
        const auto pf = cfg_pipefusion(n, m, 4);
        QCOMPARE(pf.devices(), 2 * n);
        const auto out = run(pf, in);
        qInfo("cfg-pipefusion 2x%d M=%d synchronous, batch %d: max |diff| to one device %.3g", n, m, batch,
              test::max_abs_diff(out.latents, base.latents));
        DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-5);
        QCOMPARE(out.stats.strategy, std::string("cfg-pipefusion"));
        QCOMPARE(out.stats.devices, 2 * n);
        QCOMPARE(out.stats.messages_per_step, std::vector<std::int64_t>(4, n < 2 ? 2 : 2 * n + 2));
      }
    }
  }

  // (2) Staleness on: the same stale schedule as PipeFusion with both branches batched (each
  // pipeline's cache holds its branch's rows of the batched cache, the heads combine what the
  // batched tail would), so the same result up to batch-1 vs batch-2 rounding; and the
  // one-thread replay of the split. Then (3) the messages and bytes per step, and the weights.
  void staleMatchesBatchedPipeFusion() {
    for (auto [n, m, warm] : {std::tuple{2, 2, 1}, std::tuple{2, 4, 1}, std::tuple{1, 2, 1}, std::tuple{3, 4, 2},
                              std::tuple{4, 4, 1}}) {
      const int steps = 5;
      const double scale = 4.0;
      auto in = sd3_inputs(steps, 1, scale);
      std::vector<int> reported;
      in.on_step = [&](int i, const at::Tensor& out, const at::Tensor& before, const at::Tensor& after) {
        reported.push_back(i);  // rank 0 alone: every step once, in order
        QCOMPARE(out.sizes(), before.sizes());
        QCOMPARE(after.sizes(), before.sizes());
      };
      const auto out = run(cfg_pipefusion(n, m, warm), in);
      QCOMPARE(reported, (std::vector<int>{0, 1, 2, 3, 4}));
      in.on_step = nullptr;
      PipeFusion batched;
      batched.n = n;
      batched.patches = m;
      batched.warmup_steps = warm;
      const auto ref = run(batched, in);
      const auto replay = replay_split(in, m, warm, scale);
      const auto base = run(SingleDevice{}, in).latents;
      const double to_batched = test::max_abs_diff(out.latents, ref.latents);
      const double to_replay = test::max_abs_diff(out.latents, replay);
      qInfo("cfg-pipefusion 2x%d M=%d warm-up %d: max |diff| to batched pipefusion %.3g, to the replay %.3g; "
            "relative L2 to one device %.3g (batched pipefusion's %.3g)",
            n, m, warm, to_batched, to_replay, rel_l2(out.latents, base), rel_l2(ref.latents, base));
      DIFFRACT_COMPARE_TENSORS(out.latents, ref.latents, 1e-5);
      DIFFRACT_COMPARE_TENSORS(out.latents, replay, 1e-5);
      // Staleness is really on (M > 1), and bounded.
      QVERIFY(rel_l2(out.latents, base) > 1e-4 && rel_l2(out.latents, base) < 0.2);

      // (3) Messages per step: each pipeline's chain and tail -> head (n per pass when n >= 2),
      // and the heads' swap (2 per pass); M passes per pipelined step.
      const std::int64_t tokens = 64, text = 6, dim = 16, f = 4, v_patch = 1 * 4 * 16 * 16 * f;
      for (int i = 0; i < steps; ++i) {
        const bool sync = i < warm;
        const auto got = out.stats.messages_per_step[static_cast<std::size_t>(i)];
        QCOMPARE(got, static_cast<std::int64_t>(PipeFusion::messages_per_step(sync, n, m, true)));
        const std::int64_t pass = (n < 2 ? 0 : 2 * n) + 2;
        QCOMPARE(got, sync ? pass : m * pass);
        // Bytes: per pipeline (n - 1) activations of batch 1 (not 2) and the branch output to the
        // head; the swap moves two outputs. Over a step the patches add up to whole latents.
        const std::int64_t act = sync ? (tokens + text) * dim * f : m * (tokens / m + text) * dim * f;
        const std::int64_t bytes = 2 * ((n - 1) * act + (n < 2 ? 0 : v_patch)) + 2 * v_patch;
        QCOMPARE(out.stats.bytes_per_step[static_cast<std::size_t>(i)], bytes);
      }
      std::int64_t sum = 0;
      for (auto b : out.stats.bytes_per_step) sum += b;
      QCOMPARE(out.stats.bytes_sent, sum);
      // Weights: rank r holds stage r % n, the same as batched PipeFusion's rank r % n.
      QCOMPARE(static_cast<int>(out.stats.weights_per_rank.size()), 2 * n);
      for (int r = 0; r < 2 * n; ++r)
        QCOMPARE(out.stats.weights_per_rank[static_cast<std::size_t>(r)], ref.stats.weights_per_rank[static_cast<std::size_t>(r % n)]);
      QVERIFY(out.stats.note.find("2 pipelines") != std::string::npos);
    }
  }

  // Each rank's model a replica holding only the weights of stage r % n, the others emptied, as
  // the SD3 pipeline makes its GPU replicas (copy_weights with PipeFusion::uses_weight): the same
  // result as the shared model, so no rank touches a weight outside its stage. Handing rank r
  // stage r instead (the mistake stage_of prevents) fails.
  void stageReplicasHoldEnough() {
    const int n = 2, steps = 3;
    auto in = sd3_inputs(steps, 1, 4.0);
    const auto pf = cfg_pipefusion(n, 2, 1);
    const auto shared = run(pf, in);
    const int layers = static_cast<int>(sd3()->config.num_layers);
    const auto replicas = [&](bool right) {
      std::vector<models::SD3Transformer2DModel> out;
      for (int r = 0; r < pf.devices(); ++r) {
        models::SD3Transformer2DModel copy(sd3()->config);
        copy->eval();
        const int stage = right ? pf.stage_of(r) : r;
        pipeline::detail::copy_weights(*sd3(), *copy, c10::Device(c10::kCPU), [=](const std::string& name) {
          return PipeFusion::uses_weight(name, stage, n, layers);
        });
        out.push_back(copy);
      }
      return out;
    };
    QCOMPARE(pf.stage_of(0), 0);
    QCOMPARE(pf.stage_of(1), 1);
    QCOMPARE(pf.stage_of(2), 0);
    QCOMPARE(pf.stage_of(3), 1);
    for (bool right : {true, false}) {
      const auto models = replicas(right);
      auto split = in;
      split.make_denoiser = [&models, pos = pos_, neg = neg_](int r, const c10::Device& d) -> std::unique_ptr<Denoiser> {
        return std::make_unique<SD3Denoiser>(models[static_cast<std::size_t>(r)], pos, neg, 4.0, at::kFloat, d);
      };
      if (right) {
        const auto out = run(pf, split);
        QVERIFY(at::equal(out.latents, shared.latents));
        QCOMPARE(out.stats.weights_per_rank, shared.stats.weights_per_rank);
      } else {
        bool threw = false;
        try {
          run(pf, split);
        } catch (const std::exception&) {
          threw = true;  // an empty weight reached a kernel
        }
        QVERIFY(threw);
      }
    }
  }

  // (4) What cannot run says so.
  void refusals() {
    for (int devices : {0, 1, 3, 5})
      DIFFRACT_EXPECT_ERROR(make_strategy("cfg-pipefusion", devices), "cfg-pipefusion", "even number of devices, 2 or more");
    const auto s = make_strategy("cfg-pipefusion", 4, 4);
    QCOMPARE(s->name(), std::string("cfg-pipefusion"));
    QCOMPARE(s->devices(), 4);
    QCOMPARE(dynamic_cast<PipeFusion&>(*s).n, 2);
    QCOMPARE(dynamic_cast<PipeFusion&>(*s).patch_count(), 4);
    QCOMPARE(dynamic_cast<PipeFusion&>(*make_strategy("cfg-pipefusion", 6)).patch_count(), 3);  // one per stage
    QCOMPARE(make_strategy("cfg-pipefusion", 2)->devices(), 2);
    QCOMPARE(make_strategy("pipefusion", 2)->name(), std::string("pipefusion"));
    DIFFRACT_EXPECT_ERROR(make_strategy("tensor-parallel", 2), "unknown strategy", "cfg-pipefusion", "cfg-driffusion");
    // No CFG: validate (as the pipelines call it) and run.
    DIFFRACT_EXPECT_ERROR(s->validate(1, false), "needs CFG");
    DIFFRACT_EXPECT_ERROR(run(*s, sd3_inputs(2, 1, 1.0)), "cfg-pipefusion", "needs CFG");
    s->validate(1, true);
    // More patches than stages, stages than blocks; latent rows; the sampler; the group's size.
    DIFFRACT_EXPECT_ERROR(run(*make_strategy("cfg-pipefusion", 6, 2), sd3_inputs(2, 1, 4.0)), "2 patches for 3 stages");
    DIFFRACT_EXPECT_ERROR(run(*make_strategy("cfg-pipefusion", 10, 8), sd3_inputs(2, 1, 4.0)),
                          "cfg-pipefusion: 5 stages for a transformer of 4 blocks");
    DIFFRACT_EXPECT_ERROR(run(*make_strategy("cfg-pipefusion", 2, 3), sd3_inputs(2, 1, 4.0)), "do not split into 3 equal");
    auto euler = sd3_inputs(2, 1, 4.0);
    euler.kind = schedulers::SamplerKind::DPMPP2M;
    DIFFRACT_EXPECT_ERROR(run(*s, euler), "cfg-pipefusion steps the latents a patch at a time");
    auto three = DeviceGroup::virtual_cpu(3);
    DIFFRACT_EXPECT_ERROR(s->run(*three, sd3_inputs(2, 1, 4.0)), "cfg-pipefusion needs 4 device(s)");
    // An SDXL UNet has no joint blocks.
    {
      auto unet = models::load_unet_2d_condition(test::fixtures() / "tiny-sdxl" / "unet");
      unet->eval();
      const auto& c = unet->config;
      at::Generator g = at::detail::createCPUGenerator(7);
      models::UNetConditioning pos, neg;
      pos.encoder_hidden_states = at::randn({1, 5, c.cross_attention_dim.front()}, g);
      neg.encoder_hidden_states = at::randn({1, 5, c.cross_attention_dim.front()}, g);
      const int64_t pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim;
      pos.text_embeds = at::randn({1, pooled}, g);
      neg.text_embeds = at::randn({1, pooled}, g);
      pos.time_ids = neg.time_ids = at::tensor({16.0f, 16.0f, 0.0f, 0.0f, 16.0f, 16.0f}).unsqueeze(0);
      LoopInputs in;
      in.kind = schedulers::SamplerKind::Euler;
      in.config = schedulers::SchedulerConfig::from_json(test::fixtures() / "tiny-sd" / "scheduler" / "scheduler_config.json", in.kind);
      in.steps = 2;
      in.latents = at::randn({1, c.in_channels, c.sample_size, c.sample_size}, g);
      in.generator = g;
      auto runner = std::make_shared<models::UNetGraphRunner>(unet);
      in.make_denoiser = [runner, pos, neg](int, const c10::Device& d) -> std::unique_ptr<Denoiser> {
        return std::make_unique<UNetDenoiser>(runner, pos, neg, 5.0, at::kFloat, d);
      };
      DIFFRACT_EXPECT_ERROR(run(*s, in), "this model has none");
    }
    // The GPU chooser pairs GPUs: an even count from the first enabled one.
    auto c = engine::choose_devices({0, 1, 2}, "cfg-pipefusion", 1);
    QVERIFY2(c.error.empty(), c.error.c_str());
    QCOMPARE(c.devices, 2);
    c = engine::choose_devices({0, 1, 2, 3}, "cfg-pipefusion", 1);
    QCOMPARE(c.devices, 4);
    QVERIFY(!engine::choose_devices({0}, "cfg-pipefusion", 1).error.empty());
  }

  // Through the SD3 pipeline (tests/reference/make_sd3_pipeline_fixtures.py's tiny-sd3, 2 joint
  // blocks) on 4 CPU virtual devices: the job's metadata, steps and previews, and batched
  // PipeFusion's latents on 2. (CPU ranks share the pipeline's transformer; the GPU replicas'
  // stage_of hand-off is what stageReplicasHoldEnough checks.)
  void sd3PipelineRunsIt() {
    auto pipe = pipeline::StableDiffusion3::load(test::fixtures() / "sd3_pipeline" / "tiny-sd3", "cpu");
    job::GenerationRequest r;
    r.model = (test::fixtures() / "sd3_pipeline" / "tiny-sd3").string();
    r.prompt = "a red apple";
    r.negative_prompt = "blurry";
    r.steps = 4;
    r.cfg = 5.0;
    r.seed = 3;
    r.preview_every = 2;
    job::CancelToken never;
    int previews = 0, steps = 0;
    job::JobObserver obs;
    obs.on_preview = [&](const job::PreviewEvent&) { ++previews; };
    obs.on_step = [&](const job::StepEvent&) { ++steps; };
    const auto run = [&](const std::string& name, int devices, int patches) {
      previews = steps = 0;
      return test::strategy_job(*pipe, r, name, devices, r.batch, patches, obs);
    };
    auto plain = pipe->generate(r, {}, never);
    const auto base = test::latents_tensor(plain);
    const auto [batched, pf_stats] = run("pipefusion", 2, 4);
    const auto [split, stats] = run("cfg-pipefusion", 4, 4);
    QCOMPARE(steps, 4);
    QCOMPARE(previews, 2);
    qInfo("SD3 pipeline cfg-pipefusion 2x2 M=4: max |diff| to pipefusion %.3g, relative L2 to one device %.3g",
          test::max_abs_diff(split, batched), rel_l2(split, base));
    DIFFRACT_COMPARE_TENSORS(split, batched, 1e-5);
    QVERIFY(rel_l2(split, base) > 0 && rel_l2(split, base) < 0.2);
    QCOMPARE(stats["messages_per_step"].get<std::vector<int>>(), (std::vector<int>{6, 24, 24, 24}));
    const auto weights = stats["weights_per_rank"].get<std::vector<std::int64_t>>();
    const auto pf_weights = pf_stats["weights_per_rank"].get<std::vector<std::int64_t>>();
    QCOMPARE(weights, (std::vector<std::int64_t>{pf_weights[0], pf_weights[1], pf_weights[0], pf_weights[1]}));
    const auto refused = [&](job::GenerationRequest q, const std::string& name, int devices) {
      q.strategy.name = name;
      q.strategy.devices = devices;
      pipe->generate(q, {}, never);
    };
    DIFFRACT_EXPECT_ERROR(refused(r, "cfg-pipefusion", 3), "even number of devices");
    DIFFRACT_EXPECT_ERROR(refused(r, "cfg-pipefusion", 8), "4 stages for a transformer of 2 blocks");
    auto no_cfg = r;
    no_cfg.cfg = 1.0;
    DIFFRACT_EXPECT_ERROR(refused(no_cfg, "cfg-pipefusion", 4), "needs CFG");
  }

  // A cancel while patches are in flight ends every rank of both pipelines without a hang.
  void cancelEndsBothPipelines() {
    auto in = sd3_inputs(6, 1, 4.0);
    job::CancelToken token;
    in.cancel = &token;
    in.on_step = [&](int i, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
      if (i == 2) token.cancel();
    };
    bool cancelled = false;
    try {
      run(cfg_pipefusion(2, 4, 1), in);
    } catch (const job::Cancelled&) {
      cancelled = true;
    }
    QVERIFY(cancelled);
  }
};

QTEST_GUILESS_MAIN(TestCfgPipeFusion)
#include "test_cfg_pipefusion.moc"
