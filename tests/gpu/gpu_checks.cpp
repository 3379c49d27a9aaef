// Checks that need CUDA devices (and for some, two GPUs and NCCL), run on the GPU machine:
//   diffract-gpu-checks CHECK [CHECK...], each of groupnorm|geglu|layernorm|conv_bias|upload|clip_graph|graphs|graph_warmups|oom_parallel|cancel_any|stage_graphs|previews|taesd|nccl|strategies|wide|qkv|cancel|failure|sd3|cfg_pipefusion|parallel_vae|vae_bands|gemm|flux|flux_files|caches|fp8|tuning|prepare|gemm_gelu|modulation|fp8_rows
// Exit 0: passed; 1: one failed (the reasons printed); 77: all skipped (too few GPUs).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <nlohmann/json.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include "core/io/upload.h"
#include "core/engine/compare.h"
#include "core/engine/engine.h"
#include "core/metrics/metrics.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/models/common/attention.h"
#include "core/models/common/fp8_linear.h"
#include "core/models/common/geglu.h"
#include "core/models/common/layer_norm.h"
#include "core/models/common/layers.h"
#include "core/models/common/patch_parallel.h"
#include "core/models/common/resnet.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/common/rotary.h"
#include "core/models/transformers/flux_transformer_2d.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_graphs.h"
#include "core/parallel/asyncdiff.h"
#include "core/parallel/communicator.h"
#include "core/parallel/device_group.h"
#include "core/parallel/distrifusion.h"
#include "core/parallel/parallel_vae.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/strategies.h"
#include "core/pipeline/clip_graph.h"
#include "core/pipeline/flux.h"
#include "core/pipeline/stable_diffusion.h"
#include "core/schedulers/sampler.h"
#include "core/util/device_work.h"
#include "core/util/error.h"
#include "core/util/graphed_function.h"
#include "core/util/options.h"
#include "tests/cancel_storm.h"

using namespace diffract;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "  ok    " : "  FAIL  ") << what << "\n";
  if (!ok) ++failures;
}

struct Skip {
  std::string why;
};

void need_gpus(int n) {
  const int have = static_cast<int>(torch::cuda::device_count());
  if (have < n) throw Skip{"needs " + std::to_string(n) + " GPU(s), found " + std::to_string(have)};
}

job::GenerationRequest request(int steps = 8) {
  job::GenerationRequest r;
  r.model = "<random>";
  r.prompt = "a red apple on a white background";
  r.negative_prompt = "blurry";
  r.width = r.height = 128;
  r.steps = steps;
  r.cfg = 6.0;
  r.seed = 11;
  r.device = "cuda:0";
  r.sampler = "euler";
  r.preview_every = 0;
  return r;
}

double rel_l2(const job::GenerationResult& a, const job::GenerationResult& b) { return engine::latents_rel_l2(a, b); }

std::unique_ptr<pipeline::StableDiffusion> tiny_sdxl(bool graphs) {
  setenv("DIFFRACT_CUDA_GRAPHS", graphs ? "1" : "0", 1);
  return pipeline::StableDiffusion::random(job::ModelFamily::SDXL, /*tiny=*/true, "cuda:0");
}

// Device time (ms) per call of `f` on cuda:0: f once outside the capture (workspaces, plans),
// then `calls` calls captured in one CUDA graph on a side stream (capture mode local to this
// thread) and replayed, one replay timed with events: no host launch time between kernels, as
// the UNet's graphs run them.
double graph_ms_per_call(const std::function<void()>& f, int calls = 100) {
  const c10::cuda::CUDAGuard guard(0);
  const auto current = c10::cuda::getCurrentCUDAStream(0);
  auto side = c10::cuda::getStreamFromPool(false, 0);
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  const c10::cuda::CUDAStreamGuard on_side(side);
  f();
  at::cuda::CUDAGraph graph;
  graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < calls; ++i) f();
  graph.capture_end();
  graph.replay();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record(side);
  graph.replay();
  stop.record(side);
  stop.synchronize();
  return start.elapsed_time(stop) / calls;
}

// models::GroupNorm's CUDA kernels against ATen's group_norm (+ add, + silu) computed in fp32
// from the same inputs: NCHW and channels-last, three dtypes, the UNet's and the VAE's shapes,
// shapes the kernels leave to ATen, and a large mean against a small spread.
// The GroupNorm kernels in two halves (an overlapped band decode): moments over some rows equal
// ATen's var_mean of those rows (add included), in both memory formats and every dtype; combined
// over bands with their counts they are the whole image's statistics (the kernel against the
// CPU's double arithmetic); normalising with them gives forward(x, add, silu).
void check_group_moments() {
  at::NoGradGuard no_grad;
  at::manual_seed(11);
  struct Case {
    int64_t n, c, h, w, groups;
  };
  for (const auto& k : std::vector<Case>{{1, 512, 77, 128, 32}, {1, 128, 519, 1024, 32}, {2, 24, 9, 16, 3}})
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat})
      for (bool cl : {false, true}) {
        const auto o = at::TensorOptions().device(at::kCUDA).dtype(dtype);
        auto x = (at::randn({k.n, k.c, k.h, k.w}, o.dtype(at::kFloat)) * 1.3 + 0.4).to(dtype);
        if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
        const auto add = at::randn({1, k.c}, o);
        models::GroupNorm gn(models::GroupNormOptions(k.groups, k.c).eps(1e-6));
        gn->to(at::kCUDA, dtype);
        gn->weight.copy_(at::randn({k.c}, o));
        gn->bias.copy_(at::randn({k.c}, o));
        const std::vector<int64_t> cuts = {0, k.h / 3, k.h / 3 + 1, k.h};
        std::vector<at::Tensor> parts;
        std::vector<double> counts;
        double worst_mean = 0, worst_var = 0;
        const auto in = (x.to(at::kDouble) + add.to(at::kDouble).view({1, k.c, 1, 1}));
        for (std::size_t b = 0; b + 1 < cuts.size(); ++b) {
          const auto m = models::group_moments(x, add, k.groups, cuts[b], cuts[b + 1]);
          const auto [var, mean] = at::var_mean(in.narrow(2, cuts[b], cuts[b + 1] - cuts[b]).reshape({k.n, k.groups, -1}), {2}, 0, false);
          worst_mean = std::max(worst_mean, (m.select(-1, 0).to(at::kDouble) - mean).abs().max().item<double>());
          worst_var = std::max(worst_var, ((m.select(-1, 1).to(at::kDouble) - var).abs() / var).max().item<double>());
          parts.push_back(m);
          counts.push_back(static_cast<double>((cuts[b + 1] - cuts[b]) * k.w * (k.c / k.groups)));
        }
        const auto all = at::stack(parts);
        const auto stats = models::combine_group_moments(all, counts, 1e-6);
        const auto cpu = models::combine_group_moments(all.cpu(), counts, 1e-6);
        const double combine = (stats.cpu() - cpu).abs().max().item<double>() / cpu.abs().max().item<double>();
        const auto y = models::group_norm_with_stats(*gn, x, add, stats, true), ref = gn->forward(x, add, true);
        const double apply = (y.to(at::kDouble) - ref.to(at::kDouble)).abs().max().item<double>() /
                             ref.to(at::kDouble).abs().max().item<double>();
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
        std::ostringstream what;
        what << "group moments " << c10::toString(dtype) << (cl ? " NHWC " : " NCHW ") << "[" << k.n << ", " << k.c << ", "
             << k.h << ", " << k.w << "]: mean error " << worst_mean << ", variance relative error " << worst_var
             << ", combined vs CPU " << combine << ", normalised vs forward " << apply;
        expect(worst_mean < 1e-3 && worst_var < 1e-3 && combine < 1e-6 && apply < tol &&
                   y.is_contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous),
               what.str());
      }
}

void check_groupnorm() {
  need_gpus(1);
  check_group_moments();
  expect(models::fused_group_norm_available(), "built with the GroupNorm kernels");
  {
    // The kernels have no backward: where autograd records, ATen's ops run (gradients flow).
    at::AutoGradMode grad(true);
    models::GroupNorm norm(models::GroupNormOptions(4, 8));
    norm->to(at::Device("cuda:0"));
    const auto x = at::randn({2, 8, 4, 4}, at::TensorOptions().device("cuda:0")).requires_grad_();
    norm->forward(x, at::Tensor(), true).sum().backward();
    expect(x.grad().defined() && norm->weight.grad().defined(), "GroupNorm on CUDA under autograd: gradients flow");
  }
  struct Case {
    int64_t n, c, h, w, groups;
    double offset;
  };
  const std::vector<Case> cases = {{2, 320, 128, 128, 32, 0},  {2, 640, 64, 64, 32, 0},  {2, 2560, 32, 32, 32, 0},
                                   {1, 128, 256, 256, 32, 0},  {2, 1920, 64, 64, 32, 0}, {3, 96, 20, 12, 8, 0},
                                   {2, 320, 16, 16, 32, 50.0}, {1, 40, 7, 5, 4, 0},       {2, 24, 9, 9, 3, 0}};
  at::manual_seed(3);
  // What is added before normalising: nothing, [N, C], a slice of a wider tensor's rows (the
  // fused time projections) with a convolution's bias [C], one row [1, C] for every sample, or
  // the bias alone (the VAE's ResNet blocks).
  enum class Add { None, Rows, SliceAndBias, OneRow, BiasOnly };
  for (const auto& k : cases)
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat})
      for (bool cl : {false, true})
        for (const Add kind : {Add::None, Add::Rows, Add::SliceAndBias, Add::OneRow, Add::BiasOnly}) {
          const auto o = at::TensorOptions().device(at::kCUDA).dtype(dtype);
          auto x = (at::randn({k.n, k.c, k.h, k.w}, o.dtype(at::kFloat)) * 1.7 + k.offset).to(dtype);
          if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
          at::Tensor add, channel_add;
          if (kind == Add::Rows) add = at::randn({k.n, k.c}, o);
          if (kind == Add::SliceAndBias) add = at::randn({k.n, k.c + 24}, o).narrow(1, 8, k.c);
          if (kind == Add::OneRow) add = at::randn({1, k.c}, o);
          if (kind == Add::SliceAndBias || kind == Add::BiasOnly) channel_add = at::randn({k.c}, o);
          // Inference, as the pipelines run it (parameters requiring grad under autograd take ATen's ops).
          at::NoGradGuard no_grad;
          models::GroupNorm gn(models::GroupNormOptions(k.groups, k.c).eps(1e-6));
          gn->to(at::kCUDA, dtype);
          gn->weight.copy_(at::randn({k.c}, o));
          gn->bias.copy_(at::randn({k.c}, o));
          const auto y = gn->forward(x, add, /*silu=*/true, channel_add);
          auto in = x.to(at::kFloat);
          if (add.defined()) in = in + add.to(at::kFloat).reshape({add.size(0), k.c, 1, 1});
          if (channel_add.defined()) in = in + channel_add.to(at::kFloat).view({1, k.c, 1, 1});
          const auto ref = at::silu(at::group_norm(in, k.groups, gn->weight.to(at::kFloat), gn->bias.to(at::kFloat), 1e-6));
          const double err = ((y.to(at::kFloat) - ref).abs() / (ref.abs() + 1)).max().item<double>();
          const double tol = dtype == at::kFloat ? 1e-4 : (dtype == at::kHalf ? 2e-3 : 1e-2);
          const bool same_format = y.is_contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
          std::ostringstream what;
          what << "[" << k.n << "," << k.c << "," << k.h << "," << k.w << "]/" << k.groups << " " << dtype
               << (cl ? " channels-last" : " NCHW")
               << (kind == Add::Rows ? " +add" : kind == Add::SliceAndBias ? " +add (slice) +bias" : kind == Add::OneRow ? " +add (one row)" : kind == Add::BiasOnly ? " +bias" : "")
               << (k.offset ? " offset" : "")
               << ": max |diff| / (1 + |ref|) " << err << " (tol " << tol << ")";
          expect(err < tol && same_format, what.str());
        }
  // The same call gives the same bits every time (the splits, rows and channels are summed in a
  // fixed order), in both layouts, for groups of 10 channels (a thread's 8-channel vector spans
  // two groups) and of 40, with the ResNet blocks' per-sample add.
  at::NoGradGuard no_grad;
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{2, 320, 128, 128}, {1, 1280, 32, 32}})
    for (bool cl : {false, true}) {
      const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
      auto x = at::randn(shape, o) * 3 + 1;
      if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      const auto add = at::randn({shape[0], shape[1]}, o);
      models::GroupNorm gn(models::GroupNormOptions(32, shape[1]));
      gn->to(at::kCUDA, at::kBFloat16);
      const auto first = gn->forward(x, add, true);
      bool same = true;
      for (int i = 0; i < 8; ++i) same = same && at::equal(first, gn->forward(x, add, true));
      expect(same, "deterministic: group_norm " + c10::str(at::IntArrayRef(shape)) + (cl ? " channels-last" : " NCHW") +
                       ", 9 calls, the same bits");
    }

  // The time of the kernels and of ATen's path (x + add, group_norm, silu) at the SDXL UNet's
  // ResNet shapes, both layouts.
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{2, 320, 128, 128}, {2, 640, 64, 64}, {2, 1280, 32, 32}})
    for (bool cl : {true, false}) {
      const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
      auto xt = at::randn(shape, o);
      if (cl) xt = xt.contiguous(at::MemoryFormat::ChannelsLast);
      const auto add = at::randn({shape[0], shape[1]}, o);
      models::GroupNorm g(models::GroupNormOptions(32, shape[1]));
      g->to(at::kCUDA, at::kBFloat16);
      models::set_fused_group_norm(true);
      const double fused = graph_ms_per_call([&] { g->forward(xt, add, true); });
      models::set_fused_group_norm(false);
      const double aten = graph_ms_per_call([&] { g->forward(xt, add, true); });
      models::set_fused_group_norm(true);
      std::cout << "  group_norm " << at::IntArrayRef(shape) << " BFloat16" << (cl ? " channels-last" : " NCHW")
                << " +add +silu: fused " << fused << " ms, aten " << aten << " ms\n";
    }
  // The statistics pass's grid (blocks per SM; the finalize kernel sums what it leaves), at the
  // SDXL step's channels-last shapes for batch 1 and 2, with the per-channel adds the ResNet
  // blocks pass.
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{1, 320, 128, 128}, {1, 640, 64, 64}, {1, 1280, 32, 32},
                                                 {2, 320, 128, 128}, {2, 640, 64, 64}, {2, 1280, 32, 32}}) {
    const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    const auto xt = at::randn(shape, o).contiguous(at::MemoryFormat::ChannelsLast);
    const auto add = at::randn({shape[0], shape[1]}, o), bias = at::randn({shape[1]}, o);
    models::GroupNorm g(models::GroupNormOptions(32, shape[1]));
    g->to(at::kCUDA, at::kBFloat16);
    const auto want = g->forward(xt, add, true, bias);
    std::ostringstream line;
    line << "  group_norm " << at::IntArrayRef(shape) << " channels-last, statistics blocks per SM:";
    for (const int per_sm : {1, 2, 4, 8}) {
      models::set_group_norm_stats_blocks_per_sm(per_sm);
      const double ms = graph_ms_per_call([&] { g->forward(xt, add, true, bias); });
      const double diff = (g->forward(xt, add, true, bias).to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
      line << " " << per_sm << ": " << ms << " ms";
      expect(diff < 0.05, "group_norm with " + std::to_string(per_sm) + " statistics blocks per SM gives the default's result");
    }
    models::set_group_norm_stats_blocks_per_sm(0);  // back to the default
    std::cout << line.str() << "\n";
  }
}

// The fused projections (self-attention's q, k, v in one GEMM; every cross-attention's keys
// and values, and every ResNet block's time-embedding projection, in one GEMM per step: the
// defaults) against separate GEMMs (DIFFRACT_FUSED_QKV=0, DIFFRACT_FUSED_CROSS_KV=0,
// DIFFRACT_FUSED_TIME_PROJ=0), graphed, on the tiny SDXL; and a CFG-parallel job with them
// (the replica fuses too).
void check_qkv() {
  need_gpus(1);
  const char* switches[] = {"DIFFRACT_FUSED_QKV", "DIFFRACT_FUSED_CROSS_KV", "DIFFRACT_FUSED_TIME_PROJ"};
  for (const char* v : switches) setenv(v, "0", 1);
  auto plain = tiny_sdxl(true);
  for (const char* v : switches) unsetenv(v);
  auto fused = tiny_sdxl(true);
  job::CancelToken never;
  const auto req = request();
  const auto a = plain->generate(req, {}, never);
  const auto b = fused->generate(req, {}, never);
  std::cout << "  fused projections vs separate GEMMs: latents rel-L2 " << rel_l2(b, a) << "\n";
  expect(rel_l2(b, a) < 1e-2, "fused projections give the separate GEMMs' result (bf16, rel-L2 < 1e-2)");
  expect(rel_l2(fused->generate(req, {}, never), b) == 0.0, "fused projections replay bit for bit");
  if (torch::cuda::device_count() >= 2) {
    auto r = req;
    r.strategy.name = "cfg-parallel";
    r.strategy.devices = 2;
    const auto c = fused->generate(r, {}, never);
    std::cout << "  fused projections cfg-parallel vs one GPU: rel-L2 " << rel_l2(c, b) << "\n";
    expect(rel_l2(c, b) < 2e-2, "fused projections under cfg-parallel give the one-GPU result");
  }
}

void check_graphs() {
  need_gpus(1);
  auto eager = tiny_sdxl(false), graphed = tiny_sdxl(true);
  job::CancelToken never;
  const auto req = request();
  const auto a = eager->generate(req, {}, never);
  const auto b = graphed->generate(req, {}, never);
  const auto meta = nlohmann::json::parse(b.metadata_json);
  const double d = rel_l2(b, a);
  std::cout << "  graph vs eager latents rel-L2 " << d << ", capture " << meta["unet_graphs"]["last_capture_ms"] << " ms\n";
  expect(meta["unet_graphs"]["graphs"] == 1, "one graph captured for one shape");
  expect(d < 1e-2, "graph replay gives the eager result (bf16, rel-L2 < 1e-2)");
  const auto again = graphed->generate(req, {}, never);
  expect(rel_l2(again, b) == 0.0, "a second run replays the same graph bit for bit");
  for (int size : {64, 96, 160, 192}) {
    auto r = req;
    r.width = r.height = size;
    r.steps = 2;
    graphed->generate(r, {}, never);
  }
  const auto last = nlohmann::json::parse(graphed->generate(req, {}, never).metadata_json);
  expect(last["unet_graphs"]["graphs"].get<int>() <= 3, "the graph cache keeps at most 3 shapes");
}

// DIFFRACT_GRAPH_WARMUPS=auto: a size whose tuning choices are all known is captured with no
// eager call first, one with shapes not yet timed is captured again after two, and both replay
// what the eager UNet computes.
void check_graph_warmups() {
  need_gpus(1);
  setenv("DIFFRACT_GRAPH_WARMUPS", "auto", 1);
  setenv("DIFFRACT_TUNING_STORE", "0", 1);  // every choice made in this process
  expect(graph_warmups() == 0, "DIFFRACT_GRAPH_WARMUPS=auto reads as no eager call first");
  auto eager = tiny_sdxl(false), graphed = tiny_sdxl(true);
  job::CancelToken never;
  const auto at_size = [&](int size) {
    auto r = request();
    r.width = r.height = size;
    return r;
  };
  const auto capture = [](const job::GenerationResult& r) {
    return nlohmann::json::parse(r.metadata_json)["unet_graphs"]["last_capture"];
  };
  // The first capture also makes the capture stream's GEMM workspace: it is redone.
  const auto first = graphed->generate(at_size(128), {}, never);
  std::cout << "  first size, nothing timed before: " << capture(first).dump() << "\n";
  expect(capture(first)["redone"] == true && capture(first)["warmups"] == 2,
         "a capture that met shapes not timed yet is redone after two eager calls");
  expect(rel_l2(first, eager->generate(at_size(128), {}, never)) < 1e-2, "that graph replays the eager result");
  // An eager job at another size times its shapes; the graph at that size then needs no eager call.
  const auto e = eager->generate(at_size(96), {}, never);
  const auto g = graphed->generate(at_size(96), {}, never);
  std::cout << "  a size timed by an eager job: " << capture(g).dump() << ", rel-L2 against eager " << rel_l2(g, e)
            << "\n";
  expect(capture(g)["redone"] == false && capture(g)["warmups"] == 0, "a size with every choice known is captured straight away");
  expect(rel_l2(g, e) < 1e-2, "the graph captured without eager calls replays the eager result");
  expect(rel_l2(graphed->generate(at_size(96), {}, never), g) == 0.0, "and replays it bit for bit");
}

// The strategies' stage calls replayed from CUDA graphs (UNetGraphRunner::forward_range, the U
// split) against the same calls run eagerly on the same module and inputs: a tiny SDXL-shaped
// UNet in bf16 (pooled text and time ids), AsyncDiff's layer ranges for 2 and 3 components and
// the whole range, both U splits; several timesteps through one graph per call, each call
// replayed twice (the first results must survive the second replay), and a check that the
// comparison can fail (other timesteps give other outputs).
// The fused GEGLU gate against a * gelu(b) computed in fp32 from the same inputs: three dtypes,
// SDXL's feed-forward shapes, a size with a tail, an input off the 16-byte alignment; then the
// time of both at SDXL's widest feed-forward.
void check_geglu() {
  need_gpus(1);
  ::setenv("DIFFRACT_GELU_SLICE_KERNEL", "1", 1);  // the default, set for the check whatever the caller set; read once, at the first call
  expect(models::fused_geglu_available(), "built with the GEGLU kernel");
  {
    at::AutoGradMode grad(true);
    const auto o = at::TensorOptions().device("cuda:0");
    const auto a = at::randn({4, 16}, o).requires_grad_(), b = at::randn({4, 16}, o).requires_grad_();
    models::geglu(a, b).sum().backward();
    expect(a.grad().defined() && b.grad().defined(), "GEGLU on CUDA under autograd: gradients flow (ATen's ops)");
  }
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  double worst = 0;
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const double tol = dtype == at::kFloat ? 1e-6 : dtype == at::kHalf ? 2e-3 : 1e-2;
    for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{2, 4096, 5120}, {2, 1024, 10240}, {3, 77, 33}}) {
      const auto a = at::randn(shape, at::TensorOptions().device(dev).dtype(dtype));
      const auto b = at::randn(shape, at::TensorOptions().device(dev).dtype(dtype)) * 3;
      const auto want = a.to(at::kFloat) * at::gelu(b.to(at::kFloat));
      const auto got = models::geglu(a, b);
      const double err = (got.to(at::kFloat) - want).abs().max().item<double>() / want.abs().max().item<double>();
      worst = std::max(worst, err);
      std::ostringstream what;
      what << "geglu " << c10::toString(dtype) << " " << at::IntArrayRef(shape) << ": max error " << err << " of max |out|";
      expect(err < tol, what.str());
    }
    // Off the vector alignment: the element-wise path.
    const auto big = at::randn({1 + 4099}, at::TensorOptions().device(dev).dtype(dtype));
    const auto a = big.narrow(0, 1, 4099), b = big.narrow(0, 0, 4099).contiguous();
    const auto want = a.to(at::kFloat) * at::gelu(b.to(at::kFloat));
    const double err = (models::geglu(a, b).to(at::kFloat) - want).abs().max().item<double>() / want.abs().max().item<double>();
    expect(err < tol, std::string("geglu ") + c10::toString(dtype) + " on an unaligned input");
  }
  std::cout << "  worst relative error " << worst << "\n";
  // geglu_halves on one projection's output: the bits of geglu over its two halves copied out.
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const auto o = at::TensorOptions().device(dev).dtype(dtype);
    for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{1, 1024, 10240}, {2, 4096, 5120}, {3, 77, 66}}) {
      const auto y = at::randn(shape, o) * 2;
      const int64_t inner = shape.back() / 2;
      const auto want = models::geglu(y.narrow(-1, 0, inner).contiguous(), y.narrow(-1, inner, inner).contiguous());
      expect(models::geglu_halves_uses_kernel(y) && at::equal(models::geglu_halves(y), want),
             std::string("geglu_halves ") + c10::toString(dtype) + " " + c10::str(at::IntArrayRef(shape)) +
                 " (kernel) equals geglu over the halves");
    }
    const auto flat = at::randn({1 + 6 * 64}, o);
    const auto y = flat.narrow(0, 1, 6 * 64).view({6, 64});  // contiguous, off the 16-byte alignment
    const auto want = models::geglu(y.narrow(-1, 0, 32).contiguous(), y.narrow(-1, 32, 32).contiguous());
    const double err = (models::geglu_halves(y).to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
    expect(err == 0, std::string("geglu_halves ") + c10::toString(dtype) + " off the vector alignment");
  }
  {
    // The feed-forward's first GEMM and gate at SDXL's 1280 channels: one GEMM of 10240 columns
    // and the kernel over its halves, against two GEMMs of 5120 and the kernel (graphed).
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    const auto w = at::randn({10240, 1280}, o) * 0.03, bias = at::randn({10240}, o);
    for (const std::int64_t rows : {1024, 2048, 4096}) {
      const auto x = at::randn({rows, 1280}, o);
      const double one = graph_ms_per_call([&] { (void)models::geglu_halves(at::linear(x, w, bias)); }, 50);
      const double two = graph_ms_per_call([&] {
        (void)models::geglu(at::linear(x, w.narrow(0, 0, 5120), bias.narrow(0, 0, 5120)),
                            at::linear(x, w.narrow(0, 5120, 5120), bias.narrow(0, 5120, 5120)));
      }, 50);
      std::cout << "  GEGLU projection [" << rows << ", 1280] x [1280, 10240] + gate: one GEMM " << one
                << " ms, two GEMMs " << two << " ms\n";
    }
  }
  const auto opts = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  const auto a = at::randn({2, 4096, 5120}, opts), b = at::randn({2, 4096, 5120}, opts);
  const auto time = [&](bool fused) {
    models::set_fused_geglu(fused);
    for (int i = 0; i < 3; ++i) models::geglu(a, b);
    torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) models::geglu(a, b);
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 50;
  };
  const double aten = time(false), fused = time(true);
  std::cout << "  [2, 4096, 5120] bf16: fused " << fused << " ms, ATen gelu + product " << aten << " ms\n";
  expect(fused < aten, "the fused gate is faster than ATen's two kernels");
  models::set_fused_geglu(true);

  // The tanh GELU into a column slice (Flux's single blocks: the MLP part of the fused projection
  // into the buffer proj_out reads): ATen's values where the kernel runs (vectorised, or one
  // element at a time off the alignment; fp32 included), then a view it leaves to ATen.
  struct GeluCase { int64_t tokens, in_cols, in_at, cols, out_cols, out_at; at::ScalarType dtype; };
  const std::vector<GeluCase> cases = {
      {4608, 21504, 9216, 12288, 15360, 3072, at::kBFloat16},  // Flux.1-dev 1024²
      {4608, 21504, 9216, 12288, 15360, 3072, at::kHalf},
      {77, 96, 32, 64, 96, 32, at::kFloat},
      {9, 50, 3, 40, 44, 1, at::kBFloat16},  // off the 16-byte alignment: one element at a time
      {9, 50, 8, 40, 44, 4, at::kBFloat16},  // aligned, strides no multiple of 8 elements
  };
  for (const auto& c : cases) {
    const auto o = at::TensorOptions().device(dev).dtype(c.dtype);
    const auto p = at::randn({1, c.tokens, c.in_cols}, o) * 3;
    auto joined = at::zeros({1, c.tokens, c.out_cols}, o);
    auto out = joined.narrow(2, c.out_at, c.cols);
    const auto x = p.narrow(2, c.in_at, c.cols);
    std::ostringstream what;
    what << "gelu_tanh_out " << c10::toString(c.dtype) << " [1, " << c.tokens << ", " << c.cols << "] from columns "
         << c.in_at << " of " << c.in_cols << " into " << c.out_at << " of " << c.out_cols;
    expect(models::gelu_tanh_uses_kernel(out, x), what.str() + " takes the kernel");
    models::gelu_tanh_out(out, x);
    const auto want = at::gelu(x.contiguous(), "tanh");
    const auto diff = (out.to(at::kFloat) - want.to(at::kFloat)).abs();
    const int64_t differing = diff.ne(0).sum().item<int64_t>();
    const double rel = diff.max().item<double>() / want.abs().max().to(at::kFloat).item<double>();
    std::cout << "  " << what.str() << ": " << differing << " of " << want.numel() << " elements differ from ATen's, max "
              << rel << " of max |out|\n";
    expect(rel < (c.dtype == at::kFloat ? 1e-6 : 1e-2), what.str() + " equals ATen's gelu up to rounding");
    const auto outside = at::cat({joined.narrow(2, 0, c.out_at), joined.narrow(2, c.out_at + c.cols, c.out_cols - c.out_at - c.cols)}, 2);
    expect(outside.abs().max().item<double>() == 0, what.str() + " writes nothing outside its columns");
  }
  {
    // Each batch item's first tokens: rows that fold into no single stride go to ATen's gelu_out.
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    const auto x = at::randn({2, 9, 64}, o).narrow(1, 0, 5);
    auto buf = at::zeros({2, 9, 64}, o);
    auto out = buf.narrow(1, 0, 5);
    expect(!models::gelu_tanh_uses_kernel(out, x), "gelu_tanh_out on rows that fold into no stride is ATen's");
    models::gelu_tanh_out(out, x);
    expect(at::equal(out, at::gelu(x, "tanh")), "gelu_tanh_out on rows that fold into no stride equals ATen's gelu");
  }
  {
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    const auto p = at::randn({1, 4608, 21504}, o);
    auto joined = at::empty({1, 4608, 15360}, o);
    auto out = joined.narrow(2, 3072, 12288);
    const auto x = p.narrow(2, 9216, 12288);
    const double ours = graph_ms_per_call([&] { models::gelu_tanh_out(out, x); }, 50);
    const double aten = graph_ms_per_call([&] { at::gelu_out(out, x, "tanh"); }, 50);
    std::cout << "  gelu_tanh_out [1, 4608, 12288] bf16 column slices, ms per call: ours " << ours << ", ATen's gelu_out "
              << aten << "\n";
    expect(ours < aten, "the tanh GELU over column slices is faster than ATen's gelu_out");
  }
}

// Conv2d's bias (and residual) kernel against an fp32 reference, NCHW and channels-last, each
// dtype, and shapes it leaves to ATen's add; then ResNet blocks (conv1's bias folded into norm2,
// conv2's bias and the skip in one kernel) against the same blocks through ATen's ops and fp32.
void check_conv_bias() {
  need_gpus(1);
  expect(models::conv_bias_kernel_available(), "built with the convolution bias kernel");
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  at::manual_seed(8);
  const auto rel = [](const at::Tensor& got, const at::Tensor& want) {
    const auto w = want.to(got.device());
    return (got.to(at::kFloat) - w).abs().max().item<double>() / w.abs().max().item<double>();
  };
  struct Case {
    std::int64_t in, out, hw;
    bool channels_last, residual;
    bool residual_bias = false;
  };
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const double tol = dtype == at::kFloat ? 1e-5 : dtype == at::kHalf ? 3e-3 : 2e-2;
    const auto o = at::TensorOptions().device(dev).dtype(dtype);
    for (const auto& k : {Case{64, 320, 32, true, false}, Case{64, 320, 32, true, true}, Case{32, 64, 16, false, true},
                          Case{16, 12, 8, true, true}, Case{16, 12, 6, false, false}, Case{64, 320, 32, true, true, true},
                          Case{32, 64, 16, false, true, true}}) {
      models::Conv2d conv(models::Conv2dOptions(k.in, k.out, 3).padding(1));
      models::init_random(*conv, 3);
      conv->to(dev, dtype);
      auto x = at::randn({2, k.in, k.hw, k.hw}, o);
      if (k.channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      auto r = at::randn({2, k.out, k.hw, k.hw}, o);
      if (k.channels_last) r = r.contiguous(at::MemoryFormat::ChannelsLast);
      const auto rb = k.residual_bias ? at::randn({k.out}, o) : at::Tensor();
      const auto got = k.residual ? conv->forward_add(x, r, rb) : conv->forward(x);
      auto want = at::conv2d(x.to(at::kFloat), conv->weight.to(at::kFloat), conv->bias.to(at::kFloat), {1, 1}, {1, 1});
      if (k.residual) want = want + r.to(at::kFloat);
      if (k.residual_bias) want = want + rb.to(at::kFloat).view({1, -1, 1, 1});
      const double err = rel(got, want);
      std::ostringstream what;
      what << "conv " << k.in << "->" << k.out << " " << k.hw << "x" << k.hw << " " << c10::toString(dtype)
           << (k.channels_last ? " channels-last" : " NCHW") << (k.residual ? " + residual" : "")
           << (k.residual_bias ? " + its bias" : "") << ": max error " << err
           << " (tol " << tol << ")";
      expect(err < tol && got.sizes() == want.sizes(), what.str());
    }
  }
  for (const auto& [temb, shortcut] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
    models::ResnetBlock2DOptions ro;
    ro.in_channels = 64;
    ro.out_channels = shortcut ? 128 : 64;
    ro.temb_channels = temb ? 96 : 0;
    ro.groups = 32;
    models::ResnetBlock2D block(ro);
    models::init_random(*block, 5);
    const auto x32 = at::randn({2, 64, 16, 16}), t32 = at::randn({2, 96});
    const auto want = block->forward(x32, temb ? t32 : at::Tensor());  // fp32 on the CPU
    block->to(dev, at::kBFloat16);
    const auto x = x32.to(dev, at::kBFloat16).contiguous(at::MemoryFormat::ChannelsLast);
    const auto t = temb ? t32.to(dev, at::kBFloat16) : at::Tensor();
    const auto folded = block->forward(x, t);
    models::set_conv_bias_kernel(false);
    const auto aten = block->forward(x, t);
    models::set_conv_bias_kernel(true);
    const double e_folded = rel(folded, want), e_aten = rel(aten, want);
    std::ostringstream what;
    what << "ResNet block bf16" << (temb ? " with" : " without") << " time embedding" << (shortcut ? ", 1x1 shortcut" : "")
         << ": max error folded " << e_folded << ", ATen's ops " << e_aten << " (of fp32)";
    expect(e_folded < 2e-2 && e_folded < 2 * e_aten + 1e-3, what.str());
    // Rounded once where ATen's ops round after each add: some bits differ, so the path ran.
    expect(!at::equal(folded, aten), "  ... and the folded path ran (its bits differ from ATen's ops)");
  }
}

// models::LayerNorm's CUDA kernel against at::layer_norm computed in fp32 from the same inputs:
// fp16 and bf16 at the transformer blocks' widths (SDXL 640 / 1280, SD 1.5 320), odd row counts,
// each of the kernel's row layouts (one warp per row up to 1280, 2 and 4 warps beyond), a large
// mean against a small spread, and widths the kernel leaves to ATen. Then a CUDA graph's replay
// against the eager call, and the time of both.
void check_layernorm() {
  need_gpus(1);
  expect(models::fused_layer_norm_available(), "built with the LayerNorm kernel");
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  struct Case {
    std::vector<std::int64_t> shape;
    double offset;
    bool kernel;  // whether the kernel takes it
  };
  const std::vector<Case> cases = {{{2, 4096, 640}, 0, true},  {{2, 1024, 1280}, 0, true}, {{2, 4096, 320}, 0, true},
                                   {{3, 77, 640}, 0, true},    {{1, 231, 1280}, 0, true},  {{3, 5, 2048}, 0, true},
                                   {{1, 7, 4096}, 0, true},    {{3, 8192}, 0, true},       {{5, 8}, 0, true},
                                   {{2, 64, 640}, 40.0, true}, {{2, 100, 644}, 0, false},  {{3, 9000}, 0, false},
                                   {{2, 4}, 0, false}};
  at::manual_seed(4);
  double worst = 0;
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const double tol = dtype == at::kHalf ? 2e-3 : 1e-2;
    const auto o = at::TensorOptions().device(dev).dtype(dtype);
    for (const auto& k : cases) {
      const std::int64_t c = k.shape.back();
      models::LayerNorm ln(models::LayerNormOptions(c).eps(1e-5));
      ln->to(dev, dtype);
      ln->weight.copy_(at::randn({c}, o) * 0.5 + 1);
      ln->bias.copy_(at::randn({c}, o));
      const auto x = (at::randn(k.shape, o.dtype(at::kFloat)) * 1.7 + k.offset).to(dtype);
      const bool kernel = models::layer_norm_uses_kernel(x, ln->weight, ln->bias);
      const auto y = ln->forward(x);
      const auto want = at::layer_norm(x.to(at::kFloat), {c}, ln->weight.to(at::kFloat), ln->bias.to(at::kFloat), 1e-5);
      const double err = (y.to(at::kFloat) - want).abs().max().item<double>() / want.abs().max().item<double>();
      worst = std::max(worst, err);
      std::ostringstream what;
      what << "layer_norm " << at::IntArrayRef(k.shape) << " " << c10::toString(dtype) << (k.offset ? " offset" : "")
           << (kernel ? " (kernel)" : " (ATen)") << ": max error " << err << " of max |out| (tol " << tol << ")";
      expect(err < tol && kernel == k.kernel && y.scalar_type() == dtype && y.sizes() == x.sizes(), what.str());
    }
    // A strided input (copied first) and one off the 16-byte alignment (left to ATen).
    models::LayerNorm ln(models::LayerNormOptions(640));
    ln->to(dev, dtype);
    const auto t = at::randn({640, 300}, o).t();
    const auto t_want = at::layer_norm(t.to(at::kFloat), {640}, ln->weight.to(at::kFloat), ln->bias.to(at::kFloat), 1e-5);
    const double t_err = (ln->forward(t).to(at::kFloat) - t_want).abs().max().item<double>() / t_want.abs().max().item<double>();
    expect(models::layer_norm_uses_kernel(t, ln->weight, ln->bias) && t_err < tol,
           std::string("layer_norm ") + c10::toString(dtype) + " on a transposed input (kernel)");
    const auto off = at::randn({1 + 30 * 640}, o).narrow(0, 1, 30 * 640).view({30, 640});
    expect(!models::layer_norm_uses_kernel(off, ln->weight, ln->bias),
           std::string("layer_norm ") + c10::toString(dtype) + " off the 16-byte alignment goes to ATen");
  }
  std::cout << "  worst relative error " << worst << "\n";
  // add_layer_norm: the kernel's sum is `x + r`'s bits and its output layer_norm(x + r)'s, for
  // each of the kernel's row layouts, a strided residual (copied first) and one off the 16-byte
  // alignment (the separate add and layer_norm).
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto o = at::TensorOptions().device(dev).dtype(dtype);
    for (const std::vector<std::int64_t>& shape :
         {std::vector<std::int64_t>{2, 4096, 640}, {1, 1024, 1280}, {3, 77, 2048}, {3, 5, 4096}, {2, 8192}}) {
      const std::int64_t c = shape.back();
      models::LayerNorm ln{models::LayerNormOptions(c)};
      ln->to(dev, dtype);
      ln->weight.copy_(at::randn({c}, o) * 0.5 + 1);
      ln->bias.copy_(at::randn({c}, o));
      const auto x = at::randn(shape, o), r = at::randn(shape, o) * 3;
      const auto [sum, y] = ln->forward_add(x, r);
      const auto want_sum = x + r;
      std::ostringstream what;
      what << "add_layer_norm " << at::IntArrayRef(shape) << " " << c10::toString(dtype)
           << ": the sum and the output equal x + r and layer_norm(x + r) bit for bit";
      expect(at::equal(sum, want_sum) && at::equal(y, ln->forward(want_sum)), what.str());
    }
    models::LayerNorm ln(models::LayerNormOptions(640));
    ln->to(dev, dtype);
    const auto x = at::randn({30, 640}, o);
    for (const auto& [r, name] : {std::pair{at::randn({640, 30}, o).t(), "a transposed residual"},
                                  std::pair{at::randn({1 + 30 * 640}, o).narrow(0, 1, 30 * 640).view({30, 640}),
                                            "a residual off the 16-byte alignment"}}) {
      const auto [sum, y] = ln->forward_add(x, r);
      expect(at::equal(sum, x + r) && at::equal(y, ln->forward(x + r)),
             std::string("add_layer_norm ") + c10::toString(dtype) + " with " + name);
    }
  }
  {
    // No kernel where autograd needs a backward, or when switched off.
    models::LayerNorm ln(models::LayerNormOptions(640));
    ln->to(dev, at::kBFloat16);
    const auto x = at::randn({2, 16, 640}, at::TensorOptions().device(dev).dtype(at::kBFloat16));
    at::AutoGradMode grad(true);
    expect(!models::layer_norm_uses_kernel(x, ln->weight, ln->bias), "layer_norm leaves autograd to ATen");
  }
  models::set_fused_layer_norm(false);
  {
    const auto x = at::randn({2, 16, 640}, at::TensorOptions().device(dev).dtype(at::kBFloat16));
    const auto w = at::ones({640}, x.options()), b = at::zeros({640}, x.options());
    expect(!models::layer_norm_uses_kernel(x, w, b), "set_fused_layer_norm(false) turns the kernel off");
  }
  models::set_fused_layer_norm(true);

  // Captured in a CUDA graph: the replay gives the eager call's bits, and follows new input values.
  {
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    models::LayerNorm ln(models::LayerNormOptions(640));
    ln->to(dev, at::kBFloat16);
    ln->weight.copy_(at::randn({640}, o));
    ln->bias.copy_(at::randn({640}, o));
    const auto x = at::randn({2, 4096, 640}, o);
    const auto eager = ln->forward(x);
    at::cuda::CUDAGraph graph;
    at::Tensor out;
    auto side = c10::cuda::getStreamFromPool(false, 0);
    torch::cuda::synchronize(0);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      ln->forward(x);
      side.synchronize();
      graph.capture_begin();
      out = ln->forward(x);
      graph.capture_end();
    }
    graph.replay();
    torch::cuda::synchronize(0);
    expect(at::equal(out, eager), "layer_norm replayed from a CUDA graph equals the eager call (bf16 [2, 4096, 640])");
    x.copy_(at::randn({2, 4096, 640}, o));
    graph.replay();
    torch::cuda::synchronize(0);
    expect(at::equal(out, ln->forward(x)) && !at::equal(out, eager), "the replay reads the captured input's new values");
  }

  // add_layer_norm (as the transformer blocks run it) in each row layout the width allows, at
  // the SDXL step's row counts: batch 1 and 2, 1280 and 640 channels. Each layout's result
  // against the default's (the reduction order differs: fp32 rounding only).
  {
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    for (const auto& [rows, c] : {std::pair<std::int64_t, std::int64_t>{1024, 1280}, {2048, 1280}, {4096, 640}, {8192, 640}}) {
      models::LayerNorm ln{models::LayerNormOptions(c)};
      ln->to(dev, at::kBFloat16);
      ln->weight.copy_(at::randn({c}, o) * 0.5 + 1);
      ln->bias.copy_(at::randn({c}, o));
      const auto x = at::randn({rows, c}, o), r = at::randn({rows, c}, o);
      const auto want = ln->forward_add(x, r).second;
      std::ostringstream line;
      line << "  add_layer_norm [" << rows << ", " << c << "] bf16, ms per call:";
      for (const int warps : {0, 1, 2, 4}) {
        models::set_layer_norm_warps_per_row(warps);
        const double ms = graph_ms_per_call([&] { ln->forward_add(x, r); });
        const double diff = (ln->forward_add(x, r).second.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
        line << " " << (warps ? std::to_string(warps) + " warps/row " : "default ") << ms << " (max diff " << diff << ")";
        expect(diff < 0.05, "add_layer_norm [" + std::to_string(rows) + ", " + std::to_string(c) + "] with " +
                                std::to_string(warps) + " warps per row gives the default's result");
      }
      models::set_layer_norm_warps_per_row(0);
      std::cout << line.str() << "\n";
    }
  }

  for (const auto dtype : {at::kBFloat16, at::kHalf})
    for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{2, 4096, 640}, {2, 1024, 1280}, {2, 4096, 320}}) {
      const auto o = at::TensorOptions().device(dev).dtype(dtype);
      const std::int64_t c = shape.back();
      const auto x = at::randn(shape, o), w = at::randn({c}, o), b = at::randn({c}, o);
      const double fused = graph_ms_per_call([&] { models::layer_norm(x, w, b, 1e-5); });
      const double aten = graph_ms_per_call([&] { at::layer_norm(x, {c}, w, b, 1e-5); });
      std::cout << "  layer_norm " << at::IntArrayRef(shape) << " " << c10::toString(dtype) << ": fused " << fused
                << " ms, aten " << aten << " ms\n";
      if (c != 320) expect(fused < aten, "the kernel is faster than ATen's at SDXL's width " + std::to_string(c));
    }
}

// io::Uploader's GPU path (pinned chunks, a copy stream, the dtype conversion on the device)
// against a plain to(device, dtype): tensors smaller and larger than a chunk, fp32 / fp16 / bf16
// sources into bf16, an integer tensor that keeps its type, a non-contiguous source.
void check_upload() {
  need_gpus(1);
  const at::Device dev("cuda:0");
  io::Uploader up(dev, at::kBFloat16, 1 << 16);  // 64 KiB chunks: most tensors here span several
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
  for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16})
    for (const std::int64_t n : {std::int64_t(7), std::int64_t(40000), std::int64_t(1000003)}) {
      const auto src = at::randn({n}).to(dtype);
      pairs.emplace_back(up.upload(src), src.to(dev, at::kBFloat16));
    }
  const auto ints = at::arange(100000, at::kLong);
  pairs.emplace_back(up.upload(ints), ints.to(dev));
  const auto strided = at::randn({300, 500}).t();
  pairs.emplace_back(up.upload(strided), strided.to(dev, at::kBFloat16));
  up.finish();
  bool same = true;
  for (const auto& [got, want] : pairs)
    same = same && got.device() == dev && got.scalar_type() == want.scalar_type() && at::equal(got, want.contiguous());
  expect(same, "pinned upload equals to(cuda, bf16), every dtype and size, integers kept");
  std::cout << "  " << up.stats().tensors << " tensors, " << up.stats().bytes << " bytes in " << up.stats().ms << " ms\n";
}

// The text encoders' CUDA graphs (pipeline::detail::CLIPGraph) against the encoder run eagerly:
// a small projecting CLIP in bf16, two prompts through one graph, each twice.
void check_clip_graph() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  auto c = models::CLIPTextConfig::clip_l();
  c.num_hidden_layers = 3;
  models::CLIPTextModelWithProjection clip(c);
  models::init_random(*clip, 5);
  clip->eval();
  clip->to(dev, at::kBFloat16);
  pipeline::detail::CLIPGraph graph([&](const at::Tensor& ids) { return clip->forward(ids, true); },
                                    [&]() -> const models::CLIPTextConfig& { return clip->text_model->config; }, true);
  // bf16: the graph may pick other kernels than the eager launch did, so a tolerance; the worst
  // difference is printed (0: bit for bit).
  const auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() / b.to(at::kFloat).abs().max().item<double>();
  };
  double worst = 0;
  bool differ = false;
  at::Tensor first;
  for (int round = 0; round < 2; ++round)
    for (const std::int64_t seed : {1, 2}) {
      const auto ids = at::randint(0, c.vocab_size, {1, c.max_position_embeddings},
                                   at::make_generator<at::CPUGeneratorImpl>(seed)).to(dev);
      const auto eager = clip->forward(ids, true);
      const auto g = graph(ids);
      worst = std::max({worst, rel(g.penultimate, eager.hidden_states[eager.hidden_states.size() - 2]),
                        rel(g.last_hidden_state, eager.last_hidden_state), rel(g.pooled, eager.text_embeds)});
      if (!first.defined()) first = g.pooled.clone();
      else differ = differ || !at::equal(first, g.pooled);
    }
  std::cout << "  CLIPGraph vs eager: worst " << worst << " of max |out|\n";
  expect(worst < 1e-2, "CLIPGraph replays give the eager encoder's outputs (bf16), two prompts, twice");
  expect(differ, "different prompts give different outputs through the graph (a graph stuck on one input would fail)");
}

void check_stage_graphs() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  at::globalContext().setBenchmarkCuDNN(true);  // as the pipeline runs
  const at::Device dev("cuda:0");
  const auto bf16 = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  auto c = models::UNet2DConditionConfig::sdxl_base();  // StableDiffusion::random's tiny SDXL
  c.block_out_channels = {32, 64, 64};
  c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
  c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
  c.layers_per_block = {1, 1, 1};
  c.num_attention_heads = {2, 2, 2};
  c.transformer_layers_per_block = {1, 1, 1};
  c.reverse_transformer_layers_per_block = {1, 1, 1};
  c.norm_num_groups = 16;
  c.cross_attention_dim = {64, 64, 64};
  c.projection_class_embeddings_input_dim = 32 + 6 * c.addition_time_embed_dim;
  models::UNet2DConditionModel unet(c);
  models::init_random(*unet, 5);
  unet->eval();
  unet->to(dev, at::kBFloat16);
  models::UNetGraphOptions off;
  off.enabled = false;
  models::UNetGraphRunner eager(unet, off), graphed(unet);  // one module, so the same weights
  expect(graphed.options().stage_graphs, "stage graphs are on by default");

  const std::int64_t rows = 2, side = 24;  // AsyncDiff's guided batch of one image
  at::manual_seed(7);
  models::UNetConditioning cond;
  cond.encoder_hidden_states = at::randn({rows, 7, 64}, bf16);
  cond.text_embeds = at::randn({rows, 32}, bf16);
  cond.time_ids = at::tensor({24.0f, 24.0f, 0.0f, 0.0f, 24.0f, 24.0f}).repeat({rows, 1}).to(bf16);
  const auto ts = [&](double t) { return at::full({rows}, t, at::TensorOptions().device(dev).dtype(at::kFloat)); };
  const auto sample = [&] { return at::randn({rows, c.in_channels, side, side}, bf16); };
  // max |a - b| / max |b|: 0 when the replay is bit for bit the eager call.
  const auto diff = [](const at::Tensor& a, const at::Tensor& b) {
    if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return 1e30;
    const auto fa = a.to(at::kFloat), fb = b.to(at::kFloat);
    return (fa - fb).abs().max().item<double>() / std::max(fb.abs().max().item<double>(), 1e-12);
  };
  const double tol = 1e-2;  // bf16; identical kernels normally give 0
  double worst = 0;
  const auto state_diff = [&](const models::UNetStageState& a, const models::UNetStageState& b) {
    double d = std::max(diff(a.h, b.h), diff(a.temb, b.temb));
    if (a.skips.size() != b.skips.size()) return 1e30;
    for (std::size_t i = 0; i < a.skips.size(); ++i) d = std::max(d, diff(a.skips[i], b.skips[i]));
    return d;
  };
  const auto copy = [](const models::UNetStageState& s) {
    models::UNetStageState r;
    r.h = s.h.clone();
    if (s.temb.defined()) r.temb = s.temb.clone();
    for (const auto& k : s.skips) r.skips.push_back(k.clone());
    return r;
  };

  // (a) forward_range over AsyncDiff's components and the whole model.
  std::vector<double> cost;
  for (const auto& l : unet->layer_info(side, side)) cost.push_back(l.cost);
  const int layers = unet->layer_count();
  std::vector<std::pair<int, int>> ranges = {{0, layers}};
  for (int n : {2, 3}) {
    const auto b = parallel::AsyncDiff::balanced_split(cost, n);
    for (int k = 0; k < n; ++k) ranges.emplace_back(b[static_cast<std::size_t>(k)], b[static_cast<std::size_t>(k) + 1]);
  }
  const std::vector<double> steps = {999, 601, 1};
  for (const auto& [begin, end] : ranges) {
    // The state before `begin` (eager), for two different inputs.
    std::vector<models::UNetStageState> before;
    for (int v = 0; v < 2; ++v) {
      auto s = eager.stage_begin(sample(), ts(999), cond);
      eager.forward_range(s, 0, begin, cond);
      before.push_back(s);
    }
    const std::string what = "forward_range [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
    double d = 0, d_temb = 0, spread = 0;
    models::UNetStageState first_eager_out;
    for (double t : steps) {
      std::vector<models::UNetStageState> want, got;
      for (int v = 0; v < 2; ++v) {  // two replays of one graph, the first result held across the second
        auto e = copy(before[static_cast<std::size_t>(v)]);
        auto g = copy(before[static_cast<std::size_t>(v)]);
        eager.forward_range(e, begin, end, ts(t), cond);
        graphed.forward_range(g, begin, end, ts(t), cond);
        want.push_back(e);
        got.push_back(g);
      }
      for (int v = 0; v < 2; ++v) d = std::max(d, state_diff(got[static_cast<std::size_t>(v)], want[static_cast<std::size_t>(v)]));
      if (t == steps.front()) first_eager_out = want[0];
      else spread = std::max(spread, diff(want[0].h, first_eager_out.h));
      // The form with the state's own temb (an input of its graph).
      auto e = copy(before[0]), g = copy(before[0]);
      e.temb = g.temb = eager.embed_time(ts(t), cond, at::kBFloat16);
      eager.forward_range(e, begin, end, cond);
      graphed.forward_range(g, begin, end, cond);
      d_temb = std::max(d_temb, state_diff(g, e));
    }
    worst = std::max({worst, d, d_temb});
    std::cout << "  " << what << ": graphed vs eager " << d << " (temb given: " << d_temb << "), other timesteps differ by "
              << spread << "\n";
    expect(d <= tol && d_temb <= tol, what + " replays give the eager states, every timestep, twice");
    expect(spread > tol, what + ": the timestep changes the output by more than the tolerance (a graph stuck on one step would fail)");
  }
  expect(graphed.stage_graphs() > 0 && graphed.stage_graphs() <= graphed.options().max_stage_graphs,
         "stage graphs were captured and the cache keeps at most max_stage_graphs (" + std::to_string(graphed.stage_graphs()) + ")");
  expect(graphed.graphs() == 0, "the stage calls leave forward()'s graphs alone");

  // (b) the U split, chained as hybrid CFG's fill step, then stale (inner on an older h).
  for (int split = 1; split < static_cast<int>(c.block_out_channels.size()); ++split) {
    const std::string what = "U split " + std::to_string(split);
    double d = 0, spread = 0;
    at::Tensor first_out;
    const auto x0 = sample(), x1 = sample();
    for (double t : steps) {
      auto se = eager.forward_outer_down(x0, ts(t), cond, split);
      auto sg = graphed.forward_outer_down(x0, ts(t), cond, split);
      auto sg1 = graphed.forward_outer_down(x1, ts(t), cond, split);  // replays again: sg must not change
      const auto se1 = eager.forward_outer_down(x1, ts(t), cond, split);
      d = std::max({d, diff(sg.h, se.h), diff(sg.temb, se.temb), diff(sg1.h, se1.h)});
      if (sg.skips.size() != se.skips.size()) d = 1e30;
      for (std::size_t i = 0; i < std::min(sg.skips.size(), se.skips.size()); ++i) d = std::max(d, diff(sg.skips[i], se.skips[i]));
      const auto ie = eager.forward_inner(se.h, ts(t), cond, split);
      const auto ig = graphed.forward_inner(sg.h, ts(t), cond, split);
      const auto stale_e = eager.forward_inner(se1.h, ts(t), cond, split);
      const auto stale_g = graphed.forward_inner(sg1.h, ts(t), cond, split);
      d = std::max({d, diff(ig, ie), diff(stale_g, stale_e)});
      const auto oe = eager.forward_outer_up(se, ie, cond, split);
      const auto og = graphed.forward_outer_up(sg, ig, cond, split);
      const auto oe1 = eager.forward_outer_up(se1, stale_e, cond, split);
      const auto og1 = graphed.forward_outer_up(sg1, stale_g, cond, split);
      d = std::max({d, diff(og, oe), diff(og1, oe1)});
      if (t == steps.front()) first_out = oe;
      else spread = std::max(spread, diff(oe, first_out));
    }
    worst = std::max(worst, d);
    std::cout << "  " << what << ": graphed vs eager " << d << ", other timesteps differ by " << spread << "\n";
    expect(d <= tol, what + ": outer_down / inner / outer_up replays give the eager results, every timestep, twice");
    expect(spread > tol, what + ": the timestep changes the output by more than the tolerance (a graph stuck on one step would fail)");
  }
  expect(graphed.stage_graphs() <= graphed.options().max_stage_graphs, "the stage cache stays bounded");
  std::cout << "  worst graphed vs eager: " << worst << (worst == 0 ? " (bit for bit)" : "") << "\n";

  // Off (DIFFRACT_STAGE_GRAPHS=0 in the pipeline): eager, graphs dropped; clear() drops them too.
  auto s = eager.stage_begin(sample(), ts(500), cond);
  graphed.forward_range(s, 0, 3, ts(500), cond);
  expect(graphed.stage_graphs() > 0, "a stage graph before clear()");
  graphed.clear();
  expect(graphed.stage_graphs() == 0, "clear() drops the stage graphs");
  graphed.set_stage_graphs(false);
  auto e = eager.stage_begin(sample(), ts(500), cond);
  auto g = copy(e);
  eager.forward_range(e, 0, layers, ts(500), cond);
  graphed.forward_range(g, 0, layers, ts(500), cond);
  expect(graphed.stage_graphs() == 0 && state_diff(g, e) == 0, "stage graphs off: eager, bit for bit");
}

void check_previews() {
  need_gpus(1);
  auto sd = tiny_sdxl(true);
  auto req = request(20);
  req.preview_every = 1;
  req.taesd = "<random>";
  std::vector<int> steps, previews;
  int wrong_size = 0, last_width = 0, last_height = 0;
  job::JobObserver o;
  o.on_step = [&](const job::StepEvent& e) { steps.push_back(e.index); };
  o.on_preview = [&](const job::PreviewEvent& e) {
    previews.push_back(e.index);
    last_width = e.image.width, last_height = e.image.height;
    if (e.image.width != req.preview_side() || e.image.height != req.preview_side()) ++wrong_size;
  };
  job::CancelToken never;
  const auto r = sd->generate(req, o, never);
  bool ordered = static_cast<int>(steps.size()) == req.steps;
  for (std::size_t i = 0; i < steps.size(); ++i) ordered = ordered && steps[i] == static_cast<int>(i);
  expect(ordered, "every step reported once, in order");
  std::cout << "  previews shown " << previews.size() << ", dropped " << r.timings.previews_dropped << "\n";
  expect(static_cast<int>(previews.size()) + r.timings.previews_dropped == req.steps, "each step's preview shown or dropped");
  expect(std::is_sorted(previews.begin(), previews.end()) && !previews.empty(), "previews arrive in step order");
  expect(wrong_size == 0, "previews of a 128² image are " + std::to_string(req.preview_side()) + "² (the last " +
                              std::to_string(last_width) + "x" + std::to_string(last_height) + ", " +
                              std::to_string(wrong_size) + " of another size)");

  // The preview decode's CUDA graphs (GraphedFunction) against the same TAESD run eagerly.
  at::NoGradGuard no_grad;
  at::manual_seed(3);
  models::TAESD taesd(models::TAESDConfig::taesdxl(), /*with_encoder=*/false);
  models::init_random(*taesd, 3);
  taesd->eval();
  taesd->to(at::Device("cuda:0"), at::kBFloat16);
  models::set_memory_format(*taesd, at::MemoryFormat::ChannelsLast);
  GraphedFunction decode([&](const at::Tensor& z) { return taesd->decode(z); });
  for (int side : {64, 64, 32, 48, 64}) {
    const auto z = at::randn({1, 4, side, side}, at::TensorOptions().device("cuda:0").dtype(at::kBFloat16));
    const auto want = taesd->decode(z).to(at::kFloat), got = decode(z).to(at::kFloat);
    const double diff = (got - want).abs().max().item<double>();
    expect(got.sizes() == want.sizes() && diff < 1e-2,
           "graphed TAESD decode of a " + std::to_string(side) + "² latent equals eager (max |diff| " + std::to_string(diff) + ")");
  }
  expect(decode.graphs() == 2, "the preview graph cache keeps 2 shapes (has " + std::to_string(decode.graphs()) + ")");
}

// The TAESD decoder's fused path (cuDNN's conv + bias + ReLU and conv + bias + residual + ReLU,
// models::set_fused_taesd) against its eager path, on a side stream: SD 1.5's TAESD on random
// weights and the real TAEF2 decoder (<shared>/data/taesd/taef2_decoder.pth, <shared> from
// DIFFRACT_SHARED, else .carry/shared or ../shared), a 64² latent (512²) in bf16 and fp16, each
// decode also against the fp32 decode on the CPU. The caching allocator's free memory is
// filled with NaN before each fused decode (a kernel reading memory it did not write shows).
// Then the time of both paths, 64² and 128² latents (SD 1.5's 512² and SDXL's 1024² previews).
void check_taesd() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  const bool was_on = models::fused_taesd_enabled(), was_benchmark = at::globalContext().benchmarkCuDNN();
  at::globalContext().setBenchmarkCuDNN(true);  // as the pipelines set it
  models::set_fused_taesd(true);
  auto stream = c10::cuda::getStreamFromPool(false, 0);
  c10::cuda::CUDAStreamGuard on_stream(stream);

  const auto sd15 = [] {
    models::TAESD t(models::TAESDConfig::taesd(), /*with_encoder=*/false);
    models::init_random(*t, 3);
    return t;
  };
  std::optional<std::filesystem::path> taef2;
  {
    std::vector<std::filesystem::path> roots;
    if (const char* env = std::getenv("DIFFRACT_SHARED")) roots.emplace_back(env);
    roots.emplace_back(".carry/shared");
    roots.emplace_back("../shared");
    for (const auto& r : roots)
      if (!taef2 && std::filesystem::exists(r / "data" / "taesd" / "taef2_decoder.pth")) taef2 = r / "data" / "taesd" / "taef2_decoder.pth";
  }
  std::vector<std::pair<std::string, std::function<models::TAESD()>>> models_to_check{{"sd15 (random weights)", sd15}};
  if (taef2) models_to_check.emplace_back("taef2", [&] { return models::load_taesd(*taef2); });
  else std::cout << "  note  no taef2_decoder.pth under $DIFFRACT_SHARED, .carry/shared or ../shared: SD 1.5's random TAESD only\n";

  const auto on_gpu = [&](models::TAESD t, at::ScalarType dtype) {
    t->eval();
    t->to(dev, dtype);
    models::set_memory_format(*t, at::MemoryFormat::ChannelsLast);  // as the pipelines do
    return t;
  };
  const auto poison_free_memory = [&] {
    std::vector<at::Tensor> held;  // all-ones bits: NaN in fp32, fp16 and bf16
    for (int i = 0; i < 64; ++i) held.push_back(at::full({256 * 1024}, -1, at::TensorOptions().device(dev).dtype(at::kShort)));
    held.push_back(at::full({std::int64_t{1} << 29}, -1, at::TensorOptions().device(dev).dtype(at::kShort)));
  };
  const auto range = [](const at::Tensor& t) { return (t.max() - t.min()).item<double>(); };

  for (const auto& [name, make] : models_to_check) {
    auto ref_model = make();
    ref_model->eval();
    const auto channels = ref_model->config.latent_channels;
    const auto z32 = at::randn({1, channels, 64, 64}, at::make_generator<at::CPUGeneratorImpl>(5));
    for (const auto dtype : {at::kBFloat16, at::kHalf}) {
      const double tol = dtype == at::kBFloat16 ? 3e-2 : 1e-2;
      const auto dname = std::string(c10::toString(dtype));
      auto t = on_gpu(make(), dtype);
      const auto z = z32.to(dev, dtype);
      const auto ref = ref_model->decode(z.to(at::kCPU, at::kFloat));  // the same rounded latents
      expect(t->decoder->fused_applies(z), name + " " + dname + ": the fused path applies");
      models::set_fused_taesd(false);
      const auto eager = t->decode(z).to(at::kCPU, at::kFloat);
      models::set_fused_taesd(true);
      poison_free_memory();
      const auto t0 = std::chrono::steady_clock::now();
      const auto fused = t->decode(z).to(at::kCPU, at::kFloat);
      const double first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      expect(models::fused_taesd_enabled(), name + " " + dname + ": cuDNN ran the fused graphs (no fallback to eager)");
      const double r = range(eager);
      const double d = (fused - eager).abs().max().item<double>() / r;
      const double e_fused = (fused - ref).abs().max().item<double>() / range(ref);
      const double e_eager = (eager - ref).abs().max().item<double>() / range(ref);
      std::ostringstream what;
      what << name << " " << dname << " 64² -> 512²: fused vs eager max |diff| " << d << " of eager's range (" << r
           << "), tolerance " << tol << "; against fp32 on the CPU fused " << e_fused << ", eager " << e_eager
           << "; first fused decode (plan search) " << first_ms << " ms wall";
      expect(fused.sizes() == eager.sizes() && at::isfinite(fused).all().item<bool>() && d < tol, what.str());
      expect(e_fused <= 1.5 * e_eager + 1e-3, name + " " + dname + ": the fused decode is as close to fp32 as the eager one");
    }
  }

  const auto time_ms = [&](models::TAESD& t, const at::Tensor& z, bool fused) {
    models::set_fused_taesd(fused);
    for (int i = 0; i < 3; ++i) t->decode(z);
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
      start.record(stream);
      for (int i = 0; i < 50; ++i) t->decode(z);
      stop.record(stream);
      stop.synchronize();
      best = std::min(best, static_cast<double>(start.elapsed_time(stop)) / 50);
    }
    return best;
  };
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    auto t = on_gpu(sd15(), dtype);
    for (const std::int64_t side : {64, 128}) {
      const auto z = at::randn({1, 4, side, side}, at::TensorOptions().device(dev).dtype(dtype));
      const double eager = time_ms(t, z, false), fused = time_ms(t, z, true);
      std::cout << "  taesd decode " << side * 8 << "²: fused " << fused << " ms, eager " << eager << " ms ("
                << c10::toString(dtype) << ", SD 1.5's TAESD, device time per decode: 50 on one stream, best of 2)\n";
      expect(models::fused_taesd_enabled(), std::string("the fused path still on after timing ") + c10::toString(dtype));
    }
  }
  models::set_fused_taesd(was_on);
  at::globalContext().setBenchmarkCuDNN(was_benchmark);
}

void check_nccl() {
  need_gpus(2);
  auto comms = parallel::make_nccl_group({0, 1});
  std::vector<std::vector<at::Tensor>> gathered(2);
  std::vector<at::Tensor> broadcasted(2), received(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      auto& c = *comms[static_cast<std::size_t>(r)];
      auto mine = at::full({2, 3}, static_cast<double>(r + 1), at::TensorOptions().device(d).dtype(at::kBFloat16));
      gathered[static_cast<std::size_t>(r)] = c.all_gather(mine);
      broadcasted[static_cast<std::size_t>(r)] = c.broadcast(r == 1 ? mine * 5 : at::zeros_like(mine), 1);
      at::Tensor box = at::empty({4}, at::TensorOptions().device(d));
      if (r == 0) c.send(at::arange(4, at::TensorOptions().device(d).dtype(at::kFloat)), 1);
      if (r == 1) c.recv(box, 0);
      c.barrier();
      received[static_cast<std::size_t>(r)] = box;
    });
  }
  for (auto& t : threads) t.join();
  bool gather_ok = true;
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < 2; ++k)
      gather_ok = gather_ok && gathered[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)].cpu().eq(k + 1).all().item<bool>();
  expect(gather_ok, "all_gather: every rank sees both ranks' tensors");
  expect(broadcasted[0].cpu().eq(10).all().item<bool>() && broadcasted[1].cpu().eq(10).all().item<bool>(),
         "broadcast from rank 1 reaches rank 0");
  expect(received[1].cpu().equal(at::arange(4, at::kFloat)), "send/recv rank 0 -> rank 1");
  expect(comms[0]->bytes_sent() > 0, "bytes counted");

  // all_to_all: grouped sends and receives, each chunk once (rank r sends [d + 1] values r*10+d to d).
  std::vector<int> a2a_ok(2, 0);
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      c10::cuda::CUDAGuard guard(d);
      auto& c = *comms[static_cast<std::size_t>(r)];
      std::vector<at::Tensor> chunks;
      for (int k = 0; k < 2; ++k)
        chunks.push_back(at::full({k + 1}, static_cast<double>(r * 10 + k), at::TensorOptions().device(d).dtype(at::kBFloat16)));
      const auto before = c.bytes_sent();
      const auto got = c.all_to_all(chunks);
      bool ok = got.size() == 2 && c.bytes_sent() - before == 2 * (2 - r);
      for (int q = 0; ok && q < 2; ++q)
        ok = got[static_cast<std::size_t>(q)].size(0) == r + 1 &&
             got[static_cast<std::size_t>(q)].cpu().eq(q * 10 + r).all().item<bool>();
      a2a_ok[static_cast<std::size_t>(r)] = ok;
    });
  }
  for (auto& t : threads) t.join();
  expect(a2a_ok[0] && a2a_ok[1], "all_to_all: each rank gets every rank's chunk for it, each sent once");

  // all_gather_async: two gathers in flight (one of 64 MB) while the compute stream multiplies,
  // in order with a blocking one; counted in bytes_sent; the values arrive after wait().
  std::vector<int> async_ok(2, 0);
  std::vector<std::int64_t> async_bytes(2, 0);
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      c10::cuda::CUDAGuard guard(d);
      auto& c = *comms[static_cast<std::size_t>(r)];
      const auto before = c.bytes_sent();
      const auto f = at::TensorOptions().device(d).dtype(at::kFloat);
      auto big = c.all_gather_async(at::full({std::int64_t{1} << 24}, static_cast<double>(r + 1), f));
      auto small = c.all_gather_async(at::full({5}, static_cast<double>(10 * (r + 1)), f));
      auto m = at::randn({2048, 2048}, f);
      for (int i = 0; i < 8; ++i) m = at::tanh(at::matmul(m, m));
      const auto blocking = c.all_gather(at::full({3}, static_cast<double>(100 * (r + 1)), f));
      const auto gb = big->wait(), gs = small->wait();
      bool ok = gb.size() == 2 && gs.size() == 2 && m.isfinite().all().item<bool>();
      for (int k = 0; ok && k < 2; ++k)
        ok = gb[static_cast<std::size_t>(k)].eq(k + 1).all().item<bool>() && gs[static_cast<std::size_t>(k)].eq(10 * (k + 1)).all().item<bool>() &&
             blocking[static_cast<std::size_t>(k)].eq(100 * (k + 1)).all().item<bool>();
      async_ok[static_cast<std::size_t>(r)] = ok;
      async_bytes[static_cast<std::size_t>(r)] = c.bytes_sent() - before;
    });
  }
  for (auto& t : threads) t.join();
  expect(async_ok[0] && async_ok[1], "all_gather_async: both ranks' tensors after wait(), in order with a blocking all_gather");
  expect(async_bytes[0] == (std::int64_t{4} << 24) + 20 + 12, "all_gather_async counted in bytes_sent");

  // Aborted while a gather is pending: wait() throws Aborted on both ranks (a fresh group).
  auto doomed = parallel::make_nccl_group({0, 1});
  std::atomic<int> enqueued{0}, aborted{0}, threw{0};
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(r));
      c10::cuda::CUDAGuard guard(d);
      auto& c = *doomed[static_cast<std::size_t>(r)];
      auto pending = c.all_gather_async(at::ones({1024}, at::TensorOptions().device(d)));
      ++enqueued;
      if (r == 0) {
        while (enqueued.load() < 2) std::this_thread::yield();
        c.abort("device 0 failed: simulated");
        aborted = 1;
      }
      while (!aborted.load()) std::this_thread::yield();
      try {
        pending->wait();
      } catch (const parallel::Aborted&) {
        ++threw;
      }
    });
  }
  for (auto& t : threads) t.join();
  expect(threw.load() == 2, "a pending all_gather_async's wait() throws Aborted on every rank after abort()");
}

void check_strategies() {
  need_gpus(2);
  auto sd = tiny_sdxl(true);
  job::CancelToken never;
  const auto req = request(9);
  const auto base = sd->generate(req, {}, never);
  auto run = [&](const std::string& name, int n, int batch = 1) {
    auto r = req;
    r.strategy.name = name;
    r.strategy.devices = n;
    r.batch = batch;
    return sd->generate(r, {}, never);
  };
  const auto cfgp = run("cfg-parallel", 2);
  std::cout << "  cfg-parallel vs one GPU: rel-L2 " << rel_l2(cfgp, base) << "\n";
  expect(rel_l2(cfgp, base) < 2e-2, "cfg-parallel on 2 GPUs gives the one-GPU result (bf16 batch 1 vs 2, rel-L2 < 2e-2)");
  const auto dr1 = run("driffusion", 1);
  expect(rel_l2(dr1, base) < 1e-6, "driffusion with one device is the baseline");
  for (const char* mode : {"driffusion", "driffusion-aggressive"}) {
    const auto dr = run(mode, 2);
    const auto stats = nlohmann::json::parse(dr.metadata_json)["strategy"];
    const auto m = std::string(mode) == "driffusion" ? parallel::DRiffusion::Mode::Conservative
                                                     : parallel::DRiffusion::Mode::Aggressive;
    std::cout << "  " << mode << " n=2: rounds " << stats["rounds"] << ", rel-L2 vs one GPU " << rel_l2(dr, base) << "\n";
    expect(stats["rounds"] == parallel::DRiffusion::expected_rounds(m, req.steps, 2), std::string(mode) + " round count");
    const auto points = parallel::DRiffusion::round_points(m, req.steps, 2);
    expect(stats.value("paired_rounds", 0) == std::count(points.begin(), points.end(), 1),
           std::string(mode) + ": its one-point rounds split the prompt and negative prompt over both GPUs");
  }
  auto b2 = req;
  b2.batch = 3;
  const auto single3 = sd->generate(b2, {}, never);
  const auto dp = run("data-parallel", 2, 3);
  std::cout << "  data-parallel batch 3 vs one GPU: rel-L2 " << rel_l2(dp, single3) << "\n";
  expect(rel_l2(dp, single3) < 2e-2, "data-parallel batch 3 over 2 GPUs gives the one-GPU images");
  const auto distri = run("distrifusion", 2);
  const auto distri_stats = nlohmann::json::parse(distri.metadata_json)["strategy"];
  std::cout << "  distrifusion n=2 vs one GPU: rel-L2 " << rel_l2(distri, base) << "; messages per step "
            << distri_stats["messages_per_step"].dump() << "\n";
  expect(rel_l2(distri, base) < 0.3, "distrifusion on 2 GPUs (4 synchronous steps, then stale) stays near one GPU");
  // n (L + 1) messages in a synchronous step with L hooked layer calls; 2 would mean the layers
  // ran without their exchanges (a CUDA graph replaying a captured band).
  expect(distri_stats["messages_per_step"][0].get<int>() > 2,
         "distrifusion's synchronous steps gather at every hooked layer (the bands are never graph-replayed)");
  // Stale steps, graphed (the default on GPUs: warm_rank() captured them): the whole step's
  // contributions in one all_gather after the replay, then eps's, eps alone in the last step;
  // eager (DIFFRACT_STAGE_GRAPHS=0): one asynchronous all_gather per bucket (min(8, L)) and
  // eps's (DistriFusion::messages_per_step). Both give the same image but for bf16 rounding.
  const auto follows = [&](const nlohmann::json& stats, int buckets) {
    const auto per_step = stats["messages_per_step"].get<std::vector<int>>();
    const int layers = per_step.at(0) / 2 - 1;
    bool counts = static_cast<int>(per_step.size()) == req.steps;
    for (int i = 0; counts && i < req.steps; ++i)
      counts = per_step[static_cast<std::size_t>(i)] == parallel::DistriFusion::messages_per_step(i, req.steps, 4, 2, layers, buckets);
    std::cout << "  distrifusion (" << buckets << " bucket(s)): " << layers << " hooked layer calls; stale step messages "
              << per_step.at(4) << ", bytes per step " << stats["bytes_per_step"].dump() << "\n";
    return counts;
  };
  const auto note = distri_stats["note"].get<std::string>();
  expect(note.find("into fixed buffers") != std::string::npos, "distrifusion's stale steps are graphed on GPUs: " + note);
  expect(follows(distri_stats, 1), "graphed distrifusion's messages per step: one gather of the step's contributions, then eps");
  setenv("DIFFRACT_STAGE_GRAPHS", "0", 1);
  const auto distri_eager = run("distrifusion", 2);
  unsetenv("DIFFRACT_STAGE_GRAPHS");
  const auto eager_stats = nlohmann::json::parse(distri_eager.metadata_json)["strategy"];
  expect(follows(eager_stats, 8), "eager distrifusion's messages per step follow DistriFusion::messages_per_step (buckets, then eps)");
  std::cout << "  distrifusion graphed vs eager stale steps: rel-L2 " << rel_l2(distri, distri_eager) << "\n";
  expect(rel_l2(distri, distri_eager) < 2e-2, "distrifusion's graphed stale steps give the eager ones' image (bf16)");
  const auto hybrid = run("hybrid-cfg", 2);
  expect(nlohmann::json::parse(hybrid.metadata_json)["strategy"]["rel_mae"].size() == 9u, "hybrid-cfg reports rel-MAE per step");
  // AsyncDiff over NCCL: one synchronous step, then the stale components, n messages a step.
  const auto ad = run("asyncdiff", 2);
  const auto ad_stats = nlohmann::json::parse(ad.metadata_json)["strategy"];
  std::cout << "  asyncdiff n=2 vs one GPU: rel-L2 " << rel_l2(ad, base) << "; " << ad_stats.dump().substr(0, 400) << "\n";
  expect(ad_stats["messages_per_step"].size() == 9u && ad_stats["messages_per_step"][1] == 2,
         "asyncdiff on 2 GPUs sends its messages as designed");
  expect(std::isfinite(rel_l2(ad, base)) && rel_l2(ad, base) < 0.5, "asyncdiff on 2 GPUs stays near the one-GPU result");
}

// The strategies that spread over more than 2 GPUs (issue 9), on 4 (and 8 where the machine has
// them): NCCL's collectives among all ranks, DRiffusion's rounds with 4 drafts, CFG-parallel x
// DRiffusion (2 x 2) against DRiffusion's 2 drafts batched, a batch of 8 over 4 GPUs against one,
// DistriFusion's 4 bands and AsyncDiff's 4 components (plain and stride 2) near one GPU.
void check_wide() {
  need_gpus(4);
  const int gpus = static_cast<int>(torch::cuda::device_count()) >= 8 ? 8 : 4;
  std::vector<int> ids;
  for (int d = 0; d < gpus; ++d) ids.push_back(d);
  {
    auto comms = parallel::make_nccl_group(ids);
    std::vector<int> ok(static_cast<std::size_t>(gpus), 0);
    std::vector<std::thread> threads;
    for (int r = 0; r < gpus; ++r) {
      threads.emplace_back([&, r] {
        const at::Device d(at::kCUDA, static_cast<c10::DeviceIndex>(r));
        c10::cuda::CUDAGuard guard(d);
        auto& c = *comms[static_cast<std::size_t>(r)];
        const auto f = at::TensorOptions().device(d).dtype(at::kFloat);
        const auto gathered = c.all_gather(at::full({3}, static_cast<double>(r + 1), f));
        auto into = at::empty({gpus, 5}, f);
        c.all_gather_into(at::full({5}, static_cast<double>(10 * (r + 1)), f), into);
        const auto from_last = c.broadcast(at::full({2}, static_cast<double>(r), f), gpus - 1);
        at::Tensor box = at::empty({4}, f);
        // A ring of sends: even ranks send first, odd ranks receive first.
        const int next = (r + 1) % gpus, prev = (r + gpus - 1) % gpus;
        if (r % 2 == 0) {
          c.send(at::full({4}, static_cast<double>(r), f), next);
          c.recv(box, prev);
        } else {
          c.recv(box, prev);
          c.send(at::full({4}, static_cast<double>(r), f), next);
        }
        c.barrier();
        bool good = static_cast<int>(gathered.size()) == gpus && box.eq(prev).all().item<bool>() &&
                    from_last.eq(gpus - 1).all().item<bool>();
        for (int k = 0; good && k < gpus; ++k)
          good = gathered[static_cast<std::size_t>(k)].eq(k + 1).all().item<bool>() && into[k].eq(10 * (k + 1)).all().item<bool>();
        ok[static_cast<std::size_t>(r)] = good;
      });
    }
    for (auto& t : threads) t.join();
    expect(std::all_of(ok.begin(), ok.end(), [](int v) { return v != 0; }),
           "NCCL on " + std::to_string(gpus) + " GPUs: all_gather, all_gather_into, broadcast and a ring of sends on every rank");
  }

  auto sd = tiny_sdxl(true);
  job::CancelToken never;
  const auto req = request(9);
  const auto base = sd->generate(req, {}, never);
  auto run = [&](const std::string& name, int n, const job::GenerationRequest& from) {
    auto r = from;
    r.strategy.name = name;
    r.strategy.devices = n;
    return sd->generate(r, {}, never);
  };
  const auto stats = [](const job::GenerationResult& r) { return nlohmann::json::parse(r.metadata_json)["strategy"]; };
  for (int n = 4; n <= gpus; n *= 2) {
    for (const char* mode : {"driffusion", "driffusion-aggressive"}) {
      const auto m = std::string(mode) == "driffusion" ? parallel::DRiffusion::Mode::Conservative
                                                       : parallel::DRiffusion::Mode::Aggressive;
      const auto dr = run(mode, n, req);
      const auto s = stats(dr);
      std::cout << "  " << mode << " n=" << n << ": rounds " << s["rounds"] << ", rel-L2 vs one GPU " << rel_l2(dr, base) << "\n";
      expect(s["rounds"] == parallel::DRiffusion::expected_rounds(m, req.steps, n) && s["devices"] == n,
             std::string(mode) + " with " + std::to_string(n) + " drafts: its round count on " + std::to_string(n) + " GPUs");
      expect(rel_l2(dr, base) > 0 && rel_l2(dr, base) < 0.5, std::string(mode) + " n=" + std::to_string(n) + " stays near one GPU");
      const auto paired = run(std::string("cfg-") + mode, n, req);
      const auto drafts = run(mode, n / 2, req);
      std::cout << "  cfg-" << mode << " on " << n << " GPUs vs " << mode << " n=" << n / 2 << ": rel-L2 " << rel_l2(paired, drafts) << "\n";
      expect(stats(paired)["rounds"] == parallel::DRiffusion::expected_rounds(m, req.steps, n / 2) &&
                 rel_l2(paired, drafts) < 2e-2,
             std::string("cfg-") + mode + " on " + std::to_string(n) + " GPUs follows " + mode + " with " +
                 std::to_string(n / 2) + " drafts (bf16 batch 1 vs 2, rel-L2 < 2e-2)");
    }
    auto batch = req;
    batch.batch = 2 * n;
    const auto single = sd->generate(batch, {}, never);
    const auto dp = run("data-parallel", n, batch);
    std::cout << "  data-parallel batch " << batch.batch << " over " << n << " GPUs vs one GPU: rel-L2 " << rel_l2(dp, single) << "\n";
    expect(dp.images.size() == static_cast<std::size_t>(batch.batch) && rel_l2(dp, single) < 2e-2,
           "data-parallel: a batch of " + std::to_string(batch.batch) + " over " + std::to_string(n) + " GPUs gives the one-GPU images");
  }
  // DistriFusion's 4 bands need 4 rows each at the UNet's coarsest level: 256² here.
  auto large = req;
  large.width = large.height = 256;
  const auto large_base = sd->generate(large, {}, never);
  const auto distri = run("distrifusion", 4, large);
  std::cout << "  distrifusion n=4 vs one GPU: rel-L2 " << rel_l2(distri, large_base) << "; messages per step "
            << stats(distri)["messages_per_step"].dump() << "\n";
  expect(rel_l2(distri, large_base) < 0.3, "distrifusion on 4 GPUs (4 bands, stale after 4 steps) stays near one GPU");
  for (const char* name : {"asyncdiff", "asyncdiff-stride2"}) {
    const auto ad = run(name, 4, req);
    const auto s = stats(ad);
    std::cout << "  " << name << " on 4 GPUs vs one GPU: rel-L2 " << rel_l2(ad, base) << "; messages per step "
              << s["messages_per_step"].dump() << "\n";
    expect(s["devices"] == 4 && std::isfinite(rel_l2(ad, base)) && rel_l2(ad, base) < 0.5,
           std::string(name) + " on 4 GPUs stays near the one-GPU result");
  }
}

void check_cancel() {
  need_gpus(2);
  auto sd = tiny_sdxl(true);
  auto req = request(400);
  req.strategy.name = "cfg-parallel";
  req.strategy.devices = 2;
  job::CancelToken token;
  int seen = 0;
  job::JobObserver o;
  o.on_step = [&](const job::StepEvent&) {
    if (++seen == 10) token.cancel();
  };
  bool cancelled = false;
  try {
    sd->generate(req, o, token);
  } catch (const job::Cancelled&) {
    cancelled = true;
  }
  std::cout << "  steps reported before the job stopped: " << seen << " of " << req.steps << "\n";
  expect(cancelled && seen < 60, "a 2-GPU job stops soon after cancel");
  req.steps = 4;
  job::CancelToken never;
  bool ok = true;
  try {
    sd->generate(req, {}, never);
  } catch (const std::exception& e) {
    ok = false;
    std::cout << "  " << e.what() << "\n";
  }
  expect(ok, "the group runs the next job after a cancel");
}

std::int64_t cuda_allocated(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

// A job that does not fit beside what else holds the GPU (another model, here a filler tensor
// leaving 1.5 GB free): an Error naming out of memory, the device, where the job was and its
// size; a second failure holds no more memory than the first (the graphs and buffers a first
// attempt caches for the new shape stay, nothing grows); once the memory is there, the same
// pipeline runs the same job. `strategy` empty: one GPU; otherwise that strategy over GPUs 0 and
// 1, the filler on `filled` (the rank that runs out, whose error must name its GPU; the
// communicators are rebuilt for the next job).
void oom_case(bool graphs, const std::string& strategy, int filled) {
  auto sd = tiny_sdxl(graphs);
  job::CancelToken never;
  auto small = request(4);
  if (!strategy.empty()) {
    small.strategy.name = strategy;
    small.strategy.devices = 2;
  }
  auto big = small;
  big.width = big.height = 4096;
  big.batch = 8;
  sd->generate(small, {}, never);  // loaded, warm (a strategy's replicas too)
  release_cached_memory();         // what earlier pipelines left is not counted as free
  const auto before = cuda_allocated(filled);
  std::size_t free = 0, total = 0;
  {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(filled));
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  }
  auto filler = at::empty({static_cast<std::int64_t>(free) - (std::int64_t(3) << 29)},
                          at::TensorOptions().dtype(at::kByte).device(at::kCUDA, filled));
  std::vector<std::string> errors;
  std::vector<std::int64_t> held;
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::string error;
    try {
      sd->generate(big, {}, never);
    } catch (const Error& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("not a diffract::Error: ") + e.what();
    }
    errors.push_back(error);
    held.push_back(cuda_allocated(filled) - filler.nbytes());
  }
  filler.reset();
  release_cached_memory();  // as the engine does when it drops a model for another
  const std::string what = (strategy.empty() ? std::string("one GPU") : strategy + " on 2 GPUs, cuda:" + std::to_string(filled) + " full") +
                           ", graphs " + (graphs ? "on" : "off");
  std::cout << "  " << what << ": " << errors[0].substr(0, 600) << "\n";
  const std::string device = "out of memory on cuda:" + std::to_string(filled);
  const bool named = std::all_of(errors.begin(), errors.end(), [&](const std::string& e) {
    return e.find(device) != std::string::npos && e.find("4096x4096, batch 8") != std::string::npos &&
           e.find("Exception raised from") == std::string::npos;
  });
  expect(named, "a job too large for what is free is an error naming it and its GPU, twice (" + what + ")");
  std::cout << "  allocated on cuda:" << filled << " before " << before / 1e6 << " MB, after one failed job "
            << held[0] / 1e6 << " MB, after two " << held[1] / 1e6 << " MB\n";
  expect(held[1] <= held[0] + (std::int64_t(8) << 20), "a second failure holds no more than the first (" + what + ")");
  bool ok = true;
  try {
    const auto r = sd->generate(big, {}, never);
    ok = r.images.size() == 8;
  } catch (const std::exception& e) {
    ok = false;
    std::cout << "  " << e.what() << "\n";
  }
  expect(ok, "the same pipeline runs the job once the memory is there (" + what + ")");
}

void check_oom() {
  need_gpus(1);
  for (const bool graphs : {true, false}) oom_case(graphs, "", 0);
}

// The same with a strategy's second GPU full: its rank runs out, the error names cuda:1, the
// NCCL communicators are torn down and rebuilt, and the next job runs on both GPUs.
void check_oom_parallel() {
  need_gpus(2);
  for (const bool graphs : {true, false}) oom_case(graphs, "cfg-parallel", 1);
}

// Cancel at any moment, 200 times in a row: an engine on cuda:0 alternating between two paths of
// a tiny SD folder (DIFFRACT_CANCEL_MODEL), so every job loads its model again and a cancel lands
// in the load, the warm-up with its graph captures, the text encoding, a step, a preview or the
// decode (or after the job). Every job must end, cancelled or done, within 60 s and with no
// error; a job run to its end after the 20th and after the 200th must then leave the process's
// resident memory and the GPU memory where they were.
void check_cancel_any() {
  need_gpus(1);
  const char* model = std::getenv("DIFFRACT_CANCEL_MODEL");
  if (!model) throw Skip{"DIFFRACT_CANCEL_MODEL (a tiny SD folder) not given"};
  // No sizes prepared while the engine idles: the two measures below then see the same graphs.
  setenv("DIFFRACT_BACKGROUND_TUNING", "0", 1);
  const auto other = std::filesystem::temp_directory_path() / "diffract-cancel-any-model";
  std::filesystem::remove(other);
  std::filesystem::create_directory_symlink(std::filesystem::absolute(model), other);
  const std::string paths[2] = {std::filesystem::absolute(model).string(), other.string()};
  job::GenerationRequest r;
  r.prompt = "a red apple";
  r.steps = 6;
  r.width = r.height = 64;
  r.device = "cuda:0";
  r.preview_every = 1;
  engine::Engine engine;
  const auto run_to_end = [&] {  // on paths[0], so both measures see the same model loaded
    auto q = r;
    q.model = paths[0];
    job::CancelToken never;
    engine.run(q, {}, never);
    return std::make_pair(test::process_memory_bytes(), cuda_allocated(0));
  };
  std::mt19937 rng(11);
  std::pair<std::int64_t, std::int64_t> at20{};
  const auto t0 = std::chrono::steady_clock::now();
  const auto storm = test::cancel_storm(
      engine, 200,
      [&](int i) {
        auto q = r;
        q.model = paths[i % 2];
        return q;
      },
      // Mostly inside the load and warm-up, every fourth later (into the steps and the decode).
      [&](int i) { return std::chrono::microseconds(rng() % (i % 4 ? 150000 : 900000)); },
      [&](int i) {
        if (i == 19) at20 = run_to_end();
      });
  const auto at200 = run_to_end();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& errors = storm.errors;
  std::cout << "  200 jobs in " << s << " s: cancelled " << storm.cancelled << ", finished " << storm.finished
            << ", errors " << errors.size() << (errors.empty() ? "" : " (first: " + errors.front().substr(0, 300) + ")")
            << "\n";
  std::cout << "  resident after 20 jobs " << at20.first / 1e6 << " MB, after 200 " << at200.first / 1e6
            << " MB; GPU allocated " << at20.second / 1e6 << " / " << at200.second / 1e6 << " MB\n";
  expect(!storm.hung, "every cancelled job ends within 60 s");
  expect(errors.empty(), "no job ends in an error");
  expect(storm.cancelled > 100, "most jobs were cancelled before their end");
  expect(at200.second - at20.second < (std::int64_t(16) << 20), "GPU memory is back to its level after 200 jobs");
  expect(at200.first - at20.first < (std::int64_t(128) << 20), "resident memory does not grow with cancelled jobs");
  std::filesystem::remove(other);
}

// x -> 0.1 x, failing on one rank at one step.
class Scaled final : public parallel::Denoiser {
 public:
  Scaled(bool fail) : fail_(fail) {}
  at::Tensor eval(const at::Tensor& x, double t, parallel::Branch) override {
    if (fail_ && t < 500) throw Error("simulated out of memory");
    return x * 0.1;
  }
  bool cfg() const override { return false; }
  double guidance_scale() const override { return 1; }
  std::int64_t batch() const override { return 1; }
  at::ScalarType output_dtype() const override { return at::kFloat; }
  std::unique_ptr<parallel::Denoiser> rows(std::int64_t, std::int64_t) const override {
    return std::make_unique<Scaled>(fail_);
  }

 private:
  bool fail_;
};

void check_failure() {
  need_gpus(2);
  auto group = parallel::DeviceGroup::cuda({0, 1});
  auto inputs = [&](int failing_rank) {
    parallel::LoopInputs in;
    in.kind = schedulers::SamplerKind::Euler;
    in.steps = 10;
    in.latents = at::randn({1, 4, 16, 16}, at::TensorOptions().device(at::kCUDA, 0));
    in.make_denoiser = [failing_rank](int rank, const c10::Device&) { return std::make_unique<Scaled>(rank == failing_rank); };
    return in;
  };
  parallel::DRiffusion s;
  s.n = 2;
  s.mode = parallel::DRiffusion::Mode::Aggressive;
  std::string error;
  try {
    s.run(*group, inputs(1));
  } catch (const Error& e) {
    error = e.what();
  }
  std::cout << "  error: " << error << "\n";
  expect(error.find("device 1") != std::string::npos && error.find("simulated out of memory") != std::string::npos,
         "a failing GPU aborts the job with an error naming it");
  bool ok = true;
  try {
    const auto out = s.run(*group, inputs(-1));
    ok = out.latents.defined() && out.latents.isfinite().all().item<bool>();
  } catch (const std::exception& e) {
    ok = false;
    std::cout << "  " << e.what() << "\n";
  }
  expect(ok, "the group (communicators rebuilt) runs the next job");
}

// A tiny random MMDiT in fp32 (SD3.5-style: qk-norm, one dual-attention block), one copy per GPU
// from the same seed, and a 6-step flow-matching loop of its denoiser with CFG 4.
struct TinySD3Loop {
  std::shared_ptr<std::vector<models::SD3Transformer2DModel>> models;
  parallel::LoopInputs in;
};

TinySD3Loop tiny_sd3_loop(int gpus) {
  models::SD3Transformer2DConfig c;
  c.sample_size = 16;
  c.in_channels = c.out_channels = 4;
  c.num_layers = 4;
  c.attention_head_dim = 16;
  c.num_attention_heads = 4;
  c.joint_attention_dim = 32;
  c.caption_projection_dim = 64;
  c.pooled_projection_dim = 16;
  c.pos_embed_max_size = 32;
  c.qk_norm = "rms_norm";
  c.dual_attention_layers = {0};
  TinySD3Loop loop;
  loop.models = std::make_shared<std::vector<models::SD3Transformer2DModel>>();
  for (int d = 0; d < gpus; ++d) {
    models::SD3Transformer2DModel m(c);
    models::init_random(*m, at::detail::createCPUGenerator(11));
    m->eval();
    m->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)));
    loop.models->push_back(m);
  }
  at::Generator g = at::detail::createCPUGenerator(5);
  const parallel::SD3Conditioning pos{at::randn({1, 8, 32}, g), at::randn({1, 16}, g)};
  const parallel::SD3Conditioning neg{at::randn({1, 8, 32}, g), at::randn({1, 16}, g)};
  auto& in = loop.in;
  in.kind = schedulers::SamplerKind::FlowMatchEuler;
  in.config = schedulers::SchedulerConfig::from_json_text(
      R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})", in.kind, "gpu check");
  in.steps = 6;
  in.latents = at::randn({1, 4, 32, 32}, g).to(at::Device(at::kCUDA, 0));
  in.make_denoiser = [models = loop.models, pos, neg](int, const c10::Device& d) -> std::unique_ptr<parallel::Denoiser> {
    return std::make_unique<parallel::SD3Denoiser>((*models)[static_cast<std::size_t>(d.index())], pos, neg, 4.0,
                                                   at::kFloat, d);
  };
  return loop;
}

double rel(const at::Tensor& a, const at::Tensor& b) { return ((a.cpu() - b.cpu()).norm() / b.cpu().norm()).item<double>(); }

// SD3's denoiser through CFG-parallel and PipeFusion over NCCL, on a tiny random MMDiT in fp32
// (one copy per GPU, the same seed), against one GPU.
// Flux's fused paths on the GPU: the RMSNorm + rope kernel against ATen's ops (strided heads cut
// from one projection, a token offset into the joint sequence, fp16 and bf16) and its time at
// Flux.1's shape; then a small Flux transformer with its projections fused and the kernel on,
// against the same weights run apart through ATen, and against float32.
void check_flux() {
  need_gpus(1);
  ::setenv("DIFFRACT_RMS_NORM_ROPE_VECTOR", "1", 1);  // the default, set for the check whatever the caller set; read once, at the first call
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  expect(models::fused_rms_norm_rope_available(), "built with the RMSNorm + rope kernel");
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto o = at::TensorOptions().device(dev).dtype(dtype);
    for (const auto& [b, t, h, d, offset, total] : std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>>{
             {1, 4096, 24, 128, 512, 4608}, {2, 37, 3, 64, 5, 50}, {1, 9, 2, 18, 0, 9}}) {
      models::RMSNorm norm(d, 1e-6);
      norm->to(dev, dtype);
      norm->weight.copy_(at::rand({d}, o) + 0.5);
      const auto wide = at::randn({b, t, 3 * h * d + 8}, o) * 4;  // q's columns cut from a wider projection
      const auto x = wide.narrow(2, 8, h * d).unflatten(-1, {h, d});
      const auto ids = at::randint(0, 64, {total, 3}, at::TensorOptions().device(dev));
      const auto rope = models::flux_rope(ids, {d - 2 * (d / 4 / 2 * 2), d / 4 / 2 * 2, d / 4 / 2 * 2});
      auto got = at::zeros({b, total, h, d}, o), want = at::zeros({b, total, h, d}, o);
      models::set_fused_rms_norm_rope(false);
      models::rms_norm_rope_into(*norm, x, rope, want, offset);
      models::set_fused_rms_norm_rope(true);
      models::rms_norm_rope_into(*norm, x, rope, got, offset);
      const auto diff = (got.to(at::kFloat) - want.to(at::kFloat)).abs();
      const double err = diff.max().item<double>() / want.to(at::kFloat).abs().max().item<double>();
      const double same = (diff == 0).to(at::kFloat).mean().item<double>();
      std::ostringstream what;
      what << "rms_norm_rope " << c10::toString(dtype) << " [" << b << ", " << t << ", " << h << ", " << d << "] at "
           << offset << ": max error " << err << " of max |out|, " << same * 100 << " % of elements equal";
      expect(err < (dtype == at::kHalf ? 2e-3 : 1e-2) && same > 0.98, what.str());
      expect(at::equal(got.narrow(1, 0, offset), want.narrow(1, 0, offset)), "rms_norm_rope leaves the other tokens alone");
    }
  }
  {
    const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    models::RMSNorm norm(128, 1e-6);
    norm->to(dev, at::kBFloat16);
    const auto x = at::randn({1, 4608, 3 * 3072}, o).narrow(2, 0, 3072).unflatten(-1, {24, 128});
    const auto rope = models::flux_rope(at::zeros({4608, 3}, at::TensorOptions().device(dev)), {16, 56, 56});
    auto out = at::empty({1, 4608, 24, 128}, o);
    models::set_fused_rms_norm_rope(false);
    const double aten = graph_ms_per_call([&] { models::rms_norm_rope_into(*norm, x, rope, out, 0); }, 20);
    models::set_fused_rms_norm_rope(true);
    const double kernel = graph_ms_per_call([&] { models::rms_norm_rope_into(*norm, x, rope, out, 0); }, 20);
    std::cout << "  rms_norm_rope at Flux.1's [1, 4608, 24, 128]: ATen " << aten << " ms, kernel " << kernel << " ms\n";
    expect(kernel < aten, "the kernel is faster than ATen's ops");
  }
  models::FluxTransformer2DConfig c;
  c.num_layers = 2;
  c.num_single_layers = 3;
  c.num_attention_heads = 4;
  c.attention_head_dim = 64;
  c.joint_attention_dim = 96;
  c.pooled_projection_dim = 48;
  c.guidance_embeds = true;
  c.axes_dims_rope = {16, 24, 24};
  models::FluxTransformer2DModel model(c);
  model->eval();
  models::init_random(*model, 3);
  const auto x = at::randn({2, 64, 64}), ctx = at::randn({2, 20, 96}), pooled = at::randn({2, 48});
  const auto t = at::full({2}, 0.7), g = at::full({2}, 3.5);
  const auto txt = at::zeros({20, 3}), img = models::latent_image_ids(16, 16, at::TensorOptions());
  const auto ref = model->forward(x, ctx, pooled, t, g, model->rope(txt, img));
  model->to(dev, at::kBFloat16);
  const auto bf = [&](const at::Tensor& v) { return v.to(dev, at::kBFloat16); };
  const auto rope = model->rope(bf(txt), bf(img));
  models::set_fused_rms_norm_rope(false);
  const auto apart = model->forward(bf(x), bf(ctx), bf(pooled), bf(t), g.to(dev), rope).to(at::kFloat).cpu();
  models::set_fused_rms_norm_rope(true);
  model->fuse_projections();
  const auto fused = model->forward(bf(x), bf(ctx), bf(pooled), bf(t), g.to(dev), rope).to(at::kFloat).cpu();
  const double r_apart = rel(fused, apart), r_ref = rel(fused, ref);
  std::cout << "  flux transformer bf16, fused vs apart: rel-L2 " << r_apart << "; fused vs float32 on the CPU: " << r_ref << "\n";
  expect(r_apart < 1e-2, "Flux's fused projections and kernel give the unfused bf16 result");
  // bf16's rounding through five blocks of random weights: measured 0.038 on an H200.
  expect(r_ref < 0.1, "Flux in bf16 on the GPU stays near float32");
}

void check_sd3() {
  need_gpus(2);
  const auto loop = tiny_sd3_loop(2);
  const auto& in = loop.in;
  auto one = parallel::DeviceGroup::cuda({0});
  auto two = parallel::DeviceGroup::cuda({0, 1});
  const auto base = parallel::SingleDevice{}.run(*one, in).latents;
  const auto cfgp = parallel::CfgParallel{}.run(*two, in).latents;
  std::cout << "  sd3 cfg-parallel vs one GPU: rel-L2 " << rel(cfgp, base) << "\n";
  expect(rel(cfgp, base) < 1e-3, "SD3 cfg-parallel on 2 GPUs gives the one-GPU result");
  parallel::PipeFusion pf;
  pf.warmup_steps = in.steps;
  const auto sync = pf.run(*two, in);
  std::cout << "  pipefusion, every step synchronous, vs one GPU: rel-L2 " << rel(sync.latents, base) << "\n";
  expect(rel(sync.latents, base) < 1e-3, "pipefusion without staleness gives the one-GPU result");
  for (int m : {2, 4}) {
    pf.warmup_steps = 1;
    pf.patches = m;
    const auto out = pf.run(*two, in);
    std::cout << "  pipefusion 2 stages x " << m << " patches vs one GPU: rel-L2 " << rel(out.latents, base) << "; "
              << out.stats.to_json() << "\n";
    expect(rel(out.latents, base) < 0.1, "pipefusion with stale K/V stays near the one-GPU result");
    expect(out.stats.messages_per_step.back() == parallel::PipeFusion::messages_per_step(false, 2, m),
           "pipefusion sends the messages its design says");
  }
}

// cfg-pipefusion over NCCL: on 2 GPUs one stage per branch (the heads' swap alone), on 4 also
// 2 stages per branch (chains, tails and the swap in one tick: the ordering its header argues
// cannot deadlock). Against one GPU with every step synchronous, and against batched PipeFusion
// (the same stale schedule) with staleness on.
void check_cfg_pipefusion() {
  need_gpus(2);
  const int gpus = std::min(4, static_cast<int>(torch::cuda::device_count()));
  const auto loop = tiny_sd3_loop(gpus);
  const auto& in = loop.in;
  const auto group = [](int n) {
    std::vector<int> ids;
    for (int d = 0; d < n; ++d) ids.push_back(d);
    return parallel::DeviceGroup::cuda(ids);
  };
  auto one = group(1);
  const auto base = parallel::SingleDevice{}.run(*one, in).latents;
  for (int n = 1; 2 * n <= gpus; n *= 2) {
    auto pair = group(2 * n);
    auto half = group(n);
    parallel::PipeFusion split;
    split.cfg_split = true;
    split.n = n;
    split.warmup_steps = in.steps;
    const auto sync = split.run(*pair, in);
    std::cout << "  cfg-pipefusion 2x" << n << ", every step synchronous, vs one GPU: rel-L2 " << rel(sync.latents, base) << "\n";
    expect(rel(sync.latents, base) < 1e-3, "cfg-pipefusion without staleness gives the one-GPU result");
    for (int m : {2, 4}) {
      split.warmup_steps = 1;
      split.patches = m;
      parallel::PipeFusion batched;
      batched.n = n;
      batched.patches = m;
      const auto out = split.run(*pair, in);
      const auto ref = batched.run(*half, in);
      std::cout << "  cfg-pipefusion 2x" << n << " x " << m << " patches: rel-L2 to pipefusion " << rel(out.latents, ref.latents)
                << ", to one GPU " << rel(out.latents, base) << "; " << out.stats.to_json() << "\n";
      expect(rel(out.latents, ref.latents) < 1e-3, "cfg-pipefusion gives batched pipefusion's result (the same stale schedule)");
      expect(out.stats.messages_per_step.back() == parallel::PipeFusion::messages_per_step(false, n, m, true),
             "cfg-pipefusion sends the messages its design says");
    }
  }
  if (gpus < 4) std::cout << "  (2 stages per branch need 4 GPUs; found " << gpus << ")\n";
}


// The SDXL VAE decoder (full size, random weights, bf16) split over 2 GPUs in row bands
// (parallel::decode_parallel) against the one-GPU decode of 1024² (128² latents): both bf16
// results measured against an fp32 one-GPU decode, and the decode times (mean of a few runs
// after a warm-up).
void check_parallel_vae() {
  need_gpus(2);
  const auto config = models::AutoencoderKLConfig::sdxl();
  const auto make = [&](int device, at::ScalarType dtype) {
    models::AutoencoderKL vae(config);
    vae->eval();
    models::init_random(*vae, 17);  // the same weights on every device
    vae->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)), dtype);
    return vae;
  };
  auto vae0 = make(0, at::kBFloat16), vae1 = make(1, at::kBFloat16);
  auto group = parallel::DeviceGroup::cuda({0, 1});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto z = at::randn({1, 4, 128, 128}, gen).to(at::Device(at::kCUDA, 0), at::kBFloat16);
  const auto sync = [] {
    torch::cuda::synchronize(0);
    torch::cuda::synchronize(1);
  };
  at::globalContext().setBenchmarkCuDNN(true);  // as the pipeline's one-device decode runs
  const auto time = [&](const std::function<at::Tensor()>& f, at::Tensor& out) {
    for (int i = 0; i < 2; ++i) out = f();  // warm-up: cuDNN plans, NCCL connections, allocator
    sync();
    const int reps = 5;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) out = f();
    sync();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  at::NoGradGuard no_grad;
  at::Tensor one, two;
  parallel::ParallelDecodeStats stats;
  const double one_ms = time([&] { return vae0->decode(z); }, one);
  const double two_ms = time([&] { return parallel::decode_parallel(*group, {vae0, vae1}, z, &stats); }, two);
  {
    at::Tensor overlapped;
    parallel::ParallelDecodeStats os;
    const double ms = time([&] { return parallel::decode_overlapped(*group, {vae0, vae1}, z, &os); }, overlapped);
    const auto d = (overlapped.to(at::kDouble) - one.to(at::kDouble)).abs();
    const double rel = d.max().item<double>() / one.to(at::kDouble).abs().max().item<double>();
    std::cout << "  overlapped decode on 2 GPUs: " << ms << " ms (1 GPU " << one_ms << " ms, exchanges " << two_ms
              << " ms); max relative difference to 1 GPU " << rel << "; bytes sent per rank " << os.bytes_sent[0] << ", "
              << os.bytes_sent[1] << "; " << os.norms << " GroupNorm gathers\n";
    expect(overlapped.sizes() == one.sizes() && os.parallel && os.ranks == 2 && rel < 5e-2,
           "the overlapped 2-GPU decode matches the 1-GPU one up to bf16 rounding (max rel < 5e-2)");
  }
  at::Tensor truth;
  {
    auto fp32 = make(0, at::kFloat);
    truth = fp32->decode(z.to(at::kFloat)).to(at::kDouble);
  }
  const auto rel_max = [](const at::Tensor& a, const at::Tensor& b) {
    const auto da = a.to(at::kDouble), db = b.to(at::kDouble);
    return (da - db).abs().max().item<double>() / db.abs().max().item<double>();
  };
  const auto rel_l2t = [](const at::Tensor& a, const at::Tensor& b) {
    const auto da = a.to(at::kDouble), db = b.to(at::kDouble).to(da.device());
    return (da - db).norm().item<double>() / db.norm().item<double>();
  };
  expect(two.sizes() == one.sizes() && two.device() == one.device(), "the parallel decode returns the image on GPU 0");
  expect(stats.parallel && stats.ranks == 2, "the decode ran on both GPUs");
  const double d_max = rel_max(two, one), d_l2 = rel_l2t(two, one);
  const double e_one = rel_l2t(one, truth), e_two = rel_l2t(two, truth);
  std::cout << "  2-GPU vs 1-GPU decode (bf16, 1024x1024): max relative difference " << d_max << ", rel-L2 " << d_l2
            << "\n  against an fp32 decode: 1 GPU rel-L2 " << e_one << ", 2 GPUs rel-L2 " << e_two
            << "\n  decode: 1 GPU " << one_ms << " ms, 2 GPUs " << two_ms << " ms (speed-up " << one_ms / two_ms
            << "x); bytes sent per rank " << stats.bytes_sent[0] << ", " << stats.bytes_sent[1] << "; " << stats.convs
            << " halo exchanges, " << stats.norms << " GroupNorm all_gathers\n";
  expect(std::isfinite(d_max) && d_max < 5e-2, "the 2-GPU decode matches the 1-GPU one up to bf16 rounding (max rel < 5e-2)");
  expect(e_two <= 1.5 * e_one + 1e-3, "the 2-GPU decode is as close to fp32 as the 1-GPU one");
}

// The tuned GEMMs of models::linear at SDXL 1024²'s shapes (batch 1 and 2: 1024 / 2048 tokens
// at 1280 channels, 4096 / 8192 at 640): the same result as at::linear up to bf16 rounding, and
// what the timing chose (ms per call: at::linear, cuBLASLt's first proposal, the one kept).
void check_gemm() {
  need_gpus(1);
  ::setenv("DIFFRACT_GEMM_STRIDED_BATCH", "1", 1);  // off by default; read once, at the first call
  at::NoGradGuard no_grad;
  at::manual_seed(2);
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const std::vector<std::pair<std::int64_t, std::int64_t>> at1280 = {{3840, 1280}, {1280, 1280}, {10240, 1280}, {1280, 5120}};
  const std::vector<std::pair<std::int64_t, std::int64_t>> at640 = {{1920, 640}, {640, 640}, {5120, 640}, {640, 2560}};
  double worst = 0;
  for (std::int64_t m : {1024, 2048, 4096, 8192}) {
    for (const auto& [n, k] : m <= 2048 ? at1280 : at640) {
      const auto x = at::randn({m, k}, o), w = at::randn({n, k}, o) * 0.03, b = at::randn({n}, o);
      const auto ref = at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat));
      for (const bool bias : {true, false}) {
        const auto y = models::linear(x, w, bias ? b : at::Tensor());
        const auto want = bias ? ref : ref - b.to(at::kFloat);
        worst = std::max(worst, ((y.to(at::kFloat) - want).norm() / want.norm()).item<double>());
      }
    }
  }
  expect(models::gemm_tuning_enabled() && worst < 1e-2,
         "tuned GEMMs equal fp32 ones up to bf16 rounding (worst rel-L2 " + std::to_string(worst) + ")");
  const auto report = nlohmann::json::parse(models::gemm_tuning_report());
  double aten = 0, kept = 0;
  for (const auto& r : report) {
    std::cout << "  gemm [" << r["m"] << ", " << r["k"] << "] x [" << r["k"] << ", " << r["n"] << "]" << (r["bias"].get<bool>() ? " + bias" : "")
              << ": at::linear " << r["aten_ms"].get<double>() * 1e3 << " us, cuBLASLt first " << r["first_ms"].get<double>() * 1e3
              << " us, kept " << r["best_ms"].get<double>() * 1e3 << " us (" << (r["cublaslt"].get<bool>() ? "cuBLASLt" : "ATen")
              << ", " << r["tried"] << " tried)\n";
    aten += r["aten_ms"].get<double>();
    kept += r["best_ms"].get<double>();
  }
  std::cout << "  all shapes once: at::linear " << aten << " ms, kept " << kept << " ms\n";
  // 32 shapes here; more when other checks ran in this process first.
  expect(report.size() >= 32, "every shape was tuned (" + std::to_string(report.size()) + " in the table)");

  // SD3's joint sequence at batch 2 (DIFFRACT_GEMM_STRIDED_BATCH): each stream's projection
  // written into its rows of the joint tensor, and the out projections reading their rows of the
  // attention's output where they lie, each one strided-batch GEMM.
  const auto rel32 = [](const at::Tensor& got, const at::Tensor& want) {
    return ((got.to(at::kFloat) - want).norm() / want.norm()).item<double>();
  };
  const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
  const auto x = at::randn({2, 4096, 1536}, o), c = at::randn({2, 333, 1536}, o);
  const auto wi = at::randn({4608, 1536}, o) * 0.03, wt = at::randn({4608, 1536}, o) * 0.03;
  const auto bi = at::randn({4608}, o), bt = at::randn({4608}, o);
  auto all = at::empty({2, 4429, 4608}, o);
  auto image_rows = all.slice(1, 0, 4096), text_rows = all.slice(1, 4096);
  models::linear_into(image_rows, x, wi, bi);
  models::linear_into(text_rows, c, wt, bt);
  const auto want = at::cat({at::linear(f(x), f(wi), f(bi)), at::linear(f(c), f(wt), f(bt))}, 1);
  const double joint_err = rel32(all, want);
  const auto att = at::randn({2, 4429, 1536}, o);
  const auto wo = at::randn({1536, 1536}, o) * 0.03, bo = at::randn({1536}, o);
  const auto image_att = att.slice(1, 0, 4096), text_att = att.slice(1, 4096);
  const double out_err = rel32(models::linear(image_att, wo, bo), at::linear(f(image_att), f(wo), f(bo)));
  const double text_err = rel32(models::linear(text_att, wo, bo), at::linear(f(text_att), f(wo), f(bo)));
  std::cout << "  strided batch: joint projections rel-L2 " << joint_err << ", out projections " << out_err << " / "
            << text_err << "\n";
  expect(joint_err < 1e-2 && out_err < 1e-2 && text_err < 1e-2,
         "strided-batch GEMMs equal fp32 ones up to bf16 rounding (joint rows written, strided rows read)");
  int batched = 0;
  for (const auto& r : nlohmann::json::parse(models::gemm_tuning_report()))
    if (r.value("batch", 1) == 2 && r["cublaslt"].get<bool>()) ++batched;
  expect(batched >= 3, "the strided-batch shapes ran cuBLASLt (" + std::to_string(batched) + " of 4 kept it)");
  const double into = graph_ms_per_call([&] {
    models::linear_into(image_rows, x, wi, bi);
    models::linear_into(text_rows, c, wt, bt);
  });
  const double cat = graph_ms_per_call([&] { at::cat({models::linear(x, wi, bi), models::linear(c, wt, bt)}, 1); });
  const double in_place = graph_ms_per_call([&] { models::linear(image_att, wo, bo); });
  const double copied = graph_ms_per_call([&] { models::linear(image_att.contiguous(), wo, bo); });
  std::cout << "  ms per call: joint projections written in place " << into << ", the GEMMs and ATen's cat " << cat
            << "; out projection read in place " << in_place << ", after a copy " << copied << "\n";
  expect(into < cat && in_place < copied, "the strided-batch GEMMs are faster than the GEMMs with ATen's cat or copy");
}

// The feed-forward GELU (tanh) in the GEMM's cuBLASLt epilogue (models::linear_gelu_tanh with
// DIFFRACT_GEMM_GELU=1), at SD3-medium's and Flux.1-dev's feed-forward shapes (image and text
// rows): equal to the fp32 gelu(x w^T + b) up to bf16 rounding, and what the timing saw against
// at::linear followed by at::gelu (the path without it), per shape.
void check_gemm_gelu() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  ::setenv("DIFFRACT_GEMM_GELU", "1", 1);
  at::manual_seed(3);
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const std::vector<std::array<std::int64_t, 3>> shapes = {  // m, n, k
      {8192, 6144, 1536}, {666, 6144, 1536}, {4096, 12288, 3072}, {512, 12288, 3072}};
  double worst = 0, worst_unfused = 0;
  for (const auto& [m, n, k] : shapes) {
    const auto x = at::randn({m, k}, o), w = at::randn({n, k}, o) * 0.03, b = at::randn({n}, o);
    const auto want = at::gelu(at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat)), "tanh");
    const auto fused = models::linear_gelu_tanh(x, w, b).to(at::kFloat);
    const auto unfused = at::gelu(at::linear(x, w, b), "tanh").to(at::kFloat);
    const auto rel = [&](const at::Tensor& y) { return ((y - want).norm() / want.norm()).item<double>(); };
    worst = std::max(worst, rel(fused));
    worst_unfused = std::max(worst_unfused, rel(unfused));
  }
  expect(worst < 1e-2, "GELU in the epilogue equals the fp32 GELU up to bf16 rounding (worst rel-L2 " +
                           std::to_string(worst) + "; ATen's two bf16 ops " + std::to_string(worst_unfused) + ")");
  int gelu_shapes = 0;
  for (const auto& r : nlohmann::json::parse(models::gemm_tuning_report())) {
    if (!r.value("gelu", false)) continue;
    ++gelu_shapes;
    std::cout << "  gemm+gelu [" << r["m"] << ", " << r["k"] << "] x [" << r["k"] << ", " << r["n"]
              << "]: at::linear + at::gelu " << r["aten_ms"].get<double>() * 1e3 << " us, cuBLASLt epilogue first "
              << r["first_ms"].get<double>() * 1e3 << " us, kept " << r["best_ms"].get<double>() * 1e3 << " us ("
              << (r["cublaslt"].get<bool>() ? "epilogue" : "ATen") << ", " << r["tried"] << " tried)\n";
  }
  expect(gelu_shapes == static_cast<int>(shapes.size()), "every shape was timed with the GELU epilogue (" +
                                                             std::to_string(gelu_shapes) + ")");
}

// The DiTs' modulation kernels (layer_norm.h: modulated_layer_norm, gated_residual and the two in
// one) against ATen's ops as the blocks ran them, with scale, shift and gate as the blocks take
// them (chunks of one [B, 6D] modulation, strided), a [1, D] modulation, and cases left to ATen.
// The gated residual is ATen's bits; the normalisation differs only in its reduction order.
void check_modulation() {
  need_gpus(1);
  ::setenv("DIFFRACT_FUSED_MODULATION", "1", 1);  // the default, set for the check whatever the caller set; read once, at the first call
  at::NoGradGuard no_grad;
  at::manual_seed(11);
  constexpr double eps = 1e-6;
  const auto aten_norm = [&](const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
    return at::layer_norm(x, {x.size(-1)}, {}, {}, eps) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
  };
  const auto aten_gate = [](const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
    return x + gate.unsqueeze(1) * y;
  };
  // Largest difference to ATen's result in units of that result's largest magnitude.
  const auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() / b.to(at::kFloat).abs().max().item<double>();
  };
  struct Case {
    std::vector<std::int64_t> shape;  // B, T, D
    bool one_row;                     // a [1, D] modulation for every batch item
    bool kernel;
  };
  const std::vector<Case> cases = {{{2, 4096, 1536}, false, true}, {{2, 333, 1536}, false, true},
                                   {{1, 4096, 3072}, false, true}, {{1, 512, 3072}, false, true},
                                   {{3, 5, 64}, false, true},      {{2, 7, 64}, true, true},
                                   {{2, 9, 36}, false, false}};
  double worst = 0;
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto o = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    for (const auto& k : cases) {
      const std::int64_t b = k.shape[0], d = k.shape[2];
      const auto m = (at::randn({k.one_row ? 1 : b, 6 * d}, o.dtype(at::kFloat)) * 0.5).to(dtype).chunk(6, 1);
      const auto &shift = m[0], &scale = m[1], &gate = m[2];
      const auto x = (at::randn(k.shape, o.dtype(at::kFloat)) * 2 + 0.3).to(dtype), y = at::randn(k.shape, o);
      std::ostringstream what;
      what << at::IntArrayRef(k.shape) << (k.one_row ? " (one modulation row)" : "") << " " << c10::toString(dtype);
      expect(models::modulation_uses_kernel(x, scale, shift) == k.kernel,
             "modulation " + what.str() + (k.kernel ? " takes the kernel" : " is left to ATen"));
      const double e_norm = rel(models::modulated_layer_norm(x, scale, shift, eps), aten_norm(x, scale, shift));
      const auto h = models::gated_residual(x, gate, y);
      const auto [h2, n2] = models::gated_residual_modulated_layer_norm(x, gate, y, scale, shift, eps);
      const auto want_h = aten_gate(x, gate, y);
      const double e_both = rel(n2, aten_norm(want_h, scale, shift));
      worst = std::max({worst, e_norm, e_both});
      expect(e_norm < 1e-2 && e_both < 1e-2, "modulated_layer_norm " + what.str() + " equals ATen's up to rounding (" +
                                                 std::to_string(e_norm) + ", after the gated residual " +
                                                 std::to_string(e_both) + ")");
      expect(at::equal(h, want_h) && at::equal(h2, want_h),
             "gated_residual " + what.str() + " equals x + gate * y bit for bit (alone and with the LayerNorm)");
    }
    // Strided x and y (copied first), and a scale off the 16-byte alignment (left to ATen).
    const auto x = at::randn({2, 1536, 64}, o).transpose(1, 2);
    const auto y = at::randn({2, 1536, 64}, o).transpose(1, 2);
    const auto m = at::randn({2, 6 * 1536}, o).chunk(6, 1);
    expect(at::equal(models::gated_residual(x, m[2], y), aten_gate(x, m[2], y)),
           std::string("gated_residual ") + c10::toString(dtype) + " on strided x and y");
    const auto odd = at::randn({2, 1536 * 6 + 4}, o).narrow(1, 4, 1536);
    expect(!models::modulation_uses_kernel(x, odd, m[0]) &&
               rel(models::modulated_layer_norm(x, odd, m[0], eps), aten_norm(x, odd, m[0])) == 0,
           std::string("modulation ") + c10::toString(dtype) + " with a scale off the 16-byte alignment is ATen's");
  }
  std::cout << "  worst relative difference of the modulated LayerNorm to ATen's " << worst << "\n";
  {
    const auto x = at::randn({2, 16, 64}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
    const auto m = at::randn({2, 128}, x.options()).chunk(2, 1);
    expect(!models::modulation_uses_kernel(x, m[0], m[1]), "fp32 modulation is left to ATen");
  }

  // Time at SD3-medium's and Flux.1-dev's image streams (the gate, scale and shift strided as the
  // blocks take them), against ATen's ops, each in a CUDA graph.
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{2, 4096, 1536}, {1, 4096, 3072}}) {
    const auto m = at::randn({shape[0], 6 * shape[2]}, o).chunk(6, 1);
    const auto x = at::randn(shape, o), y = at::randn(shape, o);
    const double norm = graph_ms_per_call([&] { models::modulated_layer_norm(x, m[1], m[0], eps); });
    const double norm_aten = graph_ms_per_call([&] { aten_norm(x, m[1], m[0]); });
    const double both = graph_ms_per_call([&] { models::gated_residual_modulated_layer_norm(x, m[2], y, m[1], m[0], eps); });
    const double both_aten = graph_ms_per_call([&] { aten_norm(aten_gate(x, m[2], y), m[1], m[0]); });
    const double gate = graph_ms_per_call([&] { models::gated_residual(x, m[5], y); });
    const double gate_aten = graph_ms_per_call([&] { aten_gate(x, m[5], y); });
    std::cout << "  " << at::IntArrayRef(shape) << " bf16, ms per call (ours / ATen's ops): modulated LayerNorm "
              << norm << " / " << norm_aten << ", gated residual + modulated LayerNorm " << both << " / " << both_aten
              << ", gated residual " << gate << " / " << gate_aten << "\n";
    expect(norm < norm_aten && both < both_aten && gate < gate_aten,
           "each modulation kernel is faster than ATen's ops at " + c10::str(at::IntArrayRef(shape)));
  }
}

// The tuning store (io/tuning_store.h) and the timed convolution plans (conv_cuda.cpp): each
// convolution shape, NCHW and channels-last, through models::conv2d equals ATen's fp32 conv2d up
// to bf16 rounding; GEMM and convolution choices are written to DIFFRACT_TUNING_DIR; a second
// process (this program's `tuning_reload`) takes every one of them from there, times nothing, and
// computes the same outputs (bit for bit where the stored plan is cuDNN's heuristic one or a
// cuBLASLt algorithm).
std::string g_program;

struct TuningCase {
  std::int64_t n, c, h, w, k, kernel, stride, padding;
  bool channels_last;
};
const std::vector<TuningCase> kTuningConvs = {
    {2, 320, 128, 128, 320, 3, 1, 1, true},  {2, 640, 64, 64, 640, 3, 1, 1, true},
    {2, 1280, 32, 32, 1280, 3, 1, 1, true},  {2, 320, 128, 128, 320, 3, 2, 1, true},
    {2, 640, 64, 64, 1280, 1, 1, 0, true},   {1, 128, 512, 512, 128, 3, 1, 1, false},
    {1, 256, 256, 256, 256, 3, 1, 1, false}, {1, 4, 128, 128, 4, 1, 1, 0, false}};
const std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> kTuningGemms = {
    {8192, 1280, 640}, {2048, 1280, 1280}, {4096, 5120, 640}, {154, 2048, 1280}};

// Every case's output, in order, for the reload to compare with.
std::vector<at::Tensor> tuning_outputs(double& worst) {
  at::manual_seed(5);
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  std::vector<at::Tensor> outs;
  worst = 0;
  for (const auto& t : kTuningConvs) {
    const auto format = t.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const auto x = at::randn({t.n, t.c, t.h, t.w}, o).contiguous(format);
    const auto w = (at::randn({t.k, t.c, t.kernel, t.kernel}, o) * 0.05).contiguous(format);
    const auto b = at::randn({t.k}, o);
    const auto y = models::conv2d(x, w, b, t.stride, t.padding);
    const auto want = at::conv2d(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat), {t.stride, t.stride},
                                 {t.padding, t.padding});
    worst = std::max(worst, ((y.to(at::kFloat) - want).norm() / want.norm()).item<double>());
    outs.push_back(y);
  }
  for (const auto& [m, n, k] : kTuningGemms) {
    const auto x = at::randn({m, k}, o), w = at::randn({n, k}, o) * 0.03, b = at::randn({n}, o);
    const auto y = models::linear(x, w, b);
    const auto want = at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat));
    worst = std::max(worst, ((y.to(at::kFloat) - want).norm() / want.norm()).item<double>());
    outs.push_back(y);
  }
  at::cuda::device_synchronize();
  return outs;
}

// One count of models::tuning_stats(); 0 where that kind did nothing.
int count(const nlohmann::json& stats, const char* kind, const char* what) {
  return stats.contains(kind) ? stats[kind].value(what, 0) : 0;
}

std::filesystem::path tuning_scratch() { return std::filesystem::temp_directory_path() / "diffract-gpu-check-tuning"; }

void check_tuning() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const auto dir = tuning_scratch();
  std::filesystem::remove_all(dir);
  ::setenv("DIFFRACT_TUNING_DIR", (dir / "store").c_str(), 1);
  ::setenv("DIFFRACT_CONV_TUNING", "timed", 1);  // the reload inherits both
  at::globalContext().setBenchmarkCuDNN(true);   // as the pipelines set it at load
  double worst = 0;
  const auto outs = tuning_outputs(worst);
  expect(worst < 1e-2, "timed convolutions and GEMMs equal fp32 ones up to bf16 rounding (worst rel-L2 " +
                           std::to_string(worst) + ")");
  for (const auto& r : nlohmann::json::parse(models::conv_tuning_report()))
    std::cout << "  conv " << r["shape"].get<std::string>() << ": heuristic " << r["heuristic_ms"].get<double>() * 1e3
              << " us, benchmarked " << r["benchmark_ms"].get<double>() * 1e3 << " us, kept " << r["plan"].get<std::string>()
              << "\n";
  const auto stats = nlohmann::json::parse(models::tuning_stats());
  std::cout << "  " << stats.dump() << "\n";
  expect(count(stats, "conv", "timed") == static_cast<int>(kTuningConvs.size()) &&
             count(stats, "gemm", "timed") >= static_cast<int>(kTuningGemms.size()),
         "every convolution and GEMM shape was timed once (" + stats.dump() + ")");
  models::save_tuning();
  const auto files = std::distance(std::filesystem::directory_iterator(dir / "store"), std::filesystem::directory_iterator());
  expect(files == 1, "one store file for this GPU (" + std::to_string(files) + ")");
  at::Tensor all = at::empty({0}, at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
  for (const auto& y : outs) all = at::cat({all, y.flatten().to(at::kFloat)});
  torch::save(all.cpu(), (dir / "outputs.pt").string());
  const int rc = std::system((g_program + " tuning_reload").c_str());
  expect(rc == 0, "a second process took every choice from the store and matched the outputs (rc " +
                      std::to_string(rc) + ", its lines above)");
}

void check_tuning_reload() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const auto dir = tuning_scratch();
  at::globalContext().setBenchmarkCuDNN(true);
  double worst = 0;
  const auto outs = tuning_outputs(worst);
  const auto stats = nlohmann::json::parse(models::tuning_stats());
  std::cout << "  reload: " << stats.dump() << "\n";
  expect(count(stats, "conv", "timed") == 0 && count(stats, "gemm", "timed") == 0 &&
             count(stats, "conv", "from_store") == static_cast<int>(kTuningConvs.size()) &&
             count(stats, "gemm", "from_store") >= static_cast<int>(kTuningGemms.size()),
         "every choice came from the store, none was timed again");
  at::Tensor before;
  torch::load(before, (dir / "outputs.pt").string());
  std::int64_t offset = 0;
  // A benchmarked plan is benchmarked again in this process and may come out another engine.
  const auto plans = nlohmann::json::parse(models::conv_tuning_report());
  const bool some_benchmarked =
      std::any_of(plans.begin(), plans.end(), [](const auto& p) { return p["plan"] == "benchmark"; });
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const auto y = outs[i].flatten().to(at::kFloat).cpu();
    const auto was = before.narrow(0, offset, y.numel());
    offset += y.numel();
    const bool benchmarked = i < kTuningConvs.size() && some_benchmarked;
    const double diff = (y - was).abs().max().item<double>();
    expect(diff == 0 || (benchmarked && diff < 0.05 * was.abs().max().item<double>()),
           "case " + std::to_string(i) + " as in the first process (max abs difference " + std::to_string(diff) + ")");
  }
}

// Pipeline::prepare, which the desktop app runs in the background for the size on the form: a
// job at a prepared size captures nothing (it takes about what a later job there takes, far less
// than the first job at that size in a pipeline not prepared for it) and gives the same latents
// as that pipeline; a size prepared once is not prepared again, nor is the warm-up's own.
void check_prepare() {
  need_gpus(1);
  job::CancelToken never;
  auto native = request(4);  // the warm-up's own: the model's native size, batch 1, CFG
  native.width = native.height = 0;
  auto other = request(4);
  other.width = 192;
  other.height = 128;
  const auto ms = [](const job::GenerationResult& r) { return r.timings.total_ms; };
  auto plain = tiny_sdxl(true);
  plain->warm_up();  // as the engine does at load
  const auto first = plain->generate(other, {}, never);
  const auto later = plain->generate(other, {}, never);
  auto prepared = tiny_sdxl(true);
  prepared->warm_up();
  const double prepare_ms = prepared->prepare(other);
  const double again_ms = prepared->prepare(other);
  const double warm_size_ms = prepared->prepare(native);
  const auto after = prepared->generate(other, {}, never);
  std::cout << "  192x128: prepare " << prepare_ms << " ms (again " << again_ms << ", the warm-up's size "
            << warm_size_ms << "); first job unprepared " << ms(first) << " ms, later " << ms(later)
            << " ms; first job after prepare " << ms(after) << " ms\n";
  expect(prepare_ms > 0 && again_ms == 0 && warm_size_ms == 0,
         "a new size is prepared once; a size prepared before and the warm-up's are not");
  expect(ms(after) < 0.5 * ms(first) && ms(after) < 2 * ms(later) + 5,
         "the first job at a prepared size costs about a later job's time, not a first job's");
  const double diff = rel_l2(after, first);
  std::cout << "  latents rel-L2, prepared against unprepared: " << diff << "\n";
  expect(diff < 1e-3, "a prepared size gives the unprepared pipeline's latents");
}

// What a row band of the SDXL VAE decoder costs on one GPU (bf16, 1024² image): the whole
// decode, the part before the up blocks (post_quant_conv, conv_in, mid block with its
// attention over all 16384 latents), and decodes of 77 and 64 latent rows (half the image with
// and without a 13-row overlap) — the figures a split decode's design rests on.
void check_vae_bands() {
  need_gpus(1);
  models::AutoencoderKL vae(models::AutoencoderKLConfig::sdxl());
  vae->eval();
  models::init_random(*vae, 17);
  vae->to(at::Device(at::kCUDA, 0), at::kBFloat16);
  at::globalContext().setBenchmarkCuDNN(true);
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto z = at::randn({1, 4, 128, 128}, gen).to(at::Device(at::kCUDA, 0), at::kBFloat16);
  const auto time = [&](const std::function<at::Tensor()>& f) {
    at::Tensor out;
    for (int i = 0; i < 2; ++i) out = f();
    torch::cuda::synchronize(0);
    const int reps = 5;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) out = f();
    torch::cuda::synchronize(0);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  const double full = time([&] { return vae->decode(z); });
  const double before_up = time([&] {
    auto h = vae->post_quant_conv ? vae->post_quant_conv->forward(z) : z;
    return vae->decoder->mid_block->forward(vae->decoder->conv_in->forward(h));
  });
  auto mid_in = vae->decoder->conv_in->forward(vae->post_quant_conv ? vae->post_quant_conv->forward(z) : z);
  const double attention = time([&] { return vae->decoder->mid_block->attentions[0]->as<models::Attention>()->forward(mid_in); });
  std::cout << "  SDXL VAE decode 1024x1024 bf16: " << full << " ms; before the up blocks " << before_up
            << " ms (the mid block's attention " << attention << " ms)\n";
  {
    // Its attention core (one 512-wide head over 16384 latents): SDPA against the chunked
    // fp32-score path multi_head_attention takes for heads over 256 wide, both against fp32.
    const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    const auto q = at::randn({1, 16384, 512}, o), k = at::randn({1, 16384, 512}, o), v = at::randn({1, 16384, 512}, o);
    const auto truth = at::scaled_dot_product_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat)).to(at::kDouble);
    at::Tensor sdpa_out, wide_out;
    const double sdpa = time([&] { return sdpa_out = at::scaled_dot_product_attention(q, k, v); });
    const double wide = time([&] { return wide_out = models::wide_head_attention(q, k, v); });
    const auto err = [&](const at::Tensor& t) { return (t.to(at::kDouble) - truth).norm().item<double>() / truth.norm().item<double>(); };
    std::cout << "  attention [16384, 512] bf16: SDPA " << sdpa << " ms (rel-L2 to fp32 " << err(sdpa_out)
              << "), wide-head path " << wide << " ms (rel-L2 " << err(wide_out) << ")\n";
    expect(err(wide_out) <= 1.5 * err(sdpa_out) + 1e-4, "the wide-head attention is as close to fp32 as SDPA");
  }
  for (int rows : {77, 72, 64}) {
    const auto band = z.narrow(2, 0, rows).contiguous();
    std::cout << "  decode of " << rows << " latent rows: " << time([&] { return vae->decode(band); }) << " ms\n";
  }
  expect(full > 0 && before_up < full, "the decode's parts take less than the whole");
  // The overlapped band decode with the GPU's kernels, its two ranks threads of this process
  // sharing the GPU (an in-process group): the one-GPU image up to bf16 rounding. (Its time here
  // says nothing: both bands share one GPU.)
  const auto one = vae->decode(z);
  at::Tensor truth;  // the same weights in fp32: what bf16 rounding is measured against
  {
    models::AutoencoderKL fp32(models::AutoencoderKLConfig::sdxl());
    fp32->eval();
    models::init_random(*fp32, 17);
    fp32->to(at::Device(at::kCUDA, 0), at::kFloat);
    truth = fp32->decode(z.to(at::kFloat)).to(at::kDouble);
  }
  const auto rel_l2 = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / b.to(at::kDouble).norm().item<double>();
  };
  const double e_one = rel_l2(one, truth);
  for (int n : {2, 3}) {
    auto group = parallel::DeviceGroup::virtual_cpu(n);
    parallel::ParallelDecodeStats stats;
    const auto two = parallel::decode_overlapped(*group, {vae}, z, &stats);
    const double rel = (two.to(at::kDouble) - one.to(at::kDouble)).abs().max().item<double>() /
                       one.to(at::kDouble).abs().max().item<double>();
    const double e_two = rel_l2(two, truth);
    std::cout << "  overlapped decode, " << n << " bands on one GPU: max relative difference to one band " << rel
              << ", rel-L2 " << rel_l2(two, one) << "; against fp32: one band " << e_one << ", " << n << " bands " << e_two
              << "; " << stats.norms << " GroupNorm gathers, overlap " << stats.overlap_rows << " latent rows\n";
    expect(two.sizes() == one.sizes() && two.device() == one.device() && stats.parallel && rel < 5e-2 &&
               e_two <= 1.5 * e_one + 1e-3,
           "the overlapped decode (" + std::to_string(n) + " bands, one GPU) is as close to fp32 as the one-band decode");
  }
}
}  // namespace

// FLUX.1 files on the GPU (DIFFRACT_FLUX_FILES: the Flux fixtures' tiny-flux-dev/ and the
// single-file fixtures' *.safetensors, carried over): the BFL and all-in-one files give the
// folder's job bit for bit (the same bf16 weights); the float8 files run, their difference to the
// folder said; T5 offloaded gives the same job and leaves the GPU without T5 between prompts; T5
// on the CPU (fp32) is close; sequence-parallel over the GPUs there are is the one-GPU job.
void check_flux_files() {
  need_gpus(1);
  const char* env = std::getenv("DIFFRACT_FLUX_FILES");
  if (!env || !std::filesystem::is_directory(std::filesystem::path(env) / "tiny-flux-dev"))
    throw Skip{"DIFFRACT_FLUX_FILES (the tiny Flux folder and files) not given"};
  const std::filesystem::path dir(env), folder = dir / "tiny-flux-dev";
  job::CancelToken never;
  auto req = request(4);
  req.negative_prompt.clear();
  req.cfg = 1.0;
  req.sampler.clear();
  req.width = req.height = 64;
  const auto load = [&](const std::filesystem::path& model, const std::string& t5 = {}) {
    pipeline::Flux::LoadOptions o;
    if (!std::filesystem::is_directory(model)) o.config_dir = folder;
    o.t5_placement = t5;
    return pipeline::Flux::load(model, "cuda:0", o);
  };
  const auto run = [&](pipeline::Flux& f) {
    auto r = req;
    r.model = f.path().string();
    return f.generate(r, {}, never);
  };
  auto base_pipe = load(folder);
  const auto base = run(*base_pipe);
  for (const char* name : {"tiny-flux-dev-bfl", "tiny-flux-dev-aio"}) {
    if (!std::filesystem::exists(dir / (std::string(name) + ".safetensors"))) continue;  // not carried
    auto f = load(dir / (std::string(name) + ".safetensors"));
    expect(rel_l2(run(*f), base) == 0.0, std::string(name) + " on cuda gives the folder's job bit for bit");
  }
  for (const char* name : {"tiny-flux-dev-fp8", "tiny-flux-dev-fp8-scaled"}) {
    auto f = load(dir / (std::string(name) + ".safetensors"));
    const double d = rel_l2(run(*f), base);
    std::cout << "  " << name << " vs the bf16 folder: latents rel-L2 " << d << "\n";
    expect(std::isfinite(d) && d < 0.5, std::string(name) + " dequantised on the GPU runs (finite, near the folder's job)");
  }
  base_pipe.reset();
  c10::cuda::CUDACachingAllocator::emptyCache();
  const auto allocated = [] { return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current; };
  auto on_gpu = load(folder);
  const auto with_t5 = allocated();
  on_gpu.reset();
  c10::cuda::CUDACachingAllocator::emptyCache();
  auto offload = load(folder, "offload");
  const auto without_t5 = allocated();
  std::cout << "  allocated after load: T5 on the GPU " << with_t5 << " B, offloaded " << without_t5 << " B\n";
  expect(without_t5 < with_t5, "offloaded T5 is not on the GPU after load");
  expect(rel_l2(run(*offload), base) == 0.0, "T5 offloaded gives the same job");
  std::cout << "  allocated after an offloaded job: " << allocated() << " B\n";
  auto cpu_t5 = load(folder, "cpu");
  const double d = rel_l2(run(*cpu_t5), base);
  std::cout << "  T5 on the CPU (fp32) vs on the GPU (bf16): latents rel-L2 " << d << "\n";
  expect(d < 5e-2, "T5 on the CPU gives nearly the same job");
  for (int n = 1; n <= static_cast<int>(torch::cuda::device_count()) && n <= 2; ++n) {
    auto r = req;
    r.model = cpu_t5->path().string();
    r.strategy.name = "sequence-parallel";
    r.strategy.devices = n;
    const double e = rel_l2(cpu_t5->generate(r, {}, never), run(*cpu_t5));
    std::cout << "  sequence-parallel on " << n << " GPU(s) vs one: latents rel-L2 " << e << "\n";
    expect(e < 1e-2, "sequence-parallel on " + std::to_string(n) + " GPU(s) gives the one-GPU job");
    // PipeFusion: n stages over the 5 blocks, 2 patches (64 px: 8 token rows), a step stale.
    r.strategy.name = "pipefusion";
    r.strategy.patches = 2;
    const double p = rel_l2(cpu_t5->generate(r, {}, never), run(*cpu_t5));
    std::cout << "  pipefusion " << n << "x2 on GPU(s) vs one: latents rel-L2 " << p << "\n";
    expect(std::isfinite(p) && p > 0 && p < 0.3, "pipefusion on " + std::to_string(n) + " GPU(s) runs near the one-GPU job");
  }
}

// PipeFusion over Flux's blocks and the step caches on the GPU. A tiny random Flux.1-dev (bf16,
// one copy per GPU from one seed): PipeFusion with every step synchronous is the one-GPU loop,
// stale it stays near it, on 1 GPU (stages run one after another through NCCL's one rank) and
// on 2 where there are; TeaCache at threshold 0 is the plain loop. A tiny SDXL job on cuda:0:
// deepcache at interval 1 (its stage graphs) is the plain job (the UNet's whole-step graph),
// interval 3 reuses the steps between, and the first-block cache on the UNet runs.
void check_caches_and_flux_pipefusion() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const int gpus = std::min(2, static_cast<int>(torch::cuda::device_count()));
  models::FluxTransformer2DConfig c = models::FluxTransformer2DConfig::dev();
  c.num_layers = 2;
  c.num_single_layers = 3;
  c.attention_head_dim = 32;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 48;
  c.pooled_projection_dim = 24;
  c.axes_dims_rope = {8, 12, 12};
  auto replicas = std::make_shared<std::vector<models::FluxTransformer2DModel>>();
  for (int d = 0; d < gpus; ++d) {
    models::FluxTransformer2DModel m(c);
    m->eval();
    models::init_random(*m, 5);
    m->to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d)), at::kBFloat16);
    replicas->push_back(m);
  }
  at::Generator g = at::detail::createCPUGenerator(4);
  const parallel::FluxConditioning pos{at::randn({1, 8, 48}, g), at::randn({1, 24}, g)};
  const parallel::FluxConditioning neg{at::randn({1, 8, 48}, g), at::randn({1, 24}, g)};
  parallel::LoopInputs in;
  in.kind = schedulers::SamplerKind::FlowMatchEuler;
  in.config = schedulers::SchedulerConfig::from_json_text(
      R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})", in.kind, "gpu check");
  in.steps = 5;
  in.latents = at::randn({1, 16, 32, 32}, g).to(at::Device(at::kCUDA, 0));
  in.make_denoiser = [replicas, pos, neg](int, const c10::Device& d) -> std::unique_ptr<parallel::Denoiser> {
    return std::make_unique<parallel::FluxDenoiser>((*replicas)[static_cast<std::size_t>(d.index())], pos, neg, 4.0, 3.5,
                                                    at::kBFloat16, d);
  };
  auto one = parallel::DeviceGroup::cuda({0});
  const auto base = parallel::SingleDevice{}.run(*one, in).latents;
  std::vector<int> ids;
  for (int n = 1; n <= gpus; ++n) {
    ids.push_back(n - 1);
    auto group = parallel::DeviceGroup::cuda(ids);
    parallel::PipeFusion pf;
    pf.n = n;
    pf.patches = 4;
    pf.warmup_steps = in.steps;
    const double sync = rel(pf.run(*group, in).latents, base);
    pf.warmup_steps = 1;
    const auto stale = pf.run(*group, in);
    std::cout << "  flux pipefusion " << n << " stage(s) x 4 patches: every step synchronous vs one GPU rel-L2 " << sync
              << ", stale " << rel(stale.latents, base) << "; " << stale.stats.to_json() << "\n";
    expect(sync < 1e-2, "Flux pipefusion without staleness gives the one-GPU loop");
    expect(rel(stale.latents, base) < 0.2, "Flux pipefusion with stale K/V stays near the one-GPU loop");
  }
  parallel::TeaCaching tea;
  tea.threshold = 0;
  expect(rel(tea.run(*one, in).latents, base) < 1e-3, "teacache at threshold 0 is the plain loop on the GPU");
  tea.threshold = 10;
  const auto reused = tea.run(*one, in).stats.reused_steps;
  expect(reused == std::vector<int>({1, 2, 3}), "teacache above any change reuses every step but the first and last");

  auto sd = tiny_sdxl(true);
  job::CancelToken never;
  auto r = request(6);
  const auto plain = sd->generate(r, {}, never);
  r.strategy.name = "deepcache";
  r.strategy.skip = 1;
  const auto every = sd->generate(r, {}, never);
  r.strategy.skip = 3;
  const auto cached = sd->generate(r, {}, never);
  const auto meta = nlohmann::json::parse(cached.metadata_json)["strategy"];
  std::cout << "  deepcache x1 vs the plain job: latents rel-L2 " << rel_l2(every, plain) << "; x3: " << rel_l2(cached, plain)
            << ", " << meta.dump() << "\n";
  expect(rel_l2(every, plain) < 1e-2, "deepcache at interval 1 (stage graphs) gives the plain job");
  expect(meta["reused_steps"] == nlohmann::json::array({1, 2, 4, 5}), "deepcache x3 reuses the steps between refreshes");
  r.strategy.name = "fbcache";
  r.strategy.cache_threshold = 10;
  const auto fb = nlohmann::json::parse(sd->generate(r, {}, never).metadata_json)["strategy"];
  std::cout << "  fbcache on the UNet at threshold 10: " << fb.dump() << "\n";
  expect(fb["reused_steps"] == nlohmann::json::array({1, 2, 3, 4, 5}), "fbcache on a UNet above any change reuses every step but the first");
}

// FP8 on the GPU: the activations' quantisation kernel against the ATen arithmetic it is written
// to match (bit for bit: e4m3 values and scales, bf16 and fp16, rows held in registers and rows
// too wide for them); the fp8 GEMM of a Flux-sized layer against the fp32 product of the same
// e4m3 operands, and what the timing chose; a tiny SDXL job in fp8 near its bf16 one.
void check_fp8() {
  need_gpus(1);
  at::NoGradGuard no_grad;
  const at::Device dev("cuda:0");
  const auto* prop = at::cuda::getDeviceProperties(0);
  if (prop->major * 10 + prop->minor < 89) throw Skip{"no fp8 tensor cores (sm_89+)"};
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{4096, 3072}, {7, 15360}, {3, 20000}, {5, 40}, {2, 36}}) {
      const auto x = (at::randn({rows, cols}, at::TensorOptions().device(dev)) * 3).to(dtype);
      x[0].zero_();
      const auto want = models::quantize_rows_fp8(x);  // ATen ops on the GPU
      const auto got = models::quantize_rows_fp8_kernel(x);
      const auto gq = got.first.view(at::kByte).to(at::kInt).cpu(), wq = want.first.view(at::kByte).to(at::kInt).cpu();
      const auto differ = gq.ne(wq);
      const int64_t n_differ = differ.sum().item<int64_t>();
      const bool scales = at::equal(got.second, want.second);
      // Codes one apart (the same sign) are a rounding tie broken the other way.
      const bool adjacent = n_differ == 0 || (gq - wq).abs().masked_select(differ).max().item<int>() == 1;
      std::cout << "  quantise " << rows << "x" << cols << " " << c10::toString(dtype) << ": scales "
                << (scales ? "equal" : "DIFFER") << ", " << n_differ << " of " << gq.numel() << " codes differ"
                << (adjacent ? "" : " by more than one step") << "\n";
      if (n_differ > 0) {
        const auto where = differ.flatten().nonzero().flatten();
        const auto xs = (x.to(at::kFloat) / want.second).cpu().flatten();
        for (int64_t i = 0; i < std::min<int64_t>(3, where.numel()); ++i) {
          const auto at = where[i].item<int64_t>();
          std::cout << "    x / scale " << xs[at].item<float>() << ": kernel " << gq.flatten()[at].item<int>() << ", ATen "
                    << wq.flatten()[at].item<int>() << "\n";
        }
      }
      expect(scales, "the fp8 quantisation kernel's scales are the ATen arithmetic's");
      expect(adjacent && n_differ * 10000 <= gq.numel(),
             "the fp8 quantisation kernel's codes are the ATen arithmetic's (a few ties at most, one step apart)");
    }
  }
  const auto o = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  models::Linear layer(3072, 12288);
  layer->to(dev, at::kBFloat16);
  models::init_random(*layer, 7);
  models::allow_fp8(*layer);
  const auto x = at::randn({4096, 3072}, o);
  options::Overrides fp8{{"DIFFRACT_PRECISION", "fp8"}};
  at::Tensor y;
  {
    options::JobOptionsScope scope(fp8);
    y = layer->forward(x);
  }
  const auto [q, sx] = models::quantize_rows_fp8(x);
  const auto ref = models::scaled_linear_fp8_reference(q, sx, models::quantize_weight_fp8(layer->weight), layer->bias, at::kFloat);
  const auto exact = at::linear(x.to(at::kFloat), layer->weight.to(at::kFloat), layer->bias.to(at::kFloat));
  std::cout << "  fp8 Linear 4096x3072x12288: rel-L2 to the e4m3 operands' fp32 product " << rel(y.to(at::kFloat), ref)
            << ", to the bf16 weights' fp32 product " << rel(y.to(at::kFloat), exact) << "; timing " << models::fp8_tuning_report() << "\n";
  expect(rel(y.to(at::kFloat), ref) < 1e-2, "the fp8 GEMM gives the product of its e4m3 operands");
  expect(rel(y.to(at::kFloat), exact) < 0.1, "the fp8 GEMM stays near the bf16 layer");

  auto sd = tiny_sdxl(true);
  job::CancelToken never;
  auto r = request(6);
  const auto base = sd->generate(r, {}, never);
  r.precision = "fp8";
  // The tiny model's GEMMs are faster in bf16, so the timed choice would keep them all bf16.
  r.options["DIFFRACT_FP8_LAYERS"] = "all";
  const auto f8 = sd->generate(r, {}, never);
  const double d = rel_l2(f8, base);
  std::cout << "  tiny SDXL fp8 (every eligible layer) vs bf16: latents rel-L2 " << d << "\n";
  expect(std::isfinite(d) && d > 0 && d < 0.2, "an fp8 job stays near its bf16 one, and differs from it (fp8 ran)");
}

// The e4m3 rows written by the kernels that write an fp8 GEMM's input (DIFFRACT_FP8_FUSED_ROWS):
// each kernel's rows equal our quantisation kernel's of its output bit for bit (codes and scales),
// the outputs themselves are unchanged (the activations equal ATen's ops), a strided input is
// quantised where it lies as its contiguous copy would be, an fp8 layer takes the offered rows
// and gives the bits it gives without them, and an input changed since its offer is quantised
// anew. Then the time each kernel adds against the pass it saves, at SD3's and Flux's shapes.
void check_fp8_rows() {
  need_gpus(1);
  const auto* prop = at::cuda::getDeviceProperties(0);
  if (prop->major * 10 + prop->minor < 89) throw Skip{"no fp8 tensor cores (sm_89+)"};
  ::setenv("DIFFRACT_FP8_FUSED_ROWS", "1", 1);  // the default, set for the check whatever the caller set; read once, at the first call
  at::NoGradGuard no_grad;
  at::manual_seed(5);
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  options::Overrides fp8{{"DIFFRACT_PRECISION", "fp8"}, {"DIFFRACT_FP8_LAYERS", "all"}};
  options::JobOptionsScope scope(fp8);
  const auto bits = [](const at::Tensor& q) { return q.view(at::kByte); };
  // The rows offered for y equal quantize_rows_fp8_kernel(y): the same arithmetic in both kernels.
  const auto same_rows = [&](const at::Tensor& y, const std::string& what) {
    const auto rows = models::offered_fp8_rows(y);
    expect(rows.has_value(), what + ": its e4m3 rows are offered");
    if (!rows) return;
    const auto want = models::quantize_rows_fp8_kernel(y);
    const bool codes = at::equal(bits(rows->q), bits(want.first)), scales = at::equal(rows->scale, want.second);
    std::cout << "    " << what << " " << y.sizes() << ": codes " << (codes ? "equal" : "DIFFER") << ", scales "
              << (scales ? "equal" : "DIFFER") << "\n";
    expect(codes && scales, what + ": the rows equal the quantisation kernel's of its output");
  };

  // LayerNorms: affine (SDXL's widths, one to four warps a row), with the residual add, modulated
  // and gated-modulated (SD3's and Flux's).
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{2, 4096, 640}, {2, 1024, 1280}, {3, 77, 2048}, {1, 64, 4096}}) {
    const std::int64_t d = shape.back();
    const auto x = at::randn(shape, o) * 2 + 0.5, r = at::randn(shape, o);
    const auto w = at::randn({d}, o) * 0.3 + 1, b = at::randn({d}, o) * 0.1;
    models::drop_fp8_rows();
    const auto y = models::layer_norm(x, w, b, 1e-5);
    expect(at::equal(y, models::layer_norm(x.clone(), w, b, 1e-5)), "LayerNorm's output is the same with its rows written");
    same_rows(y, "LayerNorm");
    const auto [sum, n] = models::add_layer_norm(x, r, w, b, 1e-5);
    same_rows(n, "add + LayerNorm");
  }
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{2, 4096, 1536}, {2, 333, 1536}, {1, 4096, 3072}, {1, 512, 3072}}) {
    const std::int64_t bsz = shape[0], d = shape[2];
    const auto m = (at::randn({bsz, 6 * d}, o) * 0.5).chunk(6, 1);
    const auto x = at::randn(shape, o) * 2, y = at::randn(shape, o);
    models::drop_fp8_rows();
    const auto n = models::modulated_layer_norm(x, m[1], m[0], 1e-6);
    same_rows(n, "modulated LayerNorm");
    const auto [h, n2] = models::gated_residual_modulated_layer_norm(x, m[2], y, m[4], m[3], 1e-6);
    same_rows(n2, "gated residual + modulated LayerNorm");
  }

  // The MLPs' activations: equal to ATen's op, their rows to the kernel's of that output.
  for (const auto& [rows, cols] : std::vector<std::pair<std::int64_t, std::int64_t>>{{8192, 6144}, {4096, 12288}, {666, 6144}, {5, 64}}) {
    const auto y = at::randn({rows, cols}, o) * 3;
    models::drop_fp8_rows();
    const auto g = models::activation_with_fp8_rows(y, models::Fp8RowsActivation::GeluTanh);
    expect(g.defined() && at::equal(g, at::gelu(y, "tanh")), "GELU with rows equals at::gelu(y, \"tanh\") at " +
                                                               std::to_string(rows) + "x" + std::to_string(cols));
    if (g.defined()) same_rows(g, "GELU (tanh)");
    const auto h = models::activation_with_fp8_rows(y, models::Fp8RowsActivation::GegluHalves);
    expect(h.defined() && at::equal(h, models::geglu_halves(y)), "GEGLU with rows equals geglu_halves at " +
                                                                   std::to_string(rows) + "x" + std::to_string(cols));
    if (h.defined()) same_rows(h, "GEGLU");
  }
  // Flux's single blocks: proj_out's input [attention, GELU(mlp)] joined by one kernel with its
  // rows, the MLP's part read where it lies in the fused projection (q, k, v, then the MLP's).
  {
    const auto projected = at::randn({1, 4608, 21504}, o) * 2;
    const auto attn = at::randn({1, 4608, 3072}, o);
    const auto mlp = projected.narrow(2, 9216, 12288);
    auto joined = at::empty({1, 4608, 15360}, o);
    models::drop_fp8_rows();
    const bool written = models::join_gelu_with_fp8_rows(joined, attn, mlp);
    expect(written, "Flux's joined proj_out input is written by the kernel");
    if (written) {
      expect(at::equal(joined, at::cat({attn, at::gelu(mlp, "tanh")}, 2)),
             "the joined rows equal the attention's output, then at::gelu(mlp, \"tanh\")");
      same_rows(joined, "attention + GELU joined");
    }
    auto odd = at::empty({1, 64, 3076}, o);
    expect(!models::join_gelu_with_fp8_rows(odd, at::randn({1, 64, 4}, o), at::randn({1, 64, 3072}, o)),
           "no joined rows where the attention's part is no multiple of 8 wide");
  }
  expect(!models::activation_with_fp8_rows(at::randn({4, 64}, o.dtype(at::kHalf)), models::Fp8RowsActivation::GeluTanh).defined(),
         "no rows for a half-precision output (fp8 GEMMs take bf16)");
  expect(!models::activation_with_fp8_rows(at::randn({5, 48}, o), models::Fp8RowsActivation::GegluHalves).defined(),
         "no rows for an output whose width is no multiple of 16 (no fp8 GEMM reads it)");

  // Strided inputs quantised where they lie: SD3's image tokens of the joint sequence, a column
  // slice, and a layout no two strides describe (copied first).
  const auto joint = at::randn({2, 4429, 1536}, o);
  const auto strided_cases = std::vector<std::pair<std::string, at::Tensor>>{
      {"image tokens of a joint sequence", joint.slice(1, 0, 4096)},
      {"text tokens of a joint sequence", joint.slice(1, 4096)},
      {"a column slice", joint.select(0, 0).slice(1, 512, 1024)},
      {"a transposed view", at::randn({64, 3, 32}, o).transpose(0, 1)}};
  for (const auto& [what, x] : strided_cases) {
    const auto got = models::quantize_rows_fp8_kernel(x), want = models::quantize_rows_fp8_kernel(x.contiguous());
    expect(at::equal(bits(got.first), bits(want.first)) && at::equal(got.second, want.second),
           "the quantisation of " + what + " equals that of its contiguous copy");
  }

  // An fp8 layer takes offered rows: the same bits as quantising, and the count of taken rows moves.
  models::Linear layer(1536, 4608);
  layer->to(at::kCUDA, at::kBFloat16);
  models::init_random(*layer, 3);
  models::allow_fp8(*layer);
  const auto m = (at::randn({2, 6 * 1536}, o) * 0.5).chunk(6, 1);
  const auto x = at::randn({2, 4096, 1536}, o);
  models::drop_fp8_rows();
  const auto n = models::modulated_layer_norm(x, m[1], m[0], 1e-6);
  const auto before = models::fp8_rows_counts();
  const auto fused = layer->forward(n);
  const auto after = models::fp8_rows_counts();
  const auto separate = layer->forward(n.clone());
  expect(after.taken == before.taken + 1, "the fp8 layer took the offered rows");
  expect(at::equal(fused, separate), "an fp8 layer gives the same bits from offered rows as from its own quantisation");
  const auto joint_out = layer->forward(joint.slice(1, 0, 4096));
  expect(at::equal(joint_out, layer->forward(joint.slice(1, 0, 4096).contiguous())),
         "an fp8 layer gives the same bits from a strided input as from its contiguous copy");
  n.mul_(2);  // ATen's op: the version moves on, the offer is stale
  const auto stale = models::fp8_rows_counts();
  const auto changed = layer->forward(n);
  expect(models::fp8_rows_counts().taken == stale.taken && at::equal(changed, layer->forward(n.clone())),
         "an input changed since its offer is quantised anew");

  // Time: what writing the rows adds to each kernel, against the quantisation pass it replaces.
  {
    options::Overrides bf16{{"DIFFRACT_PRECISION", "bf16"}};
    const auto ms_plain = [&](const std::function<void()>& f) {
      options::JobOptionsScope plain(bf16);  // fp8_rows_wanted false: the kernel without rows
      return graph_ms_per_call(f);
    };
    const auto xs = at::randn({2, 4096, 1536}, o);
    const auto y = at::randn({8192, 6144}, o);
    const double norm_plain = ms_plain([&] { models::modulated_layer_norm(xs, m[1], m[0], 1e-6); });
    const double norm_rows = graph_ms_per_call([&] { models::modulated_layer_norm(xs, m[1], m[0], 1e-6); });
    const auto normed = models::modulated_layer_norm(xs, m[1], m[0], 1e-6);
    const double quant = graph_ms_per_call([&] { models::quantize_rows_fp8_kernel(normed); });
    const double gelu_plain = graph_ms_per_call([&] { at::gelu(y, "tanh"); });
    const double gelu_rows = graph_ms_per_call([&] { models::activation_with_fp8_rows(y, models::Fp8RowsActivation::GeluTanh); });
    const auto act = at::gelu(y, "tanh");
    const double quant_wide = graph_ms_per_call([&] { models::quantize_rows_fp8_kernel(act); });
    const auto projected = at::randn({1, 4608, 21504}, o), attn = at::randn({1, 4608, 3072}, o);
    const auto mlp = projected.narrow(2, 9216, 12288);
    auto joined = at::empty({1, 4608, 15360}, o);
    const double joined_apart = ms_plain([&] {
      auto activated = joined.narrow(2, 3072, 12288);
      models::gelu_tanh_out(activated, mlp);
      joined.narrow(2, 0, 3072).copy_(attn);
      models::quantize_rows_fp8_kernel(joined);
    });
    const double joined_rows = graph_ms_per_call([&] { models::join_gelu_with_fp8_rows(joined, attn, mlp); });
    const double joint_copy = graph_ms_per_call([&] { models::quantize_rows_fp8_kernel(joint.slice(1, 0, 4096).contiguous()); });
    const double joint_strided = graph_ms_per_call([&] { models::quantize_rows_fp8_kernel(joint.slice(1, 0, 4096)); });
    std::cout << "  ms per call: modulated LayerNorm [2, 4096, 1536] " << norm_plain << ", with rows " << norm_rows
              << ", the quantisation pass it saves " << quant << "\n"
              << "  ms per call: GELU [8192, 6144] " << gelu_plain << ", with rows " << gelu_rows
              << ", the quantisation pass it saves " << quant_wide << "\n"
              << "  ms per call: SD3's image tokens quantised after a copy " << joint_copy << ", where they lie "
              << joint_strided << "\n"
              << "  ms per call: Flux's proj_out input [1, 4608, 15360]: GELU, copy and pass " << joined_apart
              << ", joined by one kernel with rows " << joined_rows << "\n";
    expect(norm_rows < norm_plain + quant, "the LayerNorm with rows costs less than the LayerNorm and the pass");
    expect(gelu_rows < gelu_plain + quant_wide, "the GELU with rows costs less than the GELU and the pass");
    expect(joint_strided < joint_copy, "strided rows quantise faster than a copy and the pass");
    expect(joined_rows < joined_apart, "Flux's joined input with rows costs less than the GELU, the copy and the pass");
  }
  models::drop_fp8_rows();
}

int main(int argc, char** argv) {
  g_program = argv[0];
  const std::map<std::string, std::function<void()>> checks = {
      {"groupnorm", check_groupnorm}, {"geglu", check_geglu}, {"layernorm", check_layernorm}, {"conv_bias", check_conv_bias}, {"upload", check_upload}, {"clip_graph", check_clip_graph}, {"graphs", check_graphs}, {"graph_warmups", check_graph_warmups}, {"oom_parallel", check_oom_parallel}, {"cancel_any", check_cancel_any}, {"stage_graphs", check_stage_graphs},
      {"previews", check_previews}, {"taesd", check_taesd}, {"nccl", check_nccl},
      {"strategies", check_strategies}, {"wide", check_wide}, {"qkv", check_qkv}, {"cancel", check_cancel}, {"failure", check_failure}, {"sd3", check_sd3},
      {"cfg_pipefusion", check_cfg_pipefusion}, {"oom", check_oom}, {"parallel_vae", check_parallel_vae}, {"vae_bands", check_vae_bands}, {"gemm", check_gemm}, {"flux", check_flux}, {"flux_files", check_flux_files},
      {"caches", check_caches_and_flux_pipefusion}, {"fp8", check_fp8}, {"fp8_rows", check_fp8_rows},
      {"tuning", check_tuning}, {"tuning_reload", check_tuning_reload}, {"prepare", check_prepare}, {"gemm_gelu", check_gemm_gelu}, {"modulation", check_modulation}};
  bool usage = argc < 2;
  for (int i = 1; i < argc; ++i) usage = usage || !checks.count(argv[i]);
  if (usage) {
    std::cerr << "usage: diffract-gpu-checks CHECK [CHECK...], each of groupnorm|geglu|layernorm|conv_bias|upload|clip_graph|graphs|stage_graphs|previews|taesd|nccl|strategies|cancel|failure|sd3|cfg_pipefusion|parallel_vae|vae_bands|gemm\n";
    return 2;
  }
  std::cout << std::unitbuf;
  int skipped = 0;
  for (int i = 1; i < argc; ++i) {
    try {
      std::cout << argv[i] << "\n";
      checks.at(argv[i])();
    } catch (const Skip& s) {
      std::cout << "  skipped: " << s.why << "\n";
      ++skipped;
    } catch (const std::exception& e) {
      std::cout << "  FAIL  " << e.what() << "\n";
      ++failures;
    }
  }
  if (failures != 0) return 1;
  return skipped == argc - 1 ? 77 : 0;
}
