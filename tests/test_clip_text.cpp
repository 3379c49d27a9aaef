#include <fstream>

#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/text/clip_tokenizer.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

// fp32 on CPU: the same operations in a different order; differences are rounding only.
constexpr double kAtol = 2e-5;

io::StateDict expected() { return io::load_state_dict(test::fixtures() / "clip_text_cases.safetensors"); }

void write_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(test::fixtures() / "tiny-sd" / "text_encoder" / "config.json");
  auto j = nlohmann::json::parse(in);
  edit(j);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << j.dump(1);
  fs::copy_file(test::fixtures() / "tiny-sd" / "text_encoder" / "model.safetensors", dir / "model.safetensors",
                fs::copy_options::overwrite_existing);
}

}  // namespace

class TestCLIPText : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() { at::manual_seed(0); }

  void clipTextModelMatchesTransformers() {
    at::NoGradGuard no_grad;
    auto e = expected();
    auto model = models::load_clip_text_model(test::fixtures() / "tiny-sd" / "text_encoder");
    auto out = model->forward(e.at("l.input_ids"), true);
    DIFFRACT_COMPARE_TENSORS(out.hidden_states.front(), e.at("l.embeddings"), kAtol);
    DIFFRACT_COMPARE_TENSORS(out.hidden_states[out.hidden_states.size() - 2], e.at("l.penultimate"), kAtol);
    DIFFRACT_COMPARE_TENSORS(out.last_hidden_state, e.at("l.last_hidden_state"), kAtol);
    DIFFRACT_COMPARE_TENSORS(out.pooled, e.at("l.pooled"), kAtol);
  }

  void withProjectionMatchesTransformers() {
    at::NoGradGuard no_grad;
    auto e = expected();
    auto model = models::load_clip_text_model_with_projection(test::fixtures() / "tiny-sdxl" / "text_encoder_2");
    QCOMPARE(model->text_model->config.hidden_act, std::string("gelu"));
    QCOMPARE(model->text_model->config.eos_token_id, int64_t(49407));
    auto out = model->forward(e.at("g.input_ids"), true);
    DIFFRACT_COMPARE_TENSORS(out.hidden_states[out.hidden_states.size() - 2], e.at("g.penultimate"), kAtol);
    DIFFRACT_COMPARE_TENSORS(out.last_hidden_state, e.at("g.last_hidden_state"), kAtol);
    DIFFRACT_COMPARE_TENSORS(out.text_embeds, e.at("g.text_embeds"), kAtol);
  }

  void ourTokenizerFeedsTheSameIds() {
    if (!text::CLIPTokenizer::has_unicode_support()) QSKIP("built without ICU");
    auto e = expected();
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tiny-sdxl" / "tokenizer_2");
    const char* prompts[] = {"a photo of a cat", "", "a red apple on a white background, studio lighting, 8k, ultra detailed"};
    for (int i = 0; i < 3; ++i) {
      const auto ids = tok.tokenize(prompts[i]).ids;
      QVERIFY(at::equal(at::tensor(at::ArrayRef<int>(ids), at::kLong), e.at("g.input_ids")[i]));
    }
  }

  void presetsMatchPublishedShapes() {
    QCOMPARE(models::CLIPTextConfig::clip_l().hidden_size, int64_t(768));
    QCOMPARE(models::CLIPTextConfig::open_clip_bigg().num_hidden_layers, int64_t(32));
    QCOMPARE(models::CLIPTextConfig::open_clip_h().hidden_act, std::string("gelu"));
  }

  void rejectsBadConfigs() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    write_config(dir / "a", [](auto& j) { j.erase("hidden_size"); });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "a"), "config.json", "missing key 'hidden_size'");
    write_config(dir / "b", [](auto& j) { j["hidden_act"] = "relu6"; });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "b"), "config.json", "unsupported activation 'relu6'");
    write_config(dir / "c", [](auto& j) { j["num_attention_heads"] = 5; });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "c"), "not divisible by num_attention_heads 5");
    write_config(dir / "d", [](auto& j) { j["hidden_size"] = "wide"; });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "d"), "key 'hidden_size' must be");
    write_config(dir / "e", [](auto& j) { j["intermediate_size"] = 40; });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "e"), "model.safetensors", "shape mismatches (9)",
                          "text_model.encoder.layers.0.mlp.fc1.weight: checkpoint [37, 32] vs model [40, 32]");
    write_config(dir / "f", [](auto& j) { j["num_hidden_layers"] = 4; });
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "f"), "missing keys (16)", "text_model.encoder.layers.3.");
    fs::create_directories(dir / "g");
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "g"), "config.json", "missing");
    write_config(dir / "h", [](auto&) {});
    fs::remove(dir / "h" / "model.safetensors");
    DIFFRACT_EXPECT_ERROR(models::load_clip_text_model(dir / "h"), "no weight file");
  }
};

QTEST_GUILESS_MAIN(TestCLIPText)
#include "test_clip_text.moc"
