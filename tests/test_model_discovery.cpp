// Model discovery: diffusers pipelines in a Hugging Face cache and the TAESD for a model's family.
#include <QTemporaryDir>
#include <QtTest>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>

#include "core/engine/model_discovery.h"
#include "core/io/safetensors_writer.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

void writeText(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << text;
}

}  // namespace

class TestModelDiscovery : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  fs::path m_hub;

 private slots:
  void initTestCase() {
    QVERIFY(m_tmp.isValid());
    m_hub = fs::path(m_tmp.filePath("hub").toStdString());
    // Two snapshots of one pipeline (the newer one wins), a repository that is no pipeline, and
    // a folder that is no repository.
    writeText(m_hub / "models--org--sd-model/snapshots/old/model_index.json", "{\"_class_name\": \"StableDiffusionPipeline\"}");
    writeText(m_hub / "models--org--sd-model/snapshots/new/model_index.json", "{\"_class_name\": \"StableDiffusionPipeline\"}");
    const auto now = fs::file_time_type::clock::now();
    fs::last_write_time(m_hub / "models--org--sd-model/snapshots/old", now - std::chrono::hours(2));
    fs::last_write_time(m_hub / "models--org--sd-model/snapshots/new", now - std::chrono::hours(1));
    writeText(m_hub / "models--acme--bert/snapshots/def456/config.json", "{}");
    writeText(m_hub / "models--acme--a-xl/snapshots/x1/model_index.json", "{\"_class_name\": \"StableDiffusionXLPipeline\"}");
    writeText(m_hub / "datasets--acme--images/snapshots/d1/model_index.json", "{}");
    // TAESDs beside them (diffusers AutoencoderTiny folders: config.json, no model_index.json);
    // the SD 1.x one only as a snapshot without its config.
    writeText(m_hub / "models--madebyollin--taesdxl/snapshots/s1/config.json", "{}");
    writeText(m_hub / "models--madebyollin--taesd3/snapshots/s3/config.json", "{}");
    fs::create_directories(m_hub / "models--madebyollin--taesd/snapshots/empty");
  }

  void findsThePipelinesNewestSnapshotFirst() {
    const auto found = engine::discover_hugging_face_models(m_hub);
    QCOMPARE(found.size(), std::size_t(2));
    QCOMPARE(found[0], m_hub / "models--acme--a-xl" / "snapshots" / "x1");
    QCOMPARE(found[1], m_hub / "models--org--sd-model" / "snapshots" / "new");
    QVERIFY(engine::discover_hugging_face_models(m_hub / "missing").empty());
  }

  void namesTheRepository() {
    QCOMPARE(engine::hugging_face_repo_name(m_hub / "models--org--sd-model/snapshots/new"), std::string("org/sd-model"));
    QCOMPARE(engine::hugging_face_repo_name("/x/models--a--b--c/snapshots/h/"), std::string("a/b/c"));
    QCOMPARE(engine::hugging_face_repo_name("/some/folder"), std::string());
  }

  void readsTheHubFromTheEnvironment() {
    qputenv("HF_HUB_CACHE", "/cache/hub");
    qputenv("HF_HOME", "/hf");
    QCOMPARE(engine::hugging_face_hub(), fs::path("/cache/hub"));
    qunsetenv("HF_HUB_CACHE");
    QCOMPARE(engine::hugging_face_hub(), fs::path("/hf/hub"));
    qunsetenv("HF_HOME");
    qputenv("HOME", "/home/me");
    QCOMPARE(engine::hugging_face_hub(), fs::path("/home/me/.cache/huggingface/hub"));
  }

  void matchesTheTaesdToTheFamily() {
    const auto model = [&](const std::string& name, const std::string& pipeline) {
      const fs::path dir = fs::path(m_tmp.filePath("models").toStdString()) / name;
      writeText(dir / "model_index.json", "{\"_class_name\": \"" + pipeline + "\"}");
      return dir;
    };
    QCOMPARE(engine::matching_taesd(model("xl", "StableDiffusionXLPipeline"), m_hub),
             m_hub / "models--madebyollin--taesdxl" / "snapshots" / "s1");
    QCOMPARE(engine::matching_taesd(model("sd3", "StableDiffusion3Pipeline"), m_hub),
             m_hub / "models--madebyollin--taesd3" / "snapshots" / "s3");
    // No usable snapshot (no config.json), no TAESD for the family, no diffusers folder, bad JSON.
    QCOMPARE(engine::matching_taesd(model("sd15", "StableDiffusionPipeline"), m_hub), fs::path());
    QCOMPARE(engine::matching_taesd(model("flux", "FluxPipeline"), m_hub), fs::path());
    QCOMPARE(engine::matching_taesd(model("kandinsky", "KandinskyPipeline"), m_hub), fs::path());
    QCOMPARE(engine::matching_taesd(m_hub / "nowhere", m_hub), fs::path());
    const fs::path broken = model("broken", "x");
    writeText(broken / "model_index.json", "{not json");
    QCOMPARE(engine::matching_taesd(broken, m_hub), fs::path());
  }

  // Single files by their tensor names; TAEF1 as the original decoder file.
  void matchesTheTaesdToASingleFile() {
    writeText(m_hub / "models--madebyollin--taef1/snapshots/f1/taef1_decoder.pth", "x");
    const fs::path dir = fs::path(m_tmp.filePath("files").toStdString());
    fs::create_directories(dir);
    const auto file = [&](const std::string& name, const std::string& key) {
      io::write_safetensors(dir / name, {{key, at::zeros({1})}});
      return dir / name;
    };
    QCOMPARE(engine::matching_taesd(file("flux1-dev.safetensors", "double_blocks.0.img_attn.qkv.weight"), m_hub),
             m_hub / "models--madebyollin--taef1" / "snapshots" / "f1");
    QCOMPARE(engine::matching_taesd(file("sd3.safetensors", "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"),
                                    m_hub),
             m_hub / "models--madebyollin--taesd3" / "snapshots" / "s3");
    // An unreadable file and one of no known family have none.
    writeText(dir / "junk.safetensors", "not a safetensors file");
    QCOMPARE(engine::matching_taesd(dir / "junk.safetensors", m_hub), fs::path());
    QCOMPARE(engine::matching_taesd(file("other.safetensors", "weight"), m_hub), fs::path());
  }
};

QTEST_APPLESS_MAIN(TestModelDiscovery)
#include "test_model_discovery.moc"
