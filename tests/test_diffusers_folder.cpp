#include <fstream>

#include "core/io/diffusers_folder.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path copy_of(const QTemporaryDir& tmp, const std::string& fixture) {
  const fs::path dst = fs::path(tmp.path().toStdString()) / fixture;
  fs::copy(test::fixtures() / fixture, dst, fs::copy_options::recursive);
  return dst;
}

}  // namespace

class TestDiffusersFolder : public QObject {
  Q_OBJECT
 private slots:
  void reportsComponents() {
    const auto folder = io::DiffusersFolder::open(test::fixtures() / "tiny-sd");
    QCOMPARE(folder.pipeline_class(), std::string("StableDiffusionPipeline"));
    for (const char* name : {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}) {
      const auto* c = folder.find(name);
      QVERIFY2(c && c->present, name);
    }
    QVERIFY(folder.find("safety_checker") == nullptr);  // null in model_index.json: deliberately absent
    QCOMPARE(folder.require("unet").weights.filename().string(), std::string("diffusion_pytorch_model.safetensors"));
    QCOMPARE(folder.require("text_encoder").weights.filename().string(), std::string("model.safetensors"));
    QCOMPARE(folder.require("text_encoder").class_name, std::string("CLIPTextModel"));
    QVERIFY(folder.require("scheduler").config.filename() == "scheduler_config.json");
    QVERIFY(folder.summary().find("unet [UNet2DConditionModel]") != std::string::npos);

    const auto xl = io::DiffusersFolder::open(test::fixtures() / "tiny-sdxl");
    QCOMPARE(xl.pipeline_class(), std::string("StableDiffusionXLPipeline"));
    QCOMPARE(xl.require("text_encoder_2").class_name, std::string("CLIPTextModelWithProjection"));
    QVERIFY(xl.require("tokenizer_2").present);
  }

  void choosesVariants() {
    const auto fp16 = io::DiffusersFolder::open(test::fixtures() / "tiny-sd-fp16", "fp16");
    QCOMPARE(fp16.require("unet").weights.filename().string(), std::string("diffusion_pytorch_model.fp16.safetensors"));
    QCOMPARE(fp16.require("unet").variant, std::string("fp16"));
    // Without a variant asked for, the only weights there (fp16) are still found.
    const auto any = io::DiffusersFolder::open(test::fixtures() / "tiny-sd-fp16");
    QCOMPARE(any.require("text_encoder").weights.filename().string(), std::string("model.fp16.safetensors"));
    // Asking for fp16 where only full precision exists falls back to it.
    const auto plain = io::DiffusersFolder::open(test::fixtures() / "tiny-sd", "fp16");
    QCOMPARE(plain.require("unet").variant, std::string());
  }

  void reportsMissingComponents() {
    QTemporaryDir tmp;
    const auto dir = copy_of(tmp, "tiny-sd");
    fs::remove_all(dir / "unet");
    fs::remove(dir / "vae" / "diffusion_pytorch_model.safetensors");
    fs::remove(dir / "tokenizer" / "tokenizer.json");
    const auto folder = io::DiffusersFolder::open(dir);
    QVERIFY(!folder.find("unet")->present);
    QVERIFY(folder.find("unet")->problem.find("unet/ is missing") != std::string::npos);
    QVERIFY(folder.find("vae")->problem.find("no weight file") != std::string::npos);
    QVERIFY(folder.find("tokenizer")->problem.find("no tokenizer files") != std::string::npos);
    DIFFRACT_EXPECT_ERROR(folder.require("unet"), "component 'unet' is unusable", "missing");
    DIFFRACT_EXPECT_ERROR(folder.require("text_encoder_2"), "lists no 'text_encoder_2'");
    QVERIFY(folder.summary().find("MISSING") != std::string::npos);
  }

  void rejectsFoldersThatAreNotModels() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir), "not a diffusers model folder: no model_index.json");
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir / "nowhere"), "nowhere", "no such file or folder");
    std::ofstream(dir / "file.txt") << "x";
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir / "file.txt"), "not a folder");
    std::ofstream(dir / "model_index.json") << "{\"_class_name\": \"StableDiffusionPipeline\", ";
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir), "model_index.json", "malformed JSON");
    std::ofstream(dir / "model_index.json") << R"({"unet": ["diffusers", "UNet2DConditionModel"]})";
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir), "model_index.json", "missing key '_class_name'");
    std::ofstream(dir / "model_index.json") << R"({"_class_name": "X", "unet": [1, 2]})";
    DIFFRACT_EXPECT_ERROR(io::DiffusersFolder::open(dir), "component 'unet' must be [library, class]");
  }
};

QTEST_GUILESS_MAIN(TestDiffusersFolder)
#include "test_diffusers_folder.moc"
