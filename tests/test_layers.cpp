// Linear / Conv2d / Embedding allocate without random init; init_random() draws what
// LibTorch's torch::nn layers drew; loaded models still bind every weight. The transformer
// block's fused adds and the fused projections compute what the separate ops did.
#include <algorithm>
#include <functional>
#include <map>

#include <torch/nn.h>

#include "core/io/key_maps.h"
#include "core/io/weights.h"
#include "core/models/autoencoders/autoencoder_kl.h"
#include "core/models/autoencoders/taesd.h"
#include "core/models/common/attention.h"
#include "core/models/common/geglu.h"
#include "core/models/common/layer_norm.h"
#include "core/models/common/layers.h"
#include "core/models/common/patch_parallel.h"
#include "core/models/common/strided_rows.h"
#include "core/models/common/resnet.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/models/transformers/sd3_transformer_2d.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/training/trainer.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace nn = torch::nn;

namespace {

// The same small tree twice: LibTorch's layers, and ours. `out` is built first and registered
// last, as FeedForward does with net.2.
struct TorchTreeImpl : nn::Module {
  TorchTreeImpl() {
    const auto last = nn::Linear(16, 3);
    embed = register_module("embed", nn::Embedding(50, 6));
    conv = register_module("conv", nn::Conv2d(nn::Conv2dOptions(3, 8, 3).padding(1)));
    norm = register_module("norm", nn::GroupNorm(4, 8));
    inner = register_module("inner", nn::ModuleList(nn::Linear(6, 5), nn::Linear(nn::LinearOptions(5, 7).bias(false))));
    patch = register_module("patch", nn::Conv2d(nn::Conv2dOptions(8, 4, 2).stride(2).bias(false)));
    out = register_module("out", last);
  }
  nn::Embedding embed{nullptr};
  nn::Conv2d conv{nullptr}, patch{nullptr};
  nn::GroupNorm norm{nullptr};
  nn::ModuleList inner{nullptr};
  nn::Linear out{nullptr};
};
TORCH_MODULE(TorchTree);

struct OurTreeImpl : nn::Module {
  OurTreeImpl() {
    const auto last = models::Linear(16, 3);
    embed = register_module("embed", models::Embedding(50, 6));
    conv = register_module("conv", models::Conv2d(models::Conv2dOptions(3, 8, 3).padding(1)));
    norm = register_module("norm", nn::GroupNorm(4, 8));
    inner = register_module(
        "inner", nn::ModuleList(models::Linear(6, 5), models::Linear(models::LinearOptions(5, 7).bias(false))));
    patch = register_module("patch", models::Conv2d(models::Conv2dOptions(8, 4, 2).stride(2).bias(false)));
    out = register_module("out", last);
  }
  models::Embedding embed{nullptr};
  models::Conv2d conv{nullptr}, patch{nullptr};
  nn::GroupNorm norm{nullptr};
  nn::ModuleList inner{nullptr};
  models::Linear out{nullptr};
};
TORCH_MODULE(OurTree);

// Same names, shapes and (bit for bit) values.
void expect_same_parameters(nn::Module& got, nn::Module& want) {
  const auto g = got.named_parameters(), w = want.named_parameters();
  QCOMPARE(g.size(), w.size());
  for (const auto& kv : w) {
    QVERIFY2(g.contains(kv.key()), kv.key().c_str());
    QVERIFY2(at::equal(g[kv.key()], kv.value()), kv.key().c_str());
  }
}

// True when building `make()` left the global generator where it was.
template <class Make>
bool draws_nothing(Make make) {
  at::manual_seed(11);
  auto m = make();
  const auto after = at::rand({16});
  at::manual_seed(11);
  return at::equal(after, at::rand({16})) && !m->parameters().empty();
}

// FNV-1a over each parameter's bytes, then over those hashes: a bit-exact fingerprint.
uint64_t fnv(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

uint64_t fingerprint(nn::Module& m) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& kv : m.named_parameters()) {
    const auto t = kv.value().contiguous();
    const uint64_t one = fnv(t.data_ptr(), t.nbytes());
    h = fnv(&one, sizeof one, h);
  }
  return h;
}

models::UNet2DConditionConfig tiny_unet() {
  return models::UNet2DConditionConfig::from_json(test::fixtures() / "tiny-sdxl" / "unet" / "config.json");
}

// `fuse` on the tiny SD UNet: it reports `members` (the modules `is_member` counts below the
// UNet), every parameter keeps its value, and the UNet still gives diffusers' output.
void checkFusedTinyUNet(const std::function<int(models::UNet2DConditionModel&)>& fuse,
                        const std::function<bool(torch::nn::Module&)>& is_member) {
  auto unet = models::load_unet_2d_condition(test::fixtures() / "tiny-sd" / "unet");
  std::map<std::string, at::Tensor> before;
  for (const auto& kv : unet->named_parameters()) before[kv.key()] = kv.value().clone();
  int members = 0;
  for (const auto& m : unet->modules()) members += is_member(*m) ? 1 : 0;
  QVERIFY(members > 0);
  QCOMPARE(fuse(unet), members);
  for (const auto& kv : unet->named_parameters()) QVERIFY2(at::equal(kv.value(), before.at(kv.key())), kv.key().c_str());
  const auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
  models::UNetConditioning cond;
  cond.encoder_hidden_states = e.at("sd.16x16.context");
  DIFFRACT_COMPARE_TENSORS(unet->forward(e.at("sd.16x16.x"), e.at("sd.16x16.t"), cond), e.at("sd.16x16.out"), 1e-4);
}

}  // namespace

class TestLayers : public QObject {
  Q_OBJECT
 private slots:
  void constructorsDrawNoRandomNumbers() {
    QVERIFY(draws_nothing([] { return models::Linear(64, 32); }));
    QVERIFY(draws_nothing([] { return models::Conv2d(models::Conv2dOptions(4, 8, 3).padding(1)); }));
    QVERIFY(draws_nothing([] { return models::Embedding(100, 8); }));
    QVERIFY(draws_nothing([] { return models::GroupNorm(models::GroupNormOptions(4, 8)); }));
    QVERIFY(draws_nothing([] { return OurTree(); }));
    QVERIFY(!draws_nothing([] { return TorchTree(); }));  // the check does see LibTorch's init
    QVERIFY(draws_nothing([] { return models::UNet2DConditionModel(tiny_unet()); }));
    QVERIFY(draws_nothing([] {
      auto c = models::AutoencoderKLConfig::sd();
      c.block_out_channels = {16, 32}, c.norm_num_groups = 8;
      return models::AutoencoderKL(c);
    }));
    QVERIFY(draws_nothing([] {
      auto c = models::CLIPTextConfig::clip_l();
      c.hidden_size = 32, c.intermediate_size = 64, c.num_hidden_layers = 2, c.num_attention_heads = 2;
      return models::CLIPTextModelWithProjection(c);
    }));
    QVERIFY(draws_nothing([] {
      auto c = models::TAESDConfig::taesd();
      c.encoder_block_out_channels = c.decoder_block_out_channels = {8, 8, 8, 8};
      return models::TAESD(c, true, true);
    }));
    QVERIFY(draws_nothing([] {
      auto c = models::SD3Transformer2DConfig::sd35_medium();
      c.num_layers = 2, c.attention_head_dim = 8, c.num_attention_heads = 2, c.joint_attention_dim = 32;
      c.caption_projection_dim = 16, c.pooled_projection_dim = 32, c.pos_embed_max_size = 16, c.sample_size = 16;
      c.dual_attention_layers = {0};
      return models::SD3Transformer2DModel(c);
    }));
  }

  // Same seed, same values as torch::nn's constructors: layer by layer and over a tree, from a
  // seed, from the global generator, and into bf16 parameters (drawn in fp32, then cast).
  void initRandomMatchesLibTorch() {
    for (uint64_t seed : {0ull, 42ull}) {
      at::manual_seed(seed);
      nn::Linear ref_linear(nn::LinearOptions(37, 19));
      models::Linear linear(37, 19);
      models::init_random(*linear, seed);
      expect_same_parameters(*linear, *ref_linear);

      at::manual_seed(seed);
      nn::Conv2d ref_conv(nn::Conv2dOptions(5, 6, 3).padding(1));
      models::Conv2d conv(models::Conv2dOptions(5, 6, 3).padding(1));
      models::init_random(*conv, seed);
      expect_same_parameters(*conv, *ref_conv);

      at::manual_seed(seed);
      nn::Embedding ref_embed(300, 7);
      models::Embedding embed(300, 7);
      models::init_random(*embed, seed);
      expect_same_parameters(*embed, *ref_embed);

      at::manual_seed(seed);
      TorchTree ref;
      OurTree ours;
      models::init_random(*ours, seed);
      expect_same_parameters(*ours, *ref);

      OurTree global;
      at::manual_seed(seed);
      models::init_random(*global);
      expect_same_parameters(*global, *ref);

      OurTree half;
      half->to(at::kBFloat16);
      models::init_random(*half, seed);
      QCOMPARE(half->out->weight.scalar_type(), at::kBFloat16);
      ref->to(at::kBFloat16);
      expect_same_parameters(*half, *ref);
    }
  }

  // UNets (uniform draws only, so bit-exact on any CPU) hold what LibTorch's layers gave them
  // before this change: fingerprints taken then, of the trainer's emoji UNet of that time (the
  // first edition's (64, 128, 192), cross-attention 96 wide; seed 7) and of
  // StableDiffusion::random's tiny SDXL UNet (seed 0; before its halving).
  void initRandomReproducesEarlierModels() {
    at::manual_seed(7);
    auto first_edition = training::ModelConfig::preset("emoji").unet;
    first_edition.block_out_channels = {64, 128, 192};
    first_edition.cross_attention_dim.assign(3, 96);
    models::UNet2DConditionModel emoji(first_edition);
    models::init_random(*emoji);
    QCOMPARE(fingerprint(*emoji), uint64_t(0x2468a1b0a880c1c2ull));

    auto c = models::UNet2DConditionConfig::sdxl_base();
    c.block_out_channels = {32, 64, 64};
    c.down_block_types = {"DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"};
    c.up_block_types = {"CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"};
    c.layers_per_block = {1, 1, 1};
    c.num_attention_heads = {2, 2, 2};
    c.transformer_layers_per_block = c.reverse_transformer_layers_per_block = {1, 1, 1};
    c.norm_num_groups = 16;
    c.cross_attention_dim = {64, 64, 64};
    c.projection_class_embeddings_input_dim = 32 + 6 * c.addition_time_embed_dim;
    models::UNet2DConditionModel xl(c);
    models::init_random(*xl, 0);
    QCOMPARE(fingerprint(*xl), uint64_t(0x7850ab202625458eull));
  }

  // Equal seeds give equal models, a different seed another one; nothing stays uninitialised.
  void initRandomFillsWholeModels() {
    models::UNet2DConditionModel a(tiny_unet()), b(tiny_unet()), c(tiny_unet());
    models::init_random(*a, 3);
    models::init_random(*b, 3);
    models::init_random(*c, 4);
    expect_same_parameters(*a, *b);
    QVERIFY(!at::equal(a->conv_in->weight, c->conv_in->weight));
    for (const auto& p : a->parameters()) QVERIFY(at::isfinite(p).all().item<bool>());
  }

  // A diffusers folder binds every parameter: the model holds the file's tensors and matches
  // diffusers' output.
  void loadedModelsHoldTheirWeights() {
    const auto dir = test::fixtures() / "tiny-sd";
    auto unet = models::load_unet_2d_condition(dir / "unet");
    auto sd = io::load_state_dict(dir / "unet" / "diffusion_pytorch_model.safetensors");
    QCOMPARE(unet->named_parameters().size(), sd.size());
    for (const auto& kv : unet->named_parameters())
      QVERIFY2(at::equal(kv.value(), sd.at(kv.key()).to(at::kFloat)), kv.key().c_str());
    auto te = models::load_clip_text_model(dir / "text_encoder");
    auto te_sd = io::map_clip_text_keys(io::load_state_dict(dir / "text_encoder" / "model.safetensors"));
    for (const auto& kv : te->named_parameters())
      QVERIFY2(at::equal(kv.value(), te_sd.at(kv.key()).to(at::kFloat)), kv.key().c_str());

    at::NoGradGuard no_grad;
    const auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    models::UNetConditioning cond;
    cond.encoder_hidden_states = e.at("sd.16x16.context");
    const auto out = unet->forward(e.at("sd.16x16.x"), e.at("sd.16x16.t"), cond);
    DIFFRACT_COMPARE_TENSORS(out, e.at("sd.16x16.out"), 1e-4);
  }

  // Fused QKV projections (DIFFRACT_FUSED_QKV=1): every self-attention fuses, no cross-attention
  // does; the parameters keep their names and values (now views of the fused rows); the UNet's
  // output still matches diffusers'; autograd still reaches each projection's weight; a move to
  // another dtype stands the fused path down and the output stays diffusers'.
  void fusedQkvIsTheSameAttention() {
    const auto dir = test::fixtures() / "tiny-sd";
    auto unet = models::load_unet_2d_condition(dir / "unet");
    std::map<std::string, at::Tensor> before;
    for (const auto& kv : unet->named_parameters()) before[kv.key()] = kv.value().clone();
    int self = 0, cross = 0;
    for (const auto& m : unet->modules())
      if (auto* a = dynamic_cast<models::AttentionImpl*>(m.get())) ++(a->options.cross_attention_dim > 0 ? cross : self);
    QVERIFY(self > 0 && cross > 0);
    QCOMPARE(models::fuse_attention_qkv(*unet), self);
    QCOMPARE(unet->named_parameters().size(), before.size());
    for (const auto& kv : unet->named_parameters()) QVERIFY2(at::equal(kv.value(), before.at(kv.key())), kv.key().c_str());
    int fused = 0;
    for (const auto& m : unet->modules())
      if (auto* a = dynamic_cast<models::AttentionImpl*>(m.get())) fused += a->qkv_fused() ? 1 : 0;
    QCOMPARE(fused, self);

    const auto e = io::load_state_dict(test::fixtures() / "unet_cases.safetensors");
    models::UNetConditioning cond;
    cond.encoder_hidden_states = e.at("sd.16x16.context");
    {
      at::NoGradGuard no_grad;
      DIFFRACT_COMPARE_TENSORS(unet->forward(e.at("sd.16x16.x"), e.at("sd.16x16.t"), cond), e.at("sd.16x16.out"), 1e-4);
    }
    // Training records the three projections as before: each weight gets its gradient.
    models::AttentionImpl* block = nullptr;
    for (const auto& kv : unet->named_modules())
      if (!block && kv.key().size() > 5 && kv.key().substr(kv.key().size() - 5) == "attn1")
        block = dynamic_cast<models::AttentionImpl*>(kv.value().get());
    QVERIFY(block && block->qkv_fused());
    const auto x = at::randn({1, 5, block->options.query_dim});
    block->forward(x).sum().backward();
    QVERIFY(block->to_q->weight.grad().defined() && block->to_k->weight.grad().defined() &&
            block->to_v->weight.grad().defined());
    QVERIFY(block->to_k->weight.grad().abs().sum().item<double>() > 0);

    unet->to(at::kDouble);
    QVERIFY(!block->qkv_fused());
    at::NoGradGuard no_grad;
    cond.encoder_hidden_states = cond.encoder_hidden_states.to(at::kDouble);
    const auto out = unet->forward(e.at("sd.16x16.x").to(at::kDouble), e.at("sd.16x16.t"), cond);
    DIFFRACT_COMPARE_TENSORS(out.to(at::kFloat), e.at("sd.16x16.out"), 1e-4);
  }

  // Every cross-attention's keys and values from one GEMM (CrossKV): the attentions handed the
  // scope's context get its slices, equal to their own projections; another context tensor, no
  // scope, autograd recording or a move to another dtype leave them to their own GEMMs. Then
  // the tiny SD UNet with it still gives diffusers' output, its parameters unchanged.
  void fusedCrossKvIsTheSameProjection() {
    at::manual_seed(3);
    torch::nn::Module root;
    const auto cross = [](int64_t dim, int64_t heads, int64_t context_width = 12) {
      models::AttentionOptions o;
      o.query_dim = dim, o.cross_attention_dim = context_width, o.heads = heads, o.dim_head = 4;
      return models::Attention(o);
    };
    auto a = root.register_module("a", cross(8, 2)), b = root.register_module("b", cross(16, 3));
    // Another context width than the first member's: left out of the group, its own GEMMs.
    auto other = root.register_module("other", cross(8, 2, 6));
    models::AttentionOptions self;
    self.query_dim = 8, self.heads = 2, self.dim_head = 4;
    auto c = root.register_module("c", models::Attention(self));
    {
      at::NoGradGuard no_grad;  // the constructors leave the weights uninitialised
      for (auto& p : root.parameters()) p.copy_(at::randn_like(p));
    }
    const auto k_before = b->to_k->weight.clone(), v_before = b->to_v->weight.clone();
    const auto group = models::CrossKV::fuse(root);
    QVERIFY(group && group->size() == 2 && group->intact());  // a and b, not other
    QVERIFY(at::equal(b->to_k->weight, k_before) && at::equal(b->to_v->weight, v_before));
    QVERIFY(!models::CrossKV::fuse(*c));  // no cross-attention: nothing to fuse

    const auto context = at::randn({2, 5, 12});
    at::NoGradGuard no_grad;
    QVERIFY(!models::CrossKVScope::lookup(a.get(), context).first.defined());
    {
      const models::CrossKVScope scope(group.get(), context);
      for (auto* m : {a.get(), b.get()}) {
        const auto [k, v] = models::CrossKVScope::lookup(m, context);
        QVERIFY(k.defined() && v.defined());
        DIFFRACT_COMPARE_TENSORS(k, m->to_k->forward(context), 1e-6);
        DIFFRACT_COMPARE_TENSORS(v, m->to_v->forward(context), 1e-6);
      }
      QVERIFY(!models::CrossKVScope::lookup(c.get(), context).first.defined());
      QVERIFY(!models::CrossKVScope::lookup(other.get(), context).first.defined());
      QVERIFY(!models::CrossKVScope::lookup(a.get(), context.clone()).first.defined());
      {
        const models::CrossKVScope inner(nullptr, context);  // a forward without a group hides the outer one
        QVERIFY(!models::CrossKVScope::lookup(a.get(), context).first.defined());
      }
      QVERIFY(models::CrossKVScope::lookup(a.get(), context).first.defined());
      const auto x = at::randn({2, 7, 16});
      DIFFRACT_COMPARE_TENSORS(b->forward(x, context), b->forward(x, context.clone()), 1e-4);
    }
    QVERIFY(!models::CrossKVScope::lookup(a.get(), context).first.defined());
    {
      at::AutoGradMode grad(true);
      const models::CrossKVScope scope(group.get(), context);
      QVERIFY(!models::CrossKVScope::lookup(a.get(), context).first.defined());
    }
    root.to(at::kDouble);
    QVERIFY(!group->intact());
    {
      const models::CrossKVScope scope(group.get(), context.to(at::kDouble));
      QVERIFY(!models::CrossKVScope::lookup(a.get(), context).first.defined());
    }

    checkFusedTinyUNet([](models::UNet2DConditionModel& u) { return u->fuse_cross_attention_kv(); },
                       [](torch::nn::Module& m) {
                         const auto* att = dynamic_cast<models::AttentionImpl*>(&m);
                         return att && att->options.cross_attention_dim > 0;
                       });
  }

  // GroupNorm as torch::nn::GroupNorm (ones / zeros, same parameter names, same output), and
  // forward(x, add, silu) as the separate ops it stands for, in both memory formats. (Its CUDA
  // kernels are checked against the same ops by diffract-gpu-checks groupnorm.)
  void groupNormIsTorchsGroupNorm() {
    models::GroupNorm ours(models::GroupNormOptions(4, 12).eps(1e-6));
    torch::nn::GroupNorm theirs(torch::nn::GroupNormOptions(4, 12).eps(1e-6));
    QCOMPARE(ours->named_parameters().keys(), theirs->named_parameters().keys());
    QVERIFY(at::equal(ours->weight, theirs->weight) && at::equal(ours->bias, theirs->bias));
    at::manual_seed(5);
    at::NoGradGuard no_grad;
    for (auto* p : {&ours->weight, &ours->bias}) p->copy_(at::randn({12}));
    theirs->weight.copy_(ours->weight);
    theirs->bias.copy_(ours->bias);
    const auto x = at::randn({2, 12, 5, 3}) * 3 + 1, add = at::randn({2, 12});
    QVERIFY(at::equal(ours->forward(x), theirs->forward(x)));
    const auto want = at::silu(theirs->forward(x + add.view({2, 12, 1, 1})));
    DIFFRACT_COMPARE_TENSORS(ours->forward(x, add, true), want, 1e-6);
    const auto y = ours->forward(x.contiguous(at::MemoryFormat::ChannelsLast), add, true);
    DIFFRACT_COMPARE_TENSORS(y, want, 1e-6);
    const auto x3 = at::randn({2, 12, 7});  // [N, C, L]
    DIFFRACT_COMPARE_TENSORS(ours->forward(x3, add, false), theirs->forward(x3 + add.view({2, 12, 1})), 1e-6);
    // channel_add [C] (a convolution's bias) on top of add; add as rows of a wider tensor, or one
    // row for every sample.
    const auto bias = at::randn({12}), wide = at::randn({2, 20});
    const auto with_bias = at::silu(theirs->forward(x + add.view({2, 12, 1, 1}) + bias.view({1, 12, 1, 1})));
    DIFFRACT_COMPARE_TENSORS(ours->forward(x, add, true, bias), with_bias, 1e-6);
    DIFFRACT_COMPARE_TENSORS(ours->forward(x, {}, false, bias), theirs->forward(x + bias.view({1, 12, 1, 1})), 1e-6);
    const auto slice = wide.narrow(1, 5, 12);
    QVERIFY(!slice.is_contiguous());
    DIFFRACT_COMPARE_TENSORS(ours->forward(x, slice, false), theirs->forward(x + slice.reshape({2, 12, 1, 1})), 1e-6);
    const auto row = add.narrow(0, 1, 1);
    DIFFRACT_COMPARE_TENSORS(ours->forward(x, row, false), theirs->forward(x + row.view({1, 12, 1, 1})), 1e-6);
    DIFFRACT_EXPECT_ERROR(ours->forward(x, at::randn({3, 12})), "GroupNorm: add of shape [3, 12]");
    DIFFRACT_EXPECT_ERROR(ours->forward(x, at::randn({2, 11})), "GroupNorm: add of shape [2, 11]");
    DIFFRACT_EXPECT_ERROR(ours->forward(x, {}, false, at::randn({11})), "GroupNorm: channel_add of shape [11]");
    QVERIFY_THROWS_EXCEPTION(std::exception, models::GroupNorm(models::GroupNormOptions(5, 12)));
  }

  // GroupNorm from moments (a band decode's pieces): the moments of some rows are var_mean of
  // those rows (add included); bands' moments combined with their element counts are the whole
  // image's statistics however the rows split; normalising with them is forward(x, add, silu).
  void groupNormFromMoments() {
    models::GroupNorm norm(models::GroupNormOptions(3, 12).eps(1e-6));
    at::manual_seed(8);
    at::NoGradGuard no_grad;
    norm->weight.copy_(at::randn({12}));
    norm->bias.copy_(at::randn({12}));
    const auto x = at::randn({2, 12, 9, 4}) * 2 + 3, add = at::randn({1, 12});
    const auto in = x + add.view({1, 12, 1, 1});
    const auto m = models::group_moments(x, add, 3, 2, 7);
    QVERIFY(m.sizes() == (std::vector<int64_t>{2, 3, 2}));
    const auto [var, mean] = at::var_mean(in.narrow(2, 2, 5).reshape({2, 3, -1}), {2}, 0, false);
    DIFFRACT_COMPARE_TENSORS(m.select(-1, 0), mean, 1e-6);
    DIFFRACT_COMPARE_TENSORS(m.select(-1, 1), var, 1e-5);
    // Three bands of 2, 4 and 3 rows.
    std::vector<at::Tensor> parts;
    std::vector<double> counts;
    int64_t row = 0;
    for (int64_t rows : {2, 4, 3}) {
      parts.push_back(models::group_moments(x, add, 3, row, row + rows));
      counts.push_back(static_cast<double>(rows * 4 * 4));  // rows x width x channels per group
      row += rows;
    }
    const auto stats = models::combine_group_moments(at::stack(parts), counts, 1e-6);
    const auto [all_var, all_mean] = at::var_mean(in.reshape({2, 3, -1}), {2}, 0, false);
    DIFFRACT_COMPARE_TENSORS(stats.select(-1, 0), all_mean, 1e-6);
    DIFFRACT_COMPARE_TENSORS(stats.select(-1, 1), at::rsqrt(all_var + 1e-6), 1e-5);
    DIFFRACT_COMPARE_TENSORS(models::group_norm_with_stats(*norm, x, add, stats, true), norm->forward(x, add, true), 1e-5);
    // Equal counts would weigh the 2-row band like the 4-row one: not the whole's mean.
    const auto equal = models::combine_group_moments(at::stack(parts), {1, 1, 1}, 1e-6);
    QVERIFY((equal.select(-1, 0) - all_mean).abs().max().item<double>() > 1e-3);
    DIFFRACT_EXPECT_ERROR(models::group_moments(x, add, 3, 5, 5), "GroupNorm moments: rows [5, 5)");
    DIFFRACT_EXPECT_ERROR(models::group_moments(x, add, 3, 0, 10), "rows [0, 10) of input [2, 12, 9, 4]");
    DIFFRACT_EXPECT_ERROR(models::combine_group_moments(at::stack(parts), {1, 1}, 1e-6), "for 2 parts");
  }

  // Every ResNet block's time-embedding projection from one GEMM (TimeProjections): the blocks
  // handed the scope's time embedding get its slices, equal to their own silu + projection;
  // another tensor, no scope, autograd recording or a move to another dtype leave them to their
  // own GEMMs. Then the tiny SD UNet with it still gives diffusers' output, parameters unchanged.
  void fusedTimeProjectionsAreTheSameProjection() {
    torch::nn::Module root;
    const auto block = [](int64_t in, int64_t out, int64_t temb) {
      models::ResnetBlock2DOptions o;
      o.in_channels = in, o.out_channels = out, o.temb_channels = temb, o.groups = 4;
      return models::ResnetBlock2D(o);
    };
    auto a = root.register_module("a", block(8, 8, 12)), b = root.register_module("b", block(8, 16, 12));
    auto other = root.register_module("other", block(8, 8, 6));  // another width: its own GEMM
    auto vae = root.register_module("vae", block(8, 8, 0));      // no time embedding
    for (auto* m : {a.get(), b.get(), other.get(), vae.get()}) models::init_random(*m, 21);
    const auto w_before = b->time_emb_proj->weight.clone();
    const auto group = models::TimeProjections::fuse(root);
    QVERIFY(group && group->size() == 2 && group->intact());
    QVERIFY(at::equal(b->time_emb_proj->weight, w_before));
    QVERIFY(!models::TimeProjections::fuse(*vae));

    at::manual_seed(6);
    const auto temb = at::randn({2, 12});
    at::NoGradGuard no_grad;
    QVERIFY(!models::TimeProjectionScope::lookup(a.get(), temb).defined());
    const auto x = at::randn({2, 8, 4, 4});
    const auto b_alone = b->forward(x, temb);
    {
      const models::TimeProjectionScope scope(group.get(), temb);
      for (auto* m : {a.get(), b.get()}) {
        const auto t = models::TimeProjectionScope::lookup(m, temb);
        QVERIFY(t.defined());
        DIFFRACT_COMPARE_TENSORS(t, m->time_emb_proj->forward(at::silu(temb)), 1e-6);
      }
      QVERIFY(!models::TimeProjectionScope::lookup(other.get(), temb).defined());
      QVERIFY(!models::TimeProjectionScope::lookup(a.get(), temb.clone()).defined());
      {
        const models::TimeProjectionScope inner(nullptr, temb);
        QVERIFY(!models::TimeProjectionScope::lookup(a.get(), temb).defined());
      }
      DIFFRACT_COMPARE_TENSORS(b->forward(x, temb), b_alone, 1e-5);
    }
    {
      at::AutoGradMode grad(true);
      const models::TimeProjectionScope scope(group.get(), temb);
      QVERIFY(!models::TimeProjectionScope::lookup(a.get(), temb).defined());
    }
    root.to(at::kDouble);
    QVERIFY(!group->intact());
    {
      const models::TimeProjectionScope scope(group.get(), temb.to(at::kDouble));
      QVERIFY(!models::TimeProjectionScope::lookup(a.get(), temb).defined());
    }

    checkFusedTinyUNet([](models::UNet2DConditionModel& u) { return u->fuse_time_projections(); },
                       [](torch::nn::Module& m) {
                         const auto* r = dynamic_cast<models::ResnetBlock2DImpl*>(&m);
                         return r && r->time_emb_proj;
                       });
  }

  // BasicTransformerBlock adds its skip connections inside the next LayerNorm (add_layer_norm)
  // and leaves its feed-forward branch to the next block: the same result as the three separate
  // adds, one block or two chained, and the same parameter names.
  void transformerBlockAddsResidualsInItsNorms() {
    at::NoGradGuard no_grad;
    models::BasicTransformerBlock block(32, 2, 16, 24), next(32, 2, 16, 24);
    models::init_random(*block, 9);
    models::init_random(*next, 10);
    at::manual_seed(4);
    for (auto* b : {&block, &next})
      for (auto& p : (*b)->named_parameters())
        if (p.key().find("norm") != std::string::npos) p.value().normal_();
    QVERIFY(block->named_parameters().contains("attn1.to_out.0.bias"));
    QVERIFY(block->named_parameters().contains("ff.net.2.weight"));
    const auto x = at::randn({2, 10, 32}), ctx = at::randn({2, 7, 24});
    const auto separate = [&](models::BasicTransformerBlock& b, const at::Tensor& in) {
      auto h = in + b->attn1->forward(b->norm1->forward(in));
      h = h + b->attn2->forward(b->norm2->forward(h), ctx);
      return h + b->ff->forward(b->norm3->forward(h));
    };
    const auto want = separate(block, x);
    QVERIFY(at::equal(block->forward(x, ctx), want));
    const auto [h, pending] = block->forward_deferred(x, {}, ctx);
    QVERIFY(at::equal(h + pending, want));
    const auto [h2, pending2] = next->forward_deferred(h, pending, ctx);
    QVERIFY(at::equal(h2 + pending2, separate(next, want)));
  }

  // Conv2d's forward_add is the convolution plus the residual, forward_without_bias the
  // convolution alone (bit for bit on the CPU: ATen's ops; the CUDA bias kernel is checked by
  // diffract-gpu-checks conv_bias); under a patch-parallel context, whose convolutions add the
  // bias themselves, forward_without_bias refuses.
  void conv2dAddsResidualAndBias() {
    at::manual_seed(7);
    models::Conv2d conv(models::Conv2dOptions(4, 6, 3).padding(1));
    models::init_random(*conv, 2);
    const auto x = at::randn({2, 4, 5, 5}), r = at::randn({2, 6, 5, 5});
    const auto plain = at::conv2d(x, conv->weight, conv->bias, {1, 1}, {1, 1});
    QVERIFY(at::equal(conv->forward(x), plain));
    QVERIFY(at::equal(conv->forward_add(x, r), r + plain));
    const auto rb = at::randn({6});  // a 1x1 shortcut's bias, left to this add
    QVERIFY(at::equal(conv->forward_add(x, r, rb), r + rb.view({1, 6, 1, 1}) + plain));
    DIFFRACT_EXPECT_ERROR(conv->forward_add(x, {}, rb), "forward_add", "residual_bias");
    DIFFRACT_EXPECT_ERROR(conv->forward_add(x, r, at::randn({5})), "forward_add", "residual_bias");
    QVERIFY(at::equal(conv->forward_without_bias(x), at::conv2d(x, conv->weight, {}, {1, 1}, {1, 1})));
    struct Bands : models::PatchContext {
      at::Tensor conv2d(models::Conv2dImpl&, const at::Tensor& in) override { return in; }
      at::Tensor group_norm(models::GroupNormImpl&, const at::Tensor& in, const at::Tensor&, bool) override { return in; }
      std::pair<at::Tensor, at::Tensor> self_attention_kv(const at::Tensor& k, const at::Tensor& v) override {
        return {k, v};
      }
    } bands;
    const models::PatchScope scope(&bands);
    DIFFRACT_EXPECT_ERROR(conv->forward_without_bias(x), "forward_without_bias", "patch-parallel context");
  }

  // add_layer_norm and geglu_halves on the CPU: the separate ops, bit for bit (their CUDA
  // kernels are checked by diffract-gpu-checks layernorm and geglu).
  void addLayerNormAndGegluHalvesAreTheirOps() {
    at::manual_seed(6);
    const auto x = at::randn({2, 5, 12}), r = at::randn({2, 5, 12}), w = at::randn({12}), b = at::randn({12});
    const auto [sum, y] = models::add_layer_norm(x, r, w, b, 1e-5);
    QVERIFY(at::equal(sum, x + r));
    QVERIFY(at::equal(y, at::layer_norm(x + r, {12}, w, b, 1e-5)));
    const auto g = at::randn({3, 4, 16});
    QVERIFY(!models::geglu_halves_uses_kernel(g));
    QVERIFY(at::equal(models::geglu_halves(g), g.narrow(-1, 0, 8) * at::gelu(g.narrow(-1, 8, 8))));
    DIFFRACT_EXPECT_ERROR(models::geglu_halves(at::randn({3, 5})), "geglu_halves", "even");
  }

  // linear_into writes linear()'s values into one stream's rows of a joint tensor and leaves the
  // other rows alone (on the CPU through linear() and a copy; the strided-batch GEMM is CUDA's);
  // an out of the wrong shape is named.
  void linearIntoAView() {
    at::NoGradGuard no_grad;
    at::Generator g = at::detail::createCPUGenerator(4);
    const auto x = at::randn({2, 5, 8}, g), c = at::randn({2, 3, 8}, g);
    const auto w = at::randn({6, 8}, g), b = at::randn({6}, g);
    auto all = at::full({2, 8, 6}, 7.f);
    auto text_rows = all.slice(1, 5);
    models::linear_into(text_rows, c, w, b);
    QVERIFY(at::equal(all.slice(1, 5), models::linear(c, w, b)));
    QVERIFY(at::equal(all.slice(1, 0, 5), at::full({2, 5, 6}, 7.f)));
    auto image_rows = all.slice(1, 0, 5);
    models::linear_into(image_rows, x, w, b);
    QVERIFY(at::equal(all.slice(1, 0, 5), models::linear(x, w, b)));
    QVERIFY(models::gemm_strided_batch_enabled());  // on by default; the CPU takes linear() and a copy all the same
    auto wrong = at::empty({2, 4, 6});
    QVERIFY_THROWS_EXCEPTION(std::exception, models::linear_into(wrong, x, w, b));
    // linear() of rows that fold into no single stride (a token slice at batch 2): ATen's values,
    // to fp32 rounding (the BLAS may sum a strided and a contiguous input in other orders: an
    // AMD EPYC's differs near zero by more than allclose's default 1e-8).
    const auto joint = at::randn({2, 8, 8}, g);
    QVERIFY(at::allclose(models::linear(joint.slice(1, 0, 5), w, b), at::linear(joint.slice(1, 0, 5).contiguous(), w, b),
                         1e-5, 1e-5));
  }

  // strided_rows: which views fold into one evenly strided run of rows (what the tanh GELU kernel
  // and the tuned GEMM take), and gelu_tanh_out on the CPU (ATen's gelu_out into the view; the
  // CUDA kernel is checked by diffract-gpu-checks geglu).
  void stridedRowsAndGeluIntoAView() {
    const auto rows = [](const at::Tensor& t) {
      const auto r = models::strided_rows(t);
      return r ? std::vector<int64_t>{r->rows, r->cols, r->stride} : std::vector<int64_t>{};
    };
    const auto buf = at::zeros({2, 6, 10});
    QCOMPARE(rows(buf), (std::vector<int64_t>{12, 10, 10}));
    QCOMPARE(rows(buf.narrow(2, 3, 7)), (std::vector<int64_t>{12, 7, 10}));  // a column slice
    QCOMPARE(rows(buf.narrow(1, 0, 4)), std::vector<int64_t>{});             // tokens of each batch item
    QCOMPARE(rows(buf.narrow(0, 1, 1).narrow(1, 0, 4)), (std::vector<int64_t>{4, 10, 10}));  // one item's
    QCOMPARE(rows(buf.transpose(1, 2)), std::vector<int64_t>{});             // last dimension strided
    QCOMPARE(rows(at::zeros({5})), (std::vector<int64_t>{1, 5, 5}));
    QCOMPARE(rows(buf.select(1, 2).unsqueeze(1)), (std::vector<int64_t>{2, 10, 60}));  // a size-1 middle dim
    QCOMPARE(rows(at::zeros({1, 10}).expand({3, 10})), (std::vector<int64_t>{3, 10, 0}));
    QCOMPARE(rows(at::zeros({0, 4})), (std::vector<int64_t>{0, 4, 4}));
    // Two levels: batch items of evenly strided rows ({rows_per_batch, batches, cols, row_stride,
    // batch_stride}), what the fp8 quantisation kernel reads.
    const auto batches = [](const at::Tensor& t) {
      const auto r = models::strided_row_batches(t);
      return r ? std::vector<int64_t>{r->rows_per_batch, r->batches, r->cols, r->row_stride, r->batch_stride}
               : std::vector<int64_t>{};
    };
    QCOMPARE(batches(buf), (std::vector<int64_t>{12, 1, 10, 10, 120}));
    QCOMPARE(batches(buf.narrow(1, 0, 4)), (std::vector<int64_t>{4, 2, 10, 10, 60}));  // tokens of each item
    QCOMPARE(batches(buf.narrow(1, 4, 2).narrow(2, 0, 8)), (std::vector<int64_t>{2, 2, 8, 10, 60}));
    const auto four = at::zeros({3, 2, 6, 10});
    QCOMPARE(batches(four.narrow(2, 0, 4)), (std::vector<int64_t>{4, 6, 10, 10, 60}));  // items fold too
    QCOMPARE(batches(four.narrow(2, 0, 4).narrow(1, 0, 1)), (std::vector<int64_t>{4, 3, 10, 10, 120}));
    QCOMPARE(batches(four.narrow(2, 0, 4).narrow(0, 0, 2).narrow(1, 0, 1).squeeze(1).unsqueeze(1).expand({2, 2, 4, 10})),
             std::vector<int64_t>{});  // a third level (an expanded dimension between the items)
    QCOMPARE(batches(buf.transpose(1, 2)), std::vector<int64_t>{});
    QCOMPARE(batches(at::zeros({5})), (std::vector<int64_t>{1, 1, 5, 5, 5}));

    at::manual_seed(8);
    auto joined = at::zeros({1, 5, 24});
    const auto p = at::randn({1, 5, 40}) * 3;
    auto mlp = joined.narrow(2, 8, 16);
    QVERIFY(!models::gelu_tanh_uses_kernel(mlp, p.narrow(2, 24, 16)));
    models::gelu_tanh_out(mlp, p.narrow(2, 24, 16));
    QVERIFY(at::equal(joined.narrow(2, 8, 16), at::gelu(p.narrow(2, 24, 16), "tanh")));
    QVERIFY(at::equal(joined.narrow(2, 0, 8), at::zeros({1, 5, 8})));
  }

  // LayerNorm as torch::nn::LayerNorm({dim}): the same parameter names and initial values, a
  // torch::nn::LayerNorm's state dict binds to it, and the same output (both run at::layer_norm
  // on the CPU, so bit for bit). The transformer blocks' norms keep their checkpoint keys. (Its
  // CUDA kernel is checked against at::layer_norm by diffract-gpu-checks layernorm.)
  void layerNormIsTorchsLayerNorm() {
    models::LayerNorm ours(models::LayerNormOptions(12).eps(1e-5));
    nn::LayerNorm theirs(nn::LayerNormOptions({12}).eps(1e-5));
    QCOMPARE(ours->named_parameters().keys(), theirs->named_parameters().keys());
    QVERIFY(at::equal(ours->weight, theirs->weight) && at::equal(ours->bias, theirs->bias));
    QVERIFY(draws_nothing([] { return models::LayerNorm(models::LayerNormOptions(8)); }));
    at::manual_seed(5);
    {
      at::NoGradGuard no_grad;
      theirs->weight.copy_(at::randn({12}));
      theirs->bias.copy_(at::randn({12}));
    }
    io::StateDict sd;
    for (const auto& kv : theirs->named_parameters()) sd[kv.key()] = kv.value().detach().clone();
    const auto report = io::bind(*ours, sd, "layer norm");
    QCOMPARE(report.bound, size_t(2));
    QVERIFY(at::equal(ours->weight, theirs->weight) && at::equal(ours->bias, theirs->bias));
    const auto x = at::randn({2, 5, 12}) * 3 + 1;
    QVERIFY(at::equal(ours->forward(x), theirs->forward(x)));
    const auto strided = at::randn({12, 7}).t();  // [7, 12], not contiguous
    QVERIFY(at::equal(ours->forward(strided), theirs->forward(strided)));
    // Gradients flow as through torch's (the CPU path is at::layer_norm).
    const auto xg = x.clone().requires_grad_(true);
    ours->forward(xg).sum().backward();
    QVERIFY(ours->weight.grad().defined() && xg.grad().defined());
    QVERIFY(!models::layer_norm_uses_kernel(x, ours->weight, ours->bias));  // CPU tensors

    models::BasicTransformerBlock block(16, 2, 8, 24);
    const auto keys = block->named_parameters().keys();
    for (const char* norm : {"norm1", "norm2", "norm3"})
      for (const char* p : {".weight", ".bias"})
        QVERIFY2(std::count(keys.begin(), keys.end(), std::string(norm) + p) == 1, (std::string(norm) + p).c_str());
    QVERIFY(at::equal(block->norm2->weight, at::ones({16})) && at::equal(block->norm2->bias, at::zeros({16})));

    const bool was = models::fused_layer_norm_available();
    models::set_fused_layer_norm(false);
    QVERIFY(!models::fused_layer_norm_available());
    models::set_fused_layer_norm(was);
  }
};

QTEST_GUILESS_MAIN(TestLayers)
#include "test_layers.moc"
