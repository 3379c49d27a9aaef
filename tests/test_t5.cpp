// T5 (SD3's text_encoder_3 / tokenizer_3) against transformers: tests/reference/make_t5_fixtures.py's
// SentencePiece model and tiny seeded T5EncoderModels, CPU fp32.
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/io/weights.h"
#include "core/models/text_encoders/t5_encoder.h"
#include "core/text/t5_tokenizer.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

fs::path dir() { return test::fixtures() / "t5"; }

// fp32 on CPU: the same operations, the attention through SDPA instead of an explicit softmax.
constexpr double kEmbedTol = 0;
constexpr double kLayerTol = 2e-5;

}  // namespace

class TestT5 : public QObject {
  Q_OBJECT
 private slots:
  void tokenizerMatchesTransformers() {
    if (!text::T5Tokenizer::available()) QSKIP("this build has no SentencePiece");
    const auto tok = text::T5Tokenizer::from_folder(dir() / "tokenizer");
    std::ifstream in(dir() / "t5_tokenizer_cases.json");
    const auto j = nlohmann::json::parse(in);
    QCOMPARE(tok.vocab_size(), j["vocab_size"].get<int>());
    QCOMPARE(tok.eos_id(), 1);
    QCOMPARE(tok.pad_id(), 0);
    QCOMPARE(j["cases"].size(), std::size_t(12));  // make_t5_fixtures.py's TOKENIZER_CASES
    for (const auto& c : j["cases"]) {
      const std::string text = c["text"];
      const int max_length = c["max_length"];
      const auto got = tok.encode(text, max_length);
      QVERIFY2(got.ids == c["ids"].get<std::vector<int>>(), text.c_str());
      QVERIFY2(tok.encode(text) == c["unpadded"].get<std::vector<int>>(), text.c_str());
      QCOMPARE(static_cast<int>(got.attention_mask.size()), max_length);
    }
    const auto cut = tok.encode(std::string(300, 'x'), 256);
    QVERIFY(cut.dropped > 0);
    QCOMPARE(cut.ids.back(), tok.eos_id());
  }

  void tokenizerErrors() {
    QTemporaryDir tmp;
    const fs::path d = tmp.path().toStdString();
    std::ofstream(d / "tokenizer.json") << "{}";
    DIFFRACT_EXPECT_ERROR(text::T5Tokenizer::from_folder(d), "spiece.model is missing", "tokenizer.json");
    if (!text::T5Tokenizer::available()) {
      DIFFRACT_EXPECT_ERROR(text::T5Tokenizer::from_folder(dir() / "tokenizer"), "no SentencePiece",
                            "libsentencepiece-dev");
      return;
    }
    std::ofstream(d / "spiece.model") << "not a model";
    DIFFRACT_EXPECT_ERROR(text::T5Tokenizer::from_folder(d), "spiece.model", "not a SentencePiece model");
  }

  void encoderMatchesTransformers_data() {
    QTest::addColumn<QString>("name");
    QTest::newRow("gated-gelu") << "gated";
    QTest::newRow("relu") << "relu";
  }
  void encoderMatchesTransformers() {
    QFETCH(QString, name);
    const std::string n = name.toStdString();
    at::NoGradGuard no_grad;
    const auto e = io::load_state_dict(dir() / "t5_encoder_cases.safetensors");
    auto model = models::load_t5_encoder(dir() / ("tiny-t5-" + n));
    QCOMPARE(model->options.gated(), n == "gated");
    const auto out = model->forward(e.at("input_ids"), {}, true);
    QCOMPARE(static_cast<int>(out.hidden_states.size()), 4);
    DIFFRACT_COMPARE_TENSORS(out.hidden_states[0], e.at(n + ".embeddings"), kEmbedTol);
    DIFFRACT_COMPARE_TENSORS(out.hidden_states[2], e.at(n + ".block1"), kLayerTol);
    DIFFRACT_COMPARE_TENSORS(out.last_hidden_state, e.at(n + ".last_hidden_state"), kLayerTol);
    const auto masked = model->forward(e.at("input_ids"), e.at("attention_mask"));
    DIFFRACT_COMPARE_TENSORS(masked.last_hidden_state, e.at(n + ".masked.last_hidden_state"), kLayerTol);
    qInfo("%s: block 1 max |diff| %.3g, last %.3g", n.c_str(), test::max_abs_diff(out.hidden_states[2], e.at(n + ".block1")),
          test::max_abs_diff(out.last_hidden_state, e.at(n + ".last_hidden_state")));
    // bf16 (the CUDA dtype) stays close; fp16 is refused.
    model->to(at::kBFloat16);
    const auto bf = model->forward(e.at("input_ids")).last_hidden_state.to(at::kFloat);
    QVERIFY(test::max_abs_diff(bf, e.at(n + ".last_hidden_state")) < 0.1);
    model->to(at::kHalf);
    DIFFRACT_EXPECT_ERROR(model->forward(e.at("input_ids")), "fp16", "bf16");
  }

  void weightsThatDoNotFitTheConfigAreNamed() {
    QTemporaryDir tmp;
    const fs::path d = fs::path(tmp.path().toStdString()) / "t5";
    fs::copy(dir() / "tiny-t5-gated", d, fs::copy_options::recursive);
    nlohmann::json j;
    {
      std::ifstream in(d / "config.json");
      j = nlohmann::json::parse(in);
    }
    j["d_ff"] = 64;
    std::ofstream(d / "config.json") << j.dump(1);
    DIFFRACT_EXPECT_ERROR(models::load_t5_encoder(d), "encoder.block.0.layer.1.DenseReluDense.wi_0.weight");
    j["d_ff"] = 101;
    j["feed_forward_proj"] = "relu";  // wi instead of wi_0 / wi_1
    std::ofstream(d / "config.json") << j.dump(1);
    DIFFRACT_EXPECT_ERROR(models::load_t5_encoder(d), "DenseReluDense.wi.weight", "DenseReluDense.wi_0.weight");
    j["feed_forward_proj"] = "gated-gelu-x";
    std::ofstream(d / "config.json") << j.dump(1);
    DIFFRACT_EXPECT_ERROR(models::load_t5_encoder(d), "feed_forward_proj", "gated-gelu-x");
  }
};

QTEST_GUILESS_MAIN(TestT5)
#include "test_t5.moc"
