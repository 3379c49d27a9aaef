// The step caches (core/parallel/step_caches.h): deepcache against the DeepCache package's
// DeepCacheSDHelper over diffusers' pipelines (tests/reference/make_deepcache_fixtures.py); the
// first-block cache on a UNet, SD3 and Flux and TeaCache on SD3 and Flux against the plain loop
// (threshold 0) and against one-thread replays of their decisions written from the models' parts.
#include <algorithm>
#include <fstream>
#include <functional>
#include <set>
#include <tuple>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/models/common/block_cache.h"
#include "core/parallel/device_group.h"
#include "core/parallel/registry.h"
#include "core/parallel/step_caches.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/factory.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "diffusers_case.h"
#include "loop_inputs.h"
#include "strategy_job.h"
#include "test_util.h"

using namespace diffract;
using namespace diffract::parallel;
namespace fs = std::filesystem;

namespace {

LoopOutput run(const Strategy& s, const LoopInputs& in) {
  auto group = DeviceGroup::virtual_cpu(s.devices());
  return s.run(*group, in);
}

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).norm() / b.to(at::kDouble).norm()).item<double>();
}

nlohmann::json deepcache_cases() {
  std::ifstream in(test::fixtures() / "deepcache" / "deepcache_cases.json");
  return nlohmann::json::parse(in);
}

FirstBlockCaching fbcache(double threshold) {
  FirstBlockCaching s;
  s.threshold = threshold;
  return s;
}

TeaCaching teacache(double threshold) {
  TeaCaching s;
  s.threshold = threshold;
  return s;
}

DeepCaching deepcache(int interval, int branch) {
  DeepCaching s;
  s.interval = interval;
  s.branch = branch;
  return s;
}

std::vector<int> range(int from, int to) {
  std::vector<int> v;
  for (int i = from; i < to; ++i) v.push_back(i);
  return v;
}

}  // namespace

class TestStepCaches : public QObject {
  Q_OBJECT

  models::UNet2DConditionModel unet_{nullptr};
  models::SD3Transformer2DModel sd3_ = test::tiny_sd3(3, /*sd35=*/false);
  models::FluxTransformer2DModel flux_ = test::tiny_flux(2, 2);

  test::UNetLoopInputs unet_inputs(int steps, double cfg, int batch = 1) {
    auto made = test::unet_loop_inputs(schedulers::SamplerKind::Euler, steps, batch, unet_, 9);
    made.in.make_denoiser = [runner = made.unet, pos = made.pos, neg = made.neg, cfg](
                                int, const c10::Device& d) -> std::unique_ptr<Denoiser> {
      return std::make_unique<UNetDenoiser>(runner, pos, neg, cfg, at::kFloat, d);
    };
    return made;
  }

  // The first-block cache on a UNet, replayed from the model's layers in one thread: conv_in and
  // the first down layer every step; the deep layers when that layer's residual (its output minus
  // conv_in's) moved by the threshold or more since the last full step (always at the first),
  // else their last output.
  std::pair<at::Tensor, std::vector<int>> replay_unet_fbcache(const test::UNetLoopInputs& made, double threshold,
                                                              double cfg) {
    at::NoGradGuard no_grad;
    auto& model = unet_;
    const auto [down, up] = model->deep_cache_split(FirstBlockCaching::kUNetBranch);
    auto sampler = schedulers::Sampler::create(made.in.kind, made.in.config, made.in.steps);
    models::UNetConditioning both;
    both.encoder_hidden_states = at::cat({made.neg.encoder_hidden_states, made.pos.encoder_hidden_states});
    auto x = made.in.latents.clone();
    at::Generator gen = made.in.generator.clone();
    at::Tensor deep, first;
    std::vector<int> reused;
    for (int i = 0; i < made.in.steps; ++i) {
      const auto in = sampler->scale_model_input(x, i);
      auto s = model->stage_begin(at::cat({in, in}), at::full({2}, sampler->timesteps()[static_cast<std::size_t>(i)]),
                                  both);
      model->forward_range(s, 0, 1, both);
      const auto conv_in = s.h;
      model->forward_range(s, 1, 2, both);
      const auto residual = s.h - conv_in;
      const bool full = i == 0 || models::relative_change(residual, first) >= threshold;
      if (full) first = residual;
      model->forward_range(s, 2, full ? up : down, both);
      if (full) deep = s.h;
      else {
        s.h = deep;
        reused.push_back(i);
      }
      model->forward_range(s, up, model->layer_count(), both);
      const auto parts = s.h.chunk(2);
      x = sampler->step(parts[0] + cfg * (parts[1] - parts[0]), i, x, gen);
    }
    return {x, reused};
  }

  // TeaCache replayed in one thread from a transformer's parts: `embed` gives the state after the
  // embedding, `modulated` the first block's modulated input from it, `image` its image tokens,
  // `blocks` runs every block and gives the image tokens after them, `out` the velocity from image
  // tokens; the rule: the first and last step in full, otherwise the rescaled changes summed since
  // the last full step decide.
  template <class Embed, class Modulated, class Image, class Blocks, class Out>
  std::pair<at::Tensor, std::vector<int>> replay_teacache(const LoopInputs& in, const std::vector<double>& poly,
                                                          double threshold, double cfg, Embed embed,
                                                          Modulated modulated, Image image, Blocks blocks, Out out) {
    at::NoGradGuard no_grad;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    auto x = in.latents.clone();
    at::Tensor previous, residual;
    double sum = 0;
    std::vector<int> reused;
    for (int i = 0; i < in.steps; ++i) {
      const double t = sampler->timesteps()[static_cast<std::size_t>(i)];
      auto state = embed(cfg > 1 ? at::cat({x, x}) : x, t);
      const auto m = modulated(state);
      bool reuse = false;
      if (i > 0 && i < in.steps - 1) {
        const double change = models::relative_change(m, previous);
        double r = 0;
        for (double c : poly) r = r * change + c;
        sum += r;
        reuse = sum < threshold;
      }
      if (!reuse) sum = 0;
      previous = m;
      const auto before = image(state);
      at::Tensor v;
      if (reuse) {
        reused.push_back(i);
        v = out(state, before + residual);
      } else {
        const auto after = blocks(state);
        residual = after - before;
        v = out(state, after);
      }
      if (cfg > 1) {
        const auto parts = v.chunk(2);
        v = parts[0] + cfg * (parts[1] - parts[0]);
      }
      x = sampler->step(v, i, x, {});
    }
    return {x, reused};
  }

  // The first-block cache on a transformer, replayed in one thread from its parts: `embed` gives
  // the state after the embedding, `image` its image tokens, `block` runs one block on it, `out`
  // the velocity from the state and image tokens; the rule: the first block every step, the
  // others only when its residual (its image tokens' output minus input) moved by the threshold or
  // more since the last step that ran them all (always at the first), else that step's residual
  // of the others added instead.
  template <class Embed, class Image, class Block, class Out>
  std::pair<at::Tensor, std::vector<int>> replay_fbcache(const LoopInputs& in, std::size_t blocks, double threshold,
                                                         double cfg, Embed embed, Image image, Block block, Out out) {
    at::NoGradGuard no_grad;
    auto sampler = schedulers::Sampler::create(in.kind, in.config, in.steps);
    auto x = in.latents.clone();
    at::Tensor first_then, rest;
    std::vector<int> reused;
    for (int i = 0; i < in.steps; ++i) {
      const double t = sampler->timesteps()[static_cast<std::size_t>(i)];
      auto state = embed(cfg > 1 ? at::cat({x, x}) : x, t);
      const auto before = image(state);
      block(0, state);
      const auto after_first = image(state);
      const auto first = after_first - before;
      at::Tensor tokens;
      if (first_then.defined() && models::relative_change(first, first_then) < threshold) {
        reused.push_back(i);
        tokens = after_first + rest;
      } else {
        for (std::size_t l = 1; l < blocks; ++l) block(l, state);
        tokens = image(state);
        first_then = first;
        rest = tokens - after_first;
      }
      auto v = out(state, tokens);
      if (cfg > 1) {
        const auto parts = v.chunk(2);
        v = parts[0] + cfg * (parts[1] - parts[0]);
      }
      x = sampler->step(v, i, x, {});
    }
    return {x, reused};
  }

  // The transformers' parts the replays are written from: the state after the embedding (both CFG
  // branches' conditioning when cfg > 1) and the velocity from a state and its image tokens.
  static std::function<models::SD3State(const at::Tensor&, double)> sd3_embed(models::SD3Transformer2DModel& m,
                                                                              const test::SD3LoopInputs& made, double cfg) {
    const auto context = cfg > 1 ? at::cat({made.neg.context, made.pos.context}) : made.pos.context;
    const auto pooled = cfg > 1 ? at::cat({made.neg.pooled, made.pos.pooled}) : made.pos.pooled;
    return [m, context, pooled](const at::Tensor& x, double t) mutable {
      return m->embed(x, context, pooled, at::full({x.size(0)}, t));
    };
  }
  static std::function<at::Tensor(models::SD3State, const at::Tensor&)> sd3_velocity(models::SD3Transformer2DModel& m) {
    return [m](models::SD3State s, const at::Tensor& tokens) mutable {
      s.x = tokens;
      return m->unpatchify_output(s);
    };
  }
  static std::function<models::FluxState(const at::Tensor&, double)> flux_embed(models::FluxTransformer2DModel& m,
                                                                                const test::FluxLoopInputs& made,
                                                                                double cfg) {
    const auto context = cfg > 1 ? at::cat({made.neg.context, made.pos.context}) : made.pos.context;
    const auto pooled = cfg > 1 ? at::cat({made.neg.pooled, made.pos.pooled}) : made.pos.pooled;
    const std::int64_t side = made.in.latents.size(2);
    const auto rope = m->rope(at::zeros({context.size(1), 3}), models::latent_image_ids(side, side, at::TensorOptions()));
    return [m, context, pooled, rope, guidance = made.guidance](const at::Tensor& x, double t) mutable {
      const auto b = x.size(0);
      return m->embed(models::pack_latents(x), context, pooled, at::full({b}, t) / 1000, at::full({b}, guidance), rope);
    };
  }
  static std::function<at::Tensor(const models::FluxState&, const at::Tensor&)> flux_velocity(
      models::FluxTransformer2DModel& m, std::int64_t side) {
    return [m, side](const models::FluxState& s, const at::Tensor& tokens) mutable {
      return models::unpack_latents(m->proj_out->forward(m->norm_out->forward(tokens, s.temb)), side, side);
    };
  }

  // A cache's loop against its one-thread replay (latents, reused steps): the same steps reused
  // and latents within 1e-5.
  static void expect_replay(const char* what, const Strategy& cache, const LoopInputs& in, double cfg, double threshold,
                            const at::Tensor& base, const std::pair<at::Tensor, std::vector<int>>& replay) {
    const auto out = run(cache, in);
    qInfo("%s cfg %.0f threshold %.2f: reused %s, relative L2 %.3g", what, cfg, threshold,
          nlohmann::json(out.stats.reused_steps).dump().c_str(), rel_l2(out.latents, base));
    QCOMPARE(out.stats.reused_steps, replay.second);
    DIFFRACT_COMPARE_TENSORS(out.latents, replay.first, 1e-5);
  }

 private slots:
  void initTestCase() { unet_ = models::load_unet_2d_condition(test::fixtures() / "tiny-sd" / "unet"); }

  // deepcache through the SD / SDXL pipelines against DeepCacheSDHelper over diffusers' (final
  // latents, CPU fp32), and its refresh steps in the stats; the same jobs without the cache match
  // diffusers' plain runs, and the cache's own change is far above the difference.
  void deepCacheMatchesTheDeepCachePackage_data() {
    QTest::addColumn<int>("index");
    const auto cases = deepcache_cases();
    for (std::size_t i = 0; i < cases.size(); ++i)
      QTest::newRow(cases[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(cases.size(), std::size_t(7));
  }
  void deepCacheMatchesTheDeepCachePackage() {
    QFETCH(int, index);
    const auto c = deepcache_cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    const auto expected = io::load_state_dict(test::fixtures() / "deepcache" / "deepcache_cases.safetensors");
    const auto model = test::fixtures() / c["model"].get<std::string>();
    auto pipe = pipeline::load_pipeline(model, "cpu");
    auto r = test::request_from_call(c, model.string(), /*distilled=*/false);
    r.sampler = "euler";
    const int interval = c["interval"], steps = r.steps;
    const auto plain = test::latents_tensor(pipe->generate(r, {}, job::CancelToken{}));
    r.options["DIFFRACT_DEEPCACHE_BRANCH"] = std::to_string(c["branch"].get<int>());
    r.options["DIFFRACT_CACHE_WARMUP"] = "0";  // DeepCache's own schedule
    const auto [cached, stats] = test::strategy_job(*pipe, r, "deepcache", interval, 1, 0, {});
    const auto want = expected.at(name), want_plain = expected.at(name + ".plain");
    const double err = test::max_abs_diff(cached, want), effect = test::max_abs_diff(want, want_plain);
    qInfo("%s: max |diff| to DeepCache %.3g (plain to diffusers' %.3g); DeepCache's own change %.3g", name.c_str(),
          err, test::max_abs_diff(plain, want_plain), effect);
    DIFFRACT_COMPARE_TENSORS(plain, want_plain, 1e-4);
    DIFFRACT_COMPARE_TENSORS(cached, want, 1e-4);
    QVERIFY(effect > 100 * err);
    std::vector<int> reused;
    for (int i = 0; i < steps; ++i)
      if (i % interval != 0) reused.push_back(i);
    QCOMPARE(stats["reused_steps"].get<std::vector<int>>(), reused);
    QCOMPARE(stats["evaluations"].get<int>(), steps - static_cast<int>(reused.size()));
  }

  void deepCacheAtIntervalOneIsThePlainLoop() {
    auto made = unet_inputs(4, 5.0);
    const auto base = run(SingleDevice{}, made.in);
    for (int branch : {0, 2, 5}) {
      const auto out = run(deepcache(1, branch), made.in);
      DIFFRACT_COMPARE_TENSORS(out.latents, base.latents, 1e-5);
      QVERIFY(out.stats.reused_steps.empty());
    }
    const auto cached = run(deepcache(2, 0), made.in);
    QCOMPARE(cached.stats.reused_steps, (std::vector<int>{1, 3}));
    {
      // The warm-up keeps the first half of the steps in full; then every second step reuses.
      const options::Overrides half{{"DIFFRACT_CACHE_WARMUP", "50"}};
      const options::JobOptionsScope scope(half);
      QCOMPARE(run(deepcache(2, 0), made.in).stats.reused_steps, (std::vector<int>{3}));
      QCOMPARE(run(fbcache(10), made.in).stats.reused_steps, (std::vector<int>{2, 3}));
    }
    qInfo("deepcache x2 branch 0: relative L2 to the plain loop %.3g", rel_l2(cached.latents, base.latents));
    QVERIFY(rel_l2(cached.latents, base.latents) > 0);
    DIFFRACT_EXPECT_ERROR(run(deepcache(2, 6), made.in), "DeepCache: branch 6 is outside 0..5");
    DIFFRACT_EXPECT_ERROR(run(deepcache(0, 0), made.in), "deepcache: the interval must be 1");
    // The split: conv_in and the first `branch` down layers, the up layers consuming their skips.
    QCOMPARE(unet_->deep_cache_split(0), (std::pair<int, int>{1, unet_->layer_count() - 2}));
    QCOMPARE(unet_->deep_cache_split(5).first, 6);
  }

  // The first-block cache on a UNet: threshold 0 is the plain loop; above any change every step
  // after the first reuses the deep layers; in between, the decisions of the one-thread replay.
  void firstBlockCacheOnAUNet() {
    const double cfg = 5.0;
    auto made = unet_inputs(6, cfg);
    const auto base = run(SingleDevice{}, made.in);
    const auto exact = run(fbcache(0), made.in);
    DIFFRACT_COMPARE_TENSORS(exact.latents, base.latents, 1e-5);
    QVERIFY(exact.stats.reused_steps.empty());
    QCOMPARE(run(fbcache(10), made.in).stats.reused_steps, range(1, 6));
    // A threshold between the changes the steps show, so that some reuse and some do not.
    for (double threshold : {0.05, 0.15, 0.3}) {
      const auto out = run(fbcache(threshold), made.in);
      const auto [replay, reused] = replay_unet_fbcache(made, threshold, cfg);
      qInfo("fbcache on a UNet, threshold %.2f: reused %s, relative L2 to the plain loop %.3g", threshold,
            nlohmann::json(out.stats.reused_steps).dump().c_str(), rel_l2(out.latents, base.latents));
      QCOMPARE(out.stats.reused_steps, reused);
      DIFFRACT_COMPARE_TENSORS(out.latents, replay, 1e-5);
      QCOMPARE(out.stats.cache_threshold, threshold);
    }
  }

  // TeaCache on SD3 (the plain change, no published polynomial) and Flux (TeaCache4FLUX's).
  void teaCacheOnTheTransformers() {
    for (double cfg : {1.0, 4.0}) {
      // SD3: 3 joint blocks, 16x16 latents.
      {
        auto made = test::sd3_loop_inputs(sd3_, 6, 1, cfg);
        const auto base = run(SingleDevice{}, made.in);
        const auto exact = run(teacache(0), made.in);
        DIFFRACT_COMPARE_TENSORS(exact.latents, base.latents, 1e-6);
        QVERIFY(exact.stats.reused_steps.empty());
        QCOMPARE(run(teacache(1e9), made.in).stats.reused_steps, range(1, 5));  // never the first or last
        auto& m = sd3_;
        for (double threshold : {0.1, 0.4}) {
          const auto replay = replay_teacache(
              made.in, models::TeaCache::identity(), threshold, cfg, sd3_embed(m, made, cfg),
              [&](const models::SD3State& s) {
                return m->transformer_blocks[0]->as<models::JointTransformerBlock>()->norm1->forward(s.x, s.temb).x;
              },
              [](const models::SD3State& s) { return s.x; },
              [&](models::SD3State s) {
                for (std::size_t l = 0; l < m->transformer_blocks->size(); ++l) m->run_block(l, s);
                return s.x;
              },
              sd3_velocity(m));
          expect_replay("teacache SD3", teacache(threshold), made.in, cfg, threshold, base.latents, replay);
          if (QTest::currentTestFailed()) return;
        }
      }
      // Flux: the modulated image tokens of the first double block, the residual over every block.
      {
        auto made = test::flux_loop_inputs(flux_, 6, 1, cfg);
        const auto base = run(SingleDevice{}, made.in);
        DIFFRACT_COMPARE_TENSORS(run(teacache(0), made.in).latents, base.latents, 1e-6);
        QCOMPARE(run(teacache(1e9), made.in).stats.reused_steps, range(1, 5));
        auto& m = flux_;
        for (double threshold : {0.5, 1.5}) {
          const auto replay = replay_teacache(
              made.in, models::TeaCache::flux(), threshold, cfg, flux_embed(m, made, cfg),
              [&](const models::FluxState& s) {
                return m->transformer_blocks[0]->as<models::FluxTransformerBlock>()->norm1->forward(s.x, s.temb).x;
              },
              [](const models::FluxState& s) { return s.x; },
              [&](models::FluxState s) {
                for (std::size_t l = 0; l < m->num_blocks(); ++l) m->run_block(l, s);
                return s.x.slice(1, s.text_tokens);
              },
              flux_velocity(m, made.in.latents.size(2)));
          expect_replay("teacache Flux", teacache(threshold), made.in, cfg, threshold, base.latents, replay);
          if (QTest::currentTestFailed()) return;
        }
      }
    }
  }

  // The first-block cache on SD3 and Flux: the steps it reuses and its latents are the one-thread
  // replay's, at thresholds between never and always reusing, among them some that reuse a step
  // and later refresh.
  void firstBlockCacheOnTheTransformers() {
    // Runs that reused a step and later ran one in full again (a refresh), per model.
    std::set<std::string> refreshed;
    const auto note = [&](const char* model, const std::vector<int>& reused, int steps) {
      for (int i = reused.empty() ? steps : reused.front() + 1; i < steps; ++i)
        if (std::find(reused.begin(), reused.end(), i) == reused.end()) refreshed.insert(model);
    };
    for (double cfg : {1.0, 4.0}) {
      {
        auto made = test::sd3_loop_inputs(sd3_, 6, 1, cfg);
        const auto base = run(SingleDevice{}, made.in);
        auto& m = sd3_;
        for (double threshold : {0.05, 0.3, 0.4, 0.5}) {
          const auto replay = replay_fbcache(
              made.in, m->transformer_blocks->size(), threshold, cfg, sd3_embed(m, made, cfg),
              [](const models::SD3State& s) { return s.x; },
              [&](std::size_t l, models::SD3State& s) { m->run_block(l, s); }, sd3_velocity(m));
          expect_replay("fbcache SD3", fbcache(threshold), made.in, cfg, threshold, base.latents, replay);
          if (QTest::currentTestFailed()) return;
          note("SD3", replay.second, made.in.steps);
        }
      }
      {
        auto made = test::flux_loop_inputs(flux_, 6, 1, cfg);
        const auto base = run(SingleDevice{}, made.in);
        auto& m = flux_;
        for (double threshold : {0.05, 0.2, 0.5}) {
          const auto replay = replay_fbcache(
              made.in, m->num_blocks(), threshold, cfg, flux_embed(m, made, cfg),
              [](const models::FluxState& s) { return s.joined ? s.x.slice(1, s.text_tokens) : s.x; },
              [&](std::size_t l, models::FluxState& s) { m->run_block(l, s); },
              flux_velocity(m, made.in.latents.size(2)));
          expect_replay("fbcache Flux", fbcache(threshold), made.in, cfg, threshold, base.latents, replay);
          if (QTest::currentTestFailed()) return;
          note("Flux", replay.second, made.in.steps);
        }
      }
    }
    // Otherwise the replays would only have checked the two ends of the rule.
    QCOMPARE(refreshed, (std::set<std::string>{"Flux", "SD3"}));
  }

  // Each cache runs the families it is written for and names why not the others; the registry
  // gives each its default threshold.
  void refusesWhatItCannotCache() {
    auto unet = unet_inputs(3, 5.0);
    auto sd3 = test::sd3_loop_inputs(sd3_, 3, 1, 4.0);
    DIFFRACT_EXPECT_ERROR(run(teacache(0.4), unet.in), "teacache does not run this model", "(SD3, Flux)");
    DIFFRACT_EXPECT_ERROR(run(deepcache(3, 0), sd3.in), "deepcache does not run this model", "UNet");
    job::StrategyParams p;
    p.name = "teacache";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SDXL, true), "teacache does not run sdxl", "deepcache");
    check_strategy(p, job::ModelFamily::Flux, false);
    p.name = "deepcache";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD3, true), "deepcache does not run sd3", "fbcache");
    check_strategy(p, job::ModelFamily::SD1, true);
    p.name = "fbcache";
    check_strategy(p, job::ModelFamily::SDXL, true);
    QCOMPARE(cache_threshold(p), 0.12);
    p.name = "teacache";
    QCOMPARE(cache_threshold(p), 0.4);
    QCOMPARE(dynamic_cast<TeaCaching&>(*make_strategy(p)).threshold, 0.4);
    p.cache_threshold = 0.7;
    QCOMPARE(dynamic_cast<TeaCaching&>(*make_strategy(p)).threshold, 0.7);
    p.cache_threshold = 11;
    DIFFRACT_EXPECT_ERROR(make_strategy(p), "cache threshold", "between 0 (never reuse) and 10");
    DIFFRACT_EXPECT_ERROR(check_image_inputs("deepcache", false), "deepcache does not take an init image");
    DIFFRACT_EXPECT_ERROR(check_controlnets("deepcache"), "deepcache does not run ControlNets");
  }

  // cfg-fbcache, cfg-deepcache, cfg-teacache: each CFG branch on its own (virtual) device with its
  // own cache, every decision on both branches' change. They reuse the steps the one-device cache
  // reuses (checked against the one-thread replays above) and end in its latents up to rounding;
  // threshold 0 is CFG-parallel's result.
  void cachesComposeWithCfgParallel() {
    const auto split = [](auto s) {
      s.split = CacheSplit::Cfg;
      return s;
    };
    auto unet = unet_inputs(6, 5.0);
    QCOMPARE(split(fbcache(0)).devices(), 2);
    QCOMPARE(split(fbcache(0)).name(), std::string("cfg-fbcache"));
    const auto cfg_parallel = run(CfgParallel{}, unet.in);
    const auto exact = run(split(fbcache(0)), unet.in);
    DIFFRACT_COMPARE_TENSORS(exact.latents, cfg_parallel.latents, 1e-5);
    QVERIFY(exact.stats.reused_steps.empty());
    QCOMPARE(exact.stats.evaluations, 12);  // both branches, every step
    const auto compare = [](const LoopOutput& one, const LoopOutput& two, const char* what) {
      qInfo("%s: reused %s on one device, %s on two", what, nlohmann::json(one.stats.reused_steps).dump().c_str(),
            nlohmann::json(two.stats.reused_steps).dump().c_str());
      QCOMPARE(two.stats.reused_steps, one.stats.reused_steps);
      // Batch-1 evaluations against the batch-2 ones: the rounding CFG-parallel itself shows
      // against one device (2.4e-5 on the tiny UNet).
      DIFFRACT_COMPARE_TENSORS(two.latents, one.latents, 1e-4);
    };
    std::set<std::size_t> counts;
    for (double threshold : {0.05, 0.15, 0.3, 10.0}) {
      const auto one = run(fbcache(threshold), unet.in);
      compare(one, run(split(fbcache(threshold)), unet.in), "cfg-fbcache");
      counts.insert(one.stats.reused_steps.size());
    }
    QVERIFY2(counts.size() >= 3, "the thresholds reuse different numbers of steps");
    for (int interval : {1, 2, 3}) compare(run(deepcache(interval, 0), unet.in), run(split(deepcache(interval, 0)), unet.in), "cfg-deepcache");
    auto sd3 = test::sd3_loop_inputs(sd3_, 6, 1, 4.0);
    for (double threshold : {0.0, 0.1, 0.4, 1e9})
      compare(run(teacache(threshold), sd3.in), run(split(teacache(threshold)), sd3.in), "cfg-teacache");
    for (double threshold : {0.1, 10.0})
      compare(run(fbcache(threshold), sd3.in), run(split(fbcache(threshold)), sd3.in), "cfg-fbcache on SD3");
    // Without CFG there is no second branch to put on the other device.
    DIFFRACT_EXPECT_ERROR(split(fbcache(0.1)).validate(1, false), "cfg-fbcache needs classifier-free guidance");
    job::StrategyParams p;
    p.name = "cfg-teacache";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SDXL, true), "cfg-teacache does not run sdxl");
    p.name = "cfg-deepcache";
    p.skip = 4;
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SD3, true), "cfg-deepcache does not run sd3");
    const auto deep = make_strategy(p);
    QCOMPARE(deep->devices(), 2);
    QCOMPARE(dynamic_cast<DeepCaching&>(*deep).interval, 4);
    p.name = "cfg-fbcache";
    QCOMPARE(cache_threshold(p), 0.12);
    QVERIFY(dynamic_cast<FirstBlockCaching&>(*make_strategy(p)).split == CacheSplit::Cfg);
  }

  // dp-fbcache, dp-teacache: the batch's images over the devices (3 images over 2 and 3, 4 over
  // 2: shares of unequal and equal size), each device's cache deciding on the whole batch's
  // change. The same steps reused as one device's cache over the whole batch, and its latents
  // up to the rounding data-parallel itself shows against one device.
  void cachesComposeWithDataParallel() {
    const auto split = [](auto s, int n) {
      s.split = CacheSplit::Batch;
      s.n = n;
      return s;
    };
    QCOMPARE(split(fbcache(0), 3).devices(), 3);
    QCOMPARE(split(teacache(0), 2).name(), std::string("dp-teacache"));
    const auto compare = [](const LoopOutput& one, const LoopOutput& many, const char* what, int n) {
      qInfo("%s on %d: reused %s on one device, %s split", what, n, nlohmann::json(one.stats.reused_steps).dump().c_str(),
            nlohmann::json(many.stats.reused_steps).dump().c_str());
      QCOMPARE(many.stats.reused_steps, one.stats.reused_steps);
      QCOMPARE(many.stats.devices, n);
      QCOMPARE(many.latents.sizes(), one.latents.sizes());
      DIFFRACT_COMPARE_TENSORS(many.latents, one.latents, 1e-4);
    };
    for (const auto& [batch, n] : std::vector<std::pair<int, int>>{{3, 2}, {4, 2}, {3, 3}}) {
      auto unet = unet_inputs(6, 5.0, batch);
      DataParallel dp;
      dp.n = n;
      const auto plain = run(dp, unet.in);
      const auto exact = run(split(fbcache(0), n), unet.in);
      DIFFRACT_COMPARE_TENSORS(exact.latents, plain.latents, 1e-5);  // threshold 0: data-parallel's loop
      QVERIFY(exact.stats.reused_steps.empty());
      std::set<std::size_t> counts;
      for (double threshold : {0.05, 0.15, 0.3, 10.0}) {
        const auto one = run(fbcache(threshold), unet.in);
        compare(one, run(split(fbcache(threshold), n), unet.in), "dp-fbcache", n);
        counts.insert(one.stats.reused_steps.size());
      }
      QVERIFY2(counts.size() >= 3, "the thresholds reuse different numbers of steps");
      auto flux = test::flux_loop_inputs(flux_, 6, batch, 1.0);
      for (double threshold : {0.0, 0.1, 0.4, 1e9})
        compare(run(teacache(threshold), flux.in), run(split(teacache(threshold), n), flux.in), "dp-teacache on Flux", n);
    }
    // Each device decides on the whole batch: images that alone would reuse different steps
    // reuse the batch's. Two prompts' worth of noise: the second image's latents scaled up, so
    // its share's change differs from the batch's.
    auto unet = unet_inputs(6, 5.0, 2);
    unet.in.latents = at::cat({unet.in.latents.narrow(0, 0, 1), unet.in.latents.narrow(0, 1, 1) * 4});
    const auto one = run(fbcache(0.15), unet.in);
    compare(one, run(split(fbcache(0.15), 2), unet.in), "dp-fbcache, unequal images", 2);
    std::set<std::vector<int>> alone;  // what each image's share would reuse deciding by itself
    for (int image : {0, 1}) {
      auto in = unet.in;
      in.latents = unet.in.latents.narrow(0, image, 1).contiguous();
      in.make_denoiser = [make = unet.in.make_denoiser, image](int r, const c10::Device& d) {
        return make(r, d)->rows(image, 1);
      };
      const auto mine = run(fbcache(0.15), in).stats.reused_steps;
      qInfo("image %d alone: reused %s", image, nlohmann::json(mine).dump().c_str());
      alone.insert(mine);
    }
    // The premise: the two images alone decide differently, so a device deciding on its own
    // share would reuse other steps than the batch does, and the comparison above would fail.
    QVERIFY2(alone.size() == 2, "each image alone would reuse other steps");
    // A batch smaller than the devices leaves a device without images.
    DIFFRACT_EXPECT_ERROR(split(fbcache(0.1), 3).validate(2, true), "dp-fbcache splits the batch's images");
    job::StrategyParams p;
    p.name = "dp-teacache";
    DIFFRACT_EXPECT_ERROR(check_strategy(p, job::ModelFamily::SDXL, true), "dp-teacache does not run sdxl");
    p.name = "dp-fbcache";
    p.devices = 4;
    const auto fb = make_strategy(p);
    QCOMPARE(fb->devices(), 4);
    QCOMPARE(dynamic_cast<FirstBlockCaching&>(*fb).threshold, 0.12);
    QVERIFY(!find_strategy("dp-deepcache"));
  }

  // teacache through the SD3 pipeline: threshold 0 is the plain job; above any change, every step
  // but the first and last reuses; the stats and metadata carry the threshold.
  void teaCacheThroughThePipeline() {
    auto pipe = pipeline::load_pipeline(test::fixtures() / "sd3_pipeline" / "tiny-sd3", "cpu");
    job::GenerationRequest r;
    r.model = (test::fixtures() / "sd3_pipeline" / "tiny-sd3").string();
    r.prompt = "a red apple";
    r.negative_prompt = "blurry";
    r.steps = 5;
    r.cfg = 4.0;
    r.width = r.height = 32;
    r.seed = 3;
    const auto base = test::latents_tensor(pipe->generate(r, {}, job::CancelToken{}));
    r.strategy.cache_threshold = 0;
    DIFFRACT_COMPARE_TENSORS(test::strategy_job(*pipe, r, "teacache", 1, 1, 0, {}).first, base, 1e-6);
    r.strategy.cache_threshold = 10;
    int cached = 0;
    job::JobObserver obs;
    obs.on_step = [&](const job::StepEvent& e) { cached += e.cached; };
    const auto [reuse, stats] = test::strategy_job(*pipe, r, "teacache", 1, 1, 0, obs);
    QCOMPARE(stats["reused_steps"].get<std::vector<int>>(), range(1, 4));
    QCOMPARE(stats["cache_threshold"].get<double>(), 10.0);
    QCOMPARE(cached, 3);
    QVERIFY(rel_l2(reuse, base) > 0);
  }
};

QTEST_GUILESS_MAIN(TestStepCaches)
#include "test_step_caches.moc"
