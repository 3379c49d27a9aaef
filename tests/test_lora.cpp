// LoRA against diffusers (tests/reference/make_lora_fixtures.py): PEFT- and kohya-layout files on
// the tiny SD and SDXL, several at once, switched between jobs without reloading; LoHa and LoKr
// layers against PEFT's deltas; the original UNet names kohya's SDXL files use; what bad files get.
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/adapters/lora.h"
#include "core/engine/engine.h"
#include "core/engine/lora_library.h"
#include "core/engine/png_parameters.h"
#include "core/io/lora_file.h"
#include "core/io/single_file.h"
#include "core/io/weights.h"
#include "core/models/unets/unet_2d_condition.h"
#include "core/util/error.h"
#include "diffusers_case.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "lora"; }

nlohmann::json cases() {
  std::ifstream in(dir() / "lora_cases.json");
  return nlohmann::json::parse(in);
}

job::GenerationRequest request_for(const nlohmann::json& c) {
  auto r = test::request_from_case(c);
  for (const auto& l : c["loras"]) {
    job::LoraRef ref;
    ref.path = (dir() / l["file"].get<std::string>()).string();
    ref.weight = ref.text_encoder_weight = l["weight"];
    r.loras.push_back(ref);
  }
  return r;
}

job::GenerationRequest tiny(const std::string& lora = "") {
  job::GenerationRequest r = request_for(cases()["images"][0]);  // sd.none
  if (!lora.empty()) r.loras.push_back({(dir() / lora).string(), 1.0, 1.0, ""});
  return r;
}

}  // namespace

class TestLora : public QObject {
  Q_OBJECT
 private slots:
  // Every diffusers UNet module the original layout names maps back through the single-file
  // loader's own LDM -> diffusers map.
  void ldmNamesRoundTrip() {
    for (const char* model : {"tiny-sd", "tiny-sdxl"}) {
      const auto weights = io::load_state_dict(test::fixtures() / model / "unet" / "diffusion_pytorch_model.safetensors");
      std::vector<std::string> modules;
      for (const auto& [k, v] : weights)
        if (k.size() > 7 && k.compare(k.size() - 7, 7, ".weight") == 0) modules.push_back(k.substr(0, k.size() - 7));
      const auto ldm = io::ldm_unet_module_names(modules);
      io::StateDict original;
      for (const auto& [k, v] : weights) {
        const auto dot = k.rfind('.');
        const auto it = ldm.find(k.substr(0, dot));
        if (it != ldm.end()) original["model.diffusion_model." + it->second + k.substr(dot)] = v;
      }
      QVERIFY(ldm.size() > 40);
      const auto back = io::map_ldm_unet(original);
      int checked = 0;
      for (const auto& [k, v] : back) {
        QVERIFY2(weights.count(k), qPrintable(QString("%1: %2 maps to nothing of ours").arg(model, k.c_str())));
        QVERIFY(weights.at(k).is_same(v) || weights.at(k).equal(v));
        ++checked;
      }
      QCOMPARE(static_cast<std::size_t>(checked), original.size());
    }
  }

  void imagesMatchDiffusers_data() {
    QTest::addColumn<int>("index");
    const auto all = cases()["images"];
    for (std::size_t i = 0; i < all.size(); ++i) QTest::newRow(all[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(all.size(), std::size_t(8));
  }

  // diffusers' load_lora_weights + set_adapters against ours, one engine for all (each case
  // switches the LoRAs of the model loaded by the one before).
  void imagesMatchDiffusers() {
    QFETCH(int, index);
    const auto c = cases()["images"][static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    job::CancelToken never;
    const auto result = engine_.run(request_for(c), {}, never);
    const auto mismatch =
        test::image_mismatch(result.images.front(), io::load_state_dict(dir() / "lora_cases.safetensors").at(name + ".image")[0], name);
    QVERIFY2(mismatch.isEmpty(), qPrintable(mismatch));
    const auto meta = nlohmann::json::parse(result.metadata_json);
    if (c["loras"].empty()) {
      QVERIFY(!meta.contains("loras"));
    } else {
      QCOMPARE(meta["loras"].size(), c["loras"].size());
      QVERIFY(meta["loras"][0]["layers"][name.rfind("sd3", 0) == 0 ? "transformer" : "unet"].get<int>() > 0);
      QVERIFY(meta["loras"][0]["layers"]["text_encoder"].get<int>() > 0);
      QVERIFY(result.a1111_parameters.find("<lora:") != std::string::npos);
    }
  }

  // Off, on, off, on: the weights come back exactly, and the model is never reloaded.
  void switchingRestoresExactly() {
    job::CancelToken never;
    const auto off = engine_.run(tiny(), {}, never);
    const auto on = engine_.run(tiny("sd-a-kohya.safetensors"), {}, never);
    const auto off2 = engine_.run(tiny(), {}, never);
    const auto on2 = engine_.run(tiny("sd-a-kohya.safetensors"), {}, never);
    QVERIFY(off.images.front().rgb != on.images.front().rgb);
    QVERIFY(off.images.front().rgb == off2.images.front().rgb);
    QVERIFY(on.images.front().rgb == on2.images.front().rgb);
    QCOMPARE(on2.timings.load_ms, 0.0);
  }

  // The prompt's <lora:NAME:W> found in the LoRA folder: as --lora, and the tag is not encoded.
  void promptTags() {
    job::CancelToken never;
    auto by_flag = tiny();
    by_flag.loras.push_back({(dir() / "sd-b-kohya.safetensors").string(), 0.6, 0.6, ""});
    auto by_tag = tiny();
    by_tag.prompt += " <lora:SD-B-kohya:0.6>";
    by_tag.lora_dirs = {dir().string()};
    const auto a = engine_.run(by_flag, {}, never);
    const auto b = engine_.run(by_tag, {}, never);
    QVERIFY(a.images.front().rgb == b.images.front().rgb);
    QVERIFY(b.a1111_parameters.rfind("a red apple <lora:SD-B-kohya:0.6>", 0) == 0);
    auto missing = tiny();
    missing.prompt += " <lora:sd-b-kohyaa>";
    missing.lora_dirs = {dir().string()};
    DIFFRACT_EXPECT_ERROR(engine_.run(missing, {}, never), "no LoRA named 'sd-b-kohyaa'", "nearest: sd-b-kohya");
    // A preset's LoRA: a name without a path, found the same way.
    auto by_name = tiny();
    by_name.loras.push_back({"", 0.6, 0.6, "sd-b-kohya"});
    by_name.lora_dirs = {dir().string()};
    QVERIFY(engine_.run(by_name, {}, never).images.front().rgb == a.images.front().rgb);
    by_name.loras[0].name = "sd-b-kohyaa";
    DIFFRACT_EXPECT_ERROR(engine_.run(by_name, {}, never), "no LoRA named 'sd-b-kohyaa'");
  }

  // PEFT's LoHa and LoKr deltas (Linear and Conv2d) against ours from the same tensors in LyCORIS' names.
  void lycorisLayers() {
    const auto t = io::load_state_dict(dir() / "lora_cases.safetensors");
    const auto all = cases()["lycoris"];
    QCOMPARE(all.size(), std::size_t(4));
    for (const auto& c : all) {
      const std::string name = c["name"];
      io::LoraLayer l;
      l.kind = name.rfind("loha", 0) == 0 ? io::LoraKind::LoHa : io::LoraKind::LoKr;
      const std::string prefix = l.kind == io::LoraKind::LoHa ? "hada_" : "lokr_";
      for (const auto& [k, v] : t)
        if (k.rfind(name + "." + prefix, 0) == 0) l.tensors[k.substr(name.size() + 1 + prefix.size())] = v;
      l.alpha = c["alpha"].get<double>();
      const auto shape = t.at(name + ".weight_shape").to(at::kLong);
      const std::vector<int64_t> s(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + shape.numel());
      const auto ours = adapters::lora_update(l, s, at::kCPU) * l.scale(1.0);
      // A LoKr of two full factors has no rank: LyCORIS and A1111 ignore its alpha (scale 1),
      // PEFT scales it by alpha / r all the same.
      const double peft_scale = c["peft_scale"];
      const auto theirs = l.rank() == 0 ? t.at(name + ".delta") / peft_scale : t.at(name + ".delta");
      qInfo("%s: rank %d, scale %g (PEFT's %g)", name.c_str(), static_cast<int>(l.rank()), l.scale(1.0), peft_scale);
      DIFFRACT_COMPARE_TENSORS(ours, theirs, 1e-5);
    }
  }

  // A1111's hash of the file in the parameters text, and read back from it.
  void hashes() {
    const auto expected = cases()["hashes"];
    const auto ours = engine::lora_short_hash(dir() / "sd-a-kohya.safetensors");
    if (ours.empty()) QSKIP("this build has no OpenSSL: no LoRA hashes");
    QCOMPARE(ours, expected["sd-a-kohya"].get<std::string>().substr(0, 12));
    job::CancelToken never;
    auto r = tiny("sd-a-kohya.safetensors");
    r.loras[0].name = "brand";
    const auto result = engine_.run(r, {}, never);
    const std::string want = "Lora hashes: \"brand: " + ours + "\"";
    QVERIFY2(result.a1111_parameters.find(want) != std::string::npos, result.a1111_parameters.c_str());
    QCOMPARE(nlohmann::json::parse(result.metadata_json)["loras"][0]["hash"].get<std::string>(), ours);
    const auto p = engine::parse_png_parameters({{"parameters", result.a1111_parameters}}, "x.png");
    QCOMPARE(p.lora_hashes.size(), std::size_t(1));
    QCOMPARE(p.lora_hashes[0].first, std::string("brand"));
    QCOMPARE(p.lora_hashes[0].second, ours);
    QVERIFY(p.unmapped.empty());
  }

  // Bad files: clear errors, and the model left as it was.
  void badFiles() {
    job::CancelToken never;
    const auto clean = engine_.run(tiny(), {}, never);
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("xl-for-sd.safetensors"), {}, never), "xl-for-sd.safetensors",
                          "for another model");
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("checkpoint.safetensors"), {}, never), "model checkpoint, not a LoRA");
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("not-lora.safetensors"), {}, never), "is not a LoRA", "foo.weight");
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("nothing-here.safetensors"), {}, never), "does not exist");
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("lora_cases.json"), {}, never), "not a .safetensors file");
    DIFFRACT_EXPECT_ERROR(engine_.run(tiny("sd-extra-layer.safetensors"), {}, never), "1 of its",
                          "lora_unet_down_blocks_9_attentions_0_proj_in", "--lora-lenient");
    auto nan = tiny("sd-a-kohya.safetensors");
    nan.loras[0].weight = std::nan("");
    DIFFRACT_EXPECT_ERROR(engine_.run(nan, {}, never), "not a number");
    // A damaged file: the header cut short.
    const auto cut = fs::path(QDir::tempPath().toStdString()) / "diffract-cut-lora.safetensors";
    {
      std::ifstream in(dir() / "sd-a-kohya.safetensors", std::ios::binary);
      std::string data((std::istreambuf_iterator<char>(in)), {});
      std::ofstream(cut, std::ios::binary) << data.substr(0, data.size() / 3);
    }
    auto damaged = tiny();
    damaged.loras.push_back({cut.string(), 1.0, 1.0, ""});
    QVERIFY_THROWS_EXCEPTION(Error, engine_.run(damaged, {}, never));
    // A good LoRA then a bad one: nothing of the good one stays.
    auto both = tiny("sd-a-kohya.safetensors");
    both.loras.push_back({(dir() / "xl-for-sd.safetensors").string(), 1.0, 1.0, ""});
    QVERIFY_THROWS_EXCEPTION(Error, engine_.run(both, {}, never));
    QVERIFY(engine_.run(tiny(), {}, never).images.front().rgb == clean.images.front().rgb);
    // Lenient: the layer that matches nothing is left out, the rest is the kohya file's.
    auto lenient = tiny("sd-extra-layer.safetensors");
    lenient.lora_lenient = true;
    const auto with_extra = engine_.run(lenient, {}, never);
    QVERIFY(with_extra.images.front().rgb == engine_.run(tiny("sd-a-kohya.safetensors"), {}, never).images.front().rgb);
    QCOMPARE(nlohmann::json::parse(with_extra.metadata_json)["loras"][0]["unmatched"].get<int>(), 1);
  }

 private:
  engine::Engine engine_;
};

QTEST_GUILESS_MAIN(TestLora)
#include "test_lora.moc"
