// ControlNet against diffusers (tests/reference/make_controlnet_fixtures.py): StableDiffusion(XL)
// ControlNetPipeline on tiny seeded ControlNets, one, a guidance window, two at once, SDXL's; and
// what a bad ControlNet or control image gets.
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/io/image.h"
#include "core/io/safetensors_writer.h"
#include "core/io/weights.h"
#include "core/models/controlnets/controlnet.h"
#include "core/pipeline/single_file.h"
#include "core/util/error.h"
#include "diffusers_case.h"
#include "same_tensors.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "controlnet"; }

nlohmann::json cases() {
  std::ifstream in(dir() / "controlnet_cases.json");
  return nlohmann::json::parse(in);
}

job::GenerationRequest request_for(const nlohmann::json& c) {
  auto r = test::request_from_case(c);
  for (const auto& n : c["controlnets"]) {
    job::ControlNetRef ref;
    ref.path = (dir() / n["net"].get<std::string>()).string();
    ref.image = io::read_image(dir() / n["image"].get<std::string>()).image;
    ref.scale = n["scale"];
    ref.start = n["start"];
    ref.end = n["end"];
    r.controlnets.push_back(ref);
  }
  return r;
}

at::Tensor latents(const job::GenerationResult& g) {
  return at::from_blob(const_cast<float*>(g.latents.data()), g.latents_shape, at::kFloat).clone();
}

}  // namespace

class TestControlNet : public QObject {
  Q_OBJECT
 private slots:
  void matchesDiffusers_data() {
    QTest::addColumn<int>("index");
    const auto all = cases();
    for (std::size_t i = 0; i < all.size(); ++i) QTest::newRow(all[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(all.size(), std::size_t(4));
  }

  void matchesDiffusers() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    job::CancelToken never;
    job::GenerationResult result;
    try {
      result = engine_.run(request_for(c), {}, never);
    } catch (const std::exception& e) {
      QFAIL(e.what());
    }
    const auto mismatch =
        test::image_mismatch(result.images.front(), io::load_state_dict(dir() / "controlnet_cases.safetensors").at(name)[0], name);
    QVERIFY2(mismatch.isEmpty(), qPrintable(mismatch));
    const auto meta = nlohmann::json::parse(result.metadata_json);
    QCOMPARE(meta["controlnets"].size(), c["controlnets"].size());
  }

  // Every evaluation of the strategies that take ControlNets includes them: CFG-parallel (each
  // branch on its own virtual device) and data-parallel (the batch split) give the one-device
  // image exactly, DRiffusion's drafts stay close to it; the job without the ControlNet differs.
  void strategiesRunTheControlNets() {
    job::CancelToken never;
    auto base = request_for(cases()[2]);  // two ControlNets, each with its own window
    base.batch = 2;
    const auto single = latents(engine_.run(base, {}, never));
    auto plain = base;
    plain.controlnets.clear();
    QVERIFY((latents(engine_.run(plain, {}, never)) - single).abs().max().item<double>() > 1e-2);
    for (const char* name : {"cfg-parallel", "data-parallel", "driffusion"}) {
      auto r = base;
      r.strategy.name = name;
      r.strategy.devices = 2;
      at::Tensor got;
      try {
        const auto result = engine_.run(r, {}, never);
        QCOMPARE(nlohmann::json::parse(result.metadata_json)["strategy_name"].get<std::string>(), std::string(name));
        got = latents(result);
      } catch (const std::exception& e) {
        QFAIL(qPrintable(QString("%1: %2").arg(name, e.what())));
      }
      const double diff = (got - single).abs().max().item<double>();
      const double scale = single.abs().max().item<double>();
      // DRiffusion's drafts are not exact (test_parallel bounds them the same way without ControlNets).
      const double bound = std::string(name) == "driffusion" ? 0.05 * scale : 1e-4 * scale;
      QVERIFY2(diff <= bound, qPrintable(QString("%1: max |diff| %2 (bound %3)").arg(name).arg(diff).arg(bound)));
    }
  }

  // A diffusers-layout ControlNet as one file (its folder's weights alone): the config from the
  // shapes, the same image as the folder (32 norm groups, SD's, as a file without a config implies).
  void singleFileControlNets() {
    job::CancelToken never;
    auto r = request_for(cases()[0]);
    r.controlnets[0].path = (dir() / "cn-sd-g32").string();
    const auto folder = engine_.run(r, {}, never);
    r.controlnets[0].path = (dir() / "cn-sd-g32.safetensors").string();
    job::GenerationResult file;
    try {
      file = engine_.run(r, {}, never);
    } catch (const std::exception& e) {
      QFAIL(e.what());
    }
    QVERIFY(file.images.front().rgb == folder.images.front().rgb);
  }

  // lllyasviel's original layout (fixtures: diffusers' from_single_file reads both files back to the
  // cn-ldm folder's weights exactly): ControlNet 1.0's bundled file under control_model. beside a
  // base model's tensors, and 1.1's bare .pth. Same tensors as the folder, and the residuals of one
  // forward are diffusers'.
  void originalLayoutControlNets() {
    const auto folder = models::load_controlnet(dir() / "cn-ldm");
    const auto want = io::load_state_dict(dir() / "controlnet_ldm_case.safetensors");
    for (const char* name : {"control_tiny_sd15.safetensors", "control_tiny_v11.pth"}) {
      models::ControlNetModel net{nullptr};
      try {
        net = pipeline::load_controlnet_file(dir() / name);
      } catch (const std::exception& e) {
        QFAIL(e.what());
      }
      EXPECT_SAME_TENSORS(net, folder);
      net->eval();
      models::UNetConditioning cond;
      cond.encoder_hidden_states = want.at("encoder_hidden_states");
      const auto out = net->forward(want.at("sample"), want.at("timestep"), cond, want.at("cond"), 0.7);
      QCOMPARE(out.down.size(), std::size_t(6));
      for (std::size_t i = 0; i <= out.down.size(); ++i) {
        const std::string key = i < out.down.size() ? "down." + std::to_string(i) : "mid";
        const auto& got = i < out.down.size() ? out.down[i] : out.mid;
        const auto& ref = want.at(key);
        const double diff = (got - ref).abs().max().item<double>(), scale = ref.abs().max().item<double>();
        QVERIFY2(scale > 1e-3 && diff <= 1e-4 * scale,
                 qPrintable(QString("%1 %2: max |diff| %3 of %4").arg(name, key.c_str()).arg(diff).arg(scale)));
      }
    }
    // What is not a whole ControlNet is named.
    QTemporaryDir tmp;
    const auto part = fs::path(tmp.path().toStdString()) / "control_part.safetensors";
    io::write_safetensors(part, {{"control_model.zero_convs.0.0.weight", at::zeros({4, 4, 1, 1})},
                                 {"control_model.input_hint_block.0.weight", at::zeros({16, 3, 3, 3})}});
    DIFFRACT_EXPECT_ERROR(pipeline::load_controlnet_file(part), "control_part.safetensors", "no UNet encoder tensors");
    auto diff = io::load_state_dict(dir() / "control_tiny_sd15.safetensors");
    diff.emplace("difference", at::zeros({}));
    const auto diff_file = fs::path(tmp.path().toStdString()) / "control_sd15_canny_diff.safetensors";
    io::write_safetensors(diff_file, {diff.begin(), diff.end()});
    DIFFRACT_EXPECT_ERROR(pipeline::load_controlnet_file(diff_file), "control_sd15_canny_diff", "a difference ControlNet");
    auto broken = io::load_state_dict(dir() / "control_tiny_sd15.safetensors");
    broken.erase("control_model.middle_block_out.0.bias");
    const auto broken_file = fs::path(tmp.path().toStdString()) / "control_broken.safetensors";
    io::write_safetensors(broken_file, {broken.begin(), broken.end()});
    DIFFRACT_EXPECT_ERROR(pipeline::load_controlnet_file(broken_file), "control_broken.safetensors",
                          "controlnet_mid_block.bias");
  }

  void badInputs() {
    job::CancelToken never;
    const auto base = request_for(cases()[0]);
    auto r = base;
    r.controlnets[0].image = {};
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "ControlNet 1", "has no control image");
    r = base;
    r.controlnets[0].start = 0.8;
    r.controlnets[0].end = 0.2;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "0 <= start < end <= 1");
    r = base;
    r.controlnets[0].path = (dir() / "cn-sdxl").string();  // SDXL's on SD 1.x
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "cn-sdxl is for another model");
    r = base;
    r.controlnets[0].path = (dir() / "nothing").string();
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "not a folder or a file");
    r = base;
    r.controlnets[0].path = (test::fixtures() / "tiny-sd" / "unet" / "diffusion_pytorch_model.safetensors").string();
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "not a ControlNet (no controlnet_cond_embedding");
    r = base;
    r.controlnets[0].path = (test::fixtures() / "tiny-sd" / "unet").string();  // a UNet, not a ControlNet
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "not a ControlNetModel");
    r = base;
    r.strategy.name = "distrifusion";
    r.strategy.devices = 2;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "distrifusion does not run ControlNets", "image bands");
    r = base;
    r.hires.scale = 2;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "hires fix with ControlNets");
    // After the errors the same job still gives diffusers' image.
    QCOMPARE(engine_.run(base, {}, never).images.size(), std::size_t(1));
  }

 private:
  engine::Engine engine_;
};

QTEST_GUILESS_MAIN(TestControlNet)
#include "test_controlnet.moc"
