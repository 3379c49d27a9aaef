#include <fstream>

#include <sys/stat.h>

#include <caffe2/serialize/inline_container.h>
#include <torch/nn.h>

#include "core/io/safetensors_writer.h"
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

// A torch.save archive of `pickle` and data/<key> records, written by LibTorch's own zip writer.
fs::path write_pth(const fs::path& path, const std::string& pickle, const std::map<std::string, std::string>& storages) {
  caffe2::serialize::PyTorchStreamWriter w(path.string());
  w.writeRecord("data.pkl", pickle.data(), pickle.size());
  for (const auto& [key, bytes] : storages) w.writeRecord("data/" + key, bytes.data(), bytes.size());
  w.writeEndOfFile();
  return path;
}

// The pickle of {"w": a float tensor of `size` elements at `offset` into storage "0" of `numel`}.
std::string tensor_pickle(int64_t numel, int offset, int64_t size) {
  const auto unicode = [](const std::string& s) {
    std::string out = "X";
    const auto n = static_cast<uint32_t>(s.size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    return out + s;
  };
  const auto long1 = [](int64_t v) {
    std::string out = "\x8a\x08";
    out.append(reinterpret_cast<const char*>(&v), 8);
    return out;
  };
  return std::string("\x80\x02}") + unicode("w") + "ctorch._utils\n_rebuild_tensor_v2\n(" + "(" + unicode("storage") +
         "ctorch\nFloatStorage\n" + unicode("0") + unicode("cpu") + long1(numel) + "tQ" + "K" +
         std::string(1, static_cast<char>(offset)) + long1(size) + "\x85" + "K\x01\x85" + "\x89" +
         "ccollections\nOrderedDict\n)R" + "tRs.";
}

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

  // Hostile torch.save archives: a pickle nested 200 000 tuples deep (its tree would be freed
  // recursively), a storage entry larger than the tensor it backs (checked before inflating), a
  // tensor view past its storage, a pickle that claims more than a state dict needs.
  void rejectsHostilePickles() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    const std::string proto = "\x80\x02";
    write_pth(dir / "deep.pth", proto + ")" + std::string(200000, '\x85') + ".", {});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "deep.pth"), "deep.pth", "nested deeper than 256 levels");
    write_pth(dir / "deeplist.pth", proto + std::string(200000, ']') + std::string(199999, 'a') + ".", {});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "deeplist.pth"), "deeplist.pth", "nested deeper");
    // The same state dict, its storage entry of the right size and 1 MB too large.
    QCOMPARE(io::load_state_dict(write_pth(dir / "ok.pth", tensor_pickle(4, 0, 4), {{"0", std::string(16, '\0')}})).size(),
             std::size_t(1));
    write_pth(dir / "bomb.pth", tensor_pickle(4, 0, 4), {{"0", std::string(1 << 20, '\0')}});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "bomb.pth"), "bomb.pth", "holds 1048576 bytes, expected 16");
    write_pth(dir / "past.pth", tensor_pickle(4, 2, 4), {{"0", std::string(16, '\0')}});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "past.pth"), "past.pth", "reaches past its storage");
    write_pth(dir / "huge.pth", tensor_pickle(4, 0, 4611686018427387903LL), {{"0", std::string(16, '\0')}});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "huge.pth"), "huge.pth");
    // Millions of one-byte pushes (gigabytes of values for a few megabytes of pickle).
    write_pth(dir / "pushes.pth", proto + std::string((std::size_t(4) << 20) + 1, 'N') + ".", {});
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(dir / "pushes.pth"), "pushes.pth", "values on the stack");
    const auto fifo = dir / "fifo.pth";
    QCOMPARE(::mkfifo(fifo.c_str(), 0600), 0);
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(fifo), "fifo.pth", "a FIFO");
  }

  // A mapped file truncated by another program between opening and binding: the pages past the
  // new end would raise SIGBUS when copied; the load fails naming the file and the process goes on.
  void truncatedWhileMappedIsAnError() {
    QTemporaryDir tmp;
    const auto file = fs::path(tmp.path().toStdString()) / "shrinking.safetensors";
    torch::nn::Linear big(torch::nn::LinearOptions(512, 512).bias(false));
    io::write_safetensors(file, {{"weight", at::randn({512, 512})}});
    const auto weights = io::load_state_dict(file);  // views of the mapping
    fs::resize_file(file, 4096);
    DIFFRACT_EXPECT_ERROR(io::bind(*big, weights, file.string()), "shrinking.safetensors",
                          "changed on disk while it was being read");
    // Still running, and the next load of a whole file works.
    io::write_safetensors(file, {{"weight", at::ones({512, 512})}});
    io::bind(*big, io::load_state_dict(file), file.string());
    QCOMPARE(big->weight.sum().item<double>(), 512.0 * 512.0);
  }

  void rejectsNonZipPickles() {
    QTemporaryDir tmp;
    const fs::path p = fs::path(tmp.path().toStdString()) / "old.pth";
    std::ofstream(p, std::ios::binary) << "\x80\x02}q\x00.";
    DIFFRACT_EXPECT_ERROR(io::load_state_dict(p), "old.pth", "not a torch.save zip archive");
    const fs::path z = fs::path(tmp.path().toStdString()) / "broken.pth";
    std::ofstream(z, std::ios::binary) << "PK\x03\x04 truncated zip";
    try {
      io::load_state_dict(z);
      QFAIL("a truncated zip was read");
    } catch (const Error& e) {
      // The zip reader's words for its developers ("This is an internal error...") stay out.
      const std::string what = e.what();
      QVERIFY2(what.find("broken.pth: not a readable torch.save archive") != std::string::npos &&
                   what.find("internal error") == std::string::npos,
               e.what());
    }
    // LibTorch's reader parses the version record with std::stoull: a number too long for it and
    // no number at all are named errors, not std::out_of_range escaping (found by fuzz_pth).
    for (const std::string version : {"99999999999999999999999", "three"}) {
      const fs::path v = fs::path(tmp.path().toStdString()) / "version.pth";
      {
        caffe2::serialize::PyTorchStreamWriter w(v.string());
        w.writeRecord("version", version.data(), version.size());
        const std::string pickle = "\x80\x02}q\x00.";
        w.writeRecord("data.pkl", pickle.data(), pickle.size());
        w.writeEndOfFile();
      }
      DIFFRACT_EXPECT_ERROR(io::load_state_dict(v), "version.pth", "not a readable torch.save archive");
    }
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
