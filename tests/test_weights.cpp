#include <fstream>

#include <torch/nn.h>

#include "core/io/upload.h"
#include "core/io/weights.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

struct SmallImpl : torch::nn::Module {
  SmallImpl() {
    proj = register_module("proj", torch::nn::Linear(3, 2));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({2})));
    scale = register_buffer("scale", torch::ones({2}));
  }
  torch::nn::Linear proj{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Small);

io::StateDict good_weights() {
  return {{"proj.weight", at::arange(6, at::kHalf).view({2, 3})}, {"proj.bias", at::zeros({2})},
          {"norm.weight", at::full({2}, 2.0)}, {"norm.bias", at::zeros({2})}, {"scale", at::full({2}, 3.0)}};
}

}  // namespace

class TestWeights : public QObject {
  Q_OBJECT
 private slots:
  void readsTorchSaveArchivesLikeTorchLoad() {
    for (const char* part : {"encoder", "decoder"}) {
      const auto pth = test::shared_dir() / "data" / "taesd" / (std::string("taef2_") + part + ".pth");
      auto got = io::load_state_dict(pth);
      auto expected = io::load_state_dict(test::fixtures() / (std::string("taef2_") + part + ".expected.safetensors"));
      QVERIFY2(!expected.empty(), part);
      QCOMPARE(got.size(), expected.size());
      for (const auto& [k, v] : expected) {
        QVERIFY2(got.count(k), k.c_str());
        QVERIFY2(got.at(k).dtype() == v.dtype() && at::equal(got.at(k), v), k.c_str());
      }
    }
  }

  void rejectsNonZipPickles() {
    QTemporaryDir tmp;
    const fs::path p = fs::path(tmp.path().toStdString()) / "old.pth";
    std::ofstream(p, std::ios::binary) << "\x80\x02}q\x00.";
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(p), "old.pth", "not a torch.save zip archive");
    const fs::path z = fs::path(tmp.path().toStdString()) / "broken.pth";
    std::ofstream(z, std::ios::binary) << "PK\x03\x04 truncated zip";
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(z), "broken.pth", "cannot read the torch.save archive");
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(fs::path(tmp.path().toStdString()) / "weights.onnx"),
                          "weights.onnx", "unknown checkpoint format");
  }

  void bindsByNameConvertingDtype() {
    Small m;
    auto report = io::bind(*m, good_weights(), "small.safetensors");
    QCOMPARE(report.bound, std::size_t(5));
    QCOMPARE(m->proj->weight.dtype(), at::kFloat);
    QCOMPARE(m->proj->weight[1][2].item<float>(), 5.0f);
    QCOMPARE(m->scale[0].item<float>(), 3.0f);
  }

  void strictBindListsEveryProblem() {
    Small m;
    const at::Tensor before = m->proj->weight.clone();
    auto w = good_weights();
    w.erase("norm.bias");
    w.erase("scale");
    w["extra.weight"] = at::zeros({1});
    w["proj.bias"] = at::zeros({3});
    DIFFRACT_EXPECT_ERROR(io::bind(*m, w, "small.safetensors"), "small.safetensors", "missing keys (2)", "norm.bias",
                          "scale", "unexpected keys (1)", "extra.weight", "shape mismatches (1)",
                          "proj.bias: checkpoint [3] vs model [2]");
    QVERIFY2(at::equal(m->proj->weight, before), "a failed strict bind must leave the module untouched");

    io::BindOptions lenient;
    lenient.strict = false;
    auto report = io::bind(*m, w, "small.safetensors", lenient);
    QCOMPARE(report.missing.size(), std::size_t(2));
    QCOMPARE(report.unexpected.size(), std::size_t(1));
    QCOMPARE(report.mismatched.size(), std::size_t(1));
    QCOMPARE(report.bound, std::size_t(2));

    io::BindOptions ignoring;
    ignoring.ignore_unexpected = {"extra.weight"};
    auto w2 = good_weights();
    w2["extra.weight"] = at::zeros({1});
    QCOMPARE(io::bind(*m, w2, "small", ignoring).bound, std::size_t(5));
  }
  // The GPU load path (pinned chunks, conversion on the device) run on the CPU: chunks far
  // smaller than the tensors, so every tensor crosses several chunk boundaries.
  void placementReplacesBoundTensorsInItsDtype() {
    Small m;
    auto w = good_weights();
    w["proj.weight"] = at::arange(6, at::kHalf).view({2, 3}).t().contiguous().t();  // non-contiguous
    {
      io::ScopedPlacement placement(at::kCPU, at::kBFloat16, 64);
      QVERIFY(io::ScopedPlacement::current() != nullptr);
      io::bind(*m, w, "small.safetensors");
      QCOMPARE(placement.stats().tensors, std::int64_t(5));
      QCOMPARE(placement.stats().bytes, std::int64_t(6 * 2 + 4 * (2 + 2 + 2 + 2)));
    }
    QVERIFY(io::ScopedPlacement::current() == nullptr);
    QCOMPARE(m->proj->weight.dtype(), at::kBFloat16);
    QVERIFY(at::equal(m->proj->weight, w["proj.weight"].to(at::kBFloat16)));
    QCOMPARE(m->scale.dtype(), at::kBFloat16);
    QCOMPARE(m->scale[1].item<float>(), 3.0f);
    QVERIFY2(m->proj->weight.is_same(m->named_parameters()["proj.weight"]), "the module holds the new tensor");
  }

  void placementLoadsAUNetFolderAsBindingThenConverting() {
    const auto dir = test::fixtures() / "tiny-sdxl" / "unet";
    auto plain = models::load_unet_2d_condition(dir);
    plain->to(at::kBFloat16);
    io::ScopedPlacement placement(at::kCPU, at::kBFloat16, 1000);  // 1000 bytes: most tensors span chunks
    auto placed = models::load_unet_2d_condition(dir);
    QVERIFY(placement.stats().tensors > 100);
    const auto a = plain->named_parameters(), b = placed->named_parameters();
    QCOMPARE(a.size(), b.size());
    for (const auto& p : a) {
      const auto& q = b[p.key()];
      QVERIFY2(q.scalar_type() == at::kBFloat16 && at::equal(p.value(), q), p.key().c_str());
    }
  }

  void uploaderRefusesChunksTooSmallAndDeviceSources() {
    DIFFRACT_EXPECT_ERROR(io::Uploader(at::kCPU, at::kFloat, 8), "chunks of 8 bytes");
    io::Uploader up(at::kCPU, at::kFloat, 64);
    DIFFRACT_EXPECT_ERROR(up.upload(at::empty({4}, at::TensorOptions().device(at::kMeta))), "weight upload",
                          "the source is on meta");
    QVERIFY(at::equal(up.upload(at::arange(100, at::kInt)), at::arange(100, at::kInt)));  // integers keep their type
  }
};

QTEST_GUILESS_MAIN(TestWeights)
#include "test_weights.moc"
