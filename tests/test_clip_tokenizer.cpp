#include <fstream>

#include <nlohmann/json.hpp>

#include "core/text/clip_tokenizer.h"
#include "core/util/error.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

nlohmann::json cases() {
  std::ifstream in(test::fixtures() / "tokenizer_cases.json");
  return nlohmann::json::parse(in);
}

std::string show(const std::vector<int>& ids) {
  std::string s;
  for (int i : ids) s += std::to_string(i) + " ";
  return s;
}

// Every oracle prompt through `tok`; reports the first few prompts whose ids differ.
void check_parity(const text::CLIPTokenizer& tok, const char* ids_key, const char* label) {
  const auto all = cases();
  QVERIFY(all.size() >= 500);
  int failures = 0;
  std::string report;
  for (const auto& c : all) {
    const auto prompt = c["prompt"].get<std::string>();
    const auto expected = c[ids_key].get<std::vector<int>>();
    const auto got = tok.tokenize(prompt);
    if (got.ids != expected) {
      if (++failures <= 5) report += "\n  '" + prompt + "'\n    ours " + show(got.ids) + "\n    hf   " + show(expected);
    }
  }
  QVERIFY2(failures == 0, qPrintable(QString("%1: %2 of %3 prompts differ:%4").arg(label).arg(failures).arg(all.size()).arg(report.c_str())));
}

}  // namespace

class TestCLIPTokenizer : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() {
    if (!text::CLIPTokenizer::has_unicode_support()) QSKIP("built without ICU: parity needs Unicode prompts");
  }

  void matchesTransformersFromTokenizerJson() {
    check_parity(text::CLIPTokenizer::from_folder(test::fixtures() / "tokenizer_l"), "ids_l", "tokenizer.json");
  }

  void matchesTransformersFromVocabAndMerges() {
    check_parity(text::CLIPTokenizer::from_folder(test::fixtures() / "clip_vocab"), "ids_l", "vocab.json + merges.txt");
  }

  void matchesTransformersFromOpenAIBpe() {
    const auto tok = text::CLIPTokenizer::from_openai_bpe(test::shared_dir() / "data/clip/bpe_simple_vocab_16e6.txt.gz");
    QCOMPARE(tok.vocab_size(), std::size_t(49408));
    check_parity(tok, "ids_l", "bpe_simple_vocab_16e6.txt.gz");
  }

  void matchesSdxlSecondTokenizerPaddingWithBang() {
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tokenizer_g");
    QCOMPARE(tok.pad_id(), 0);
    check_parity(tok, "ids_g", "pad '!'");
  }

  void masksAndTruncatesLikeTransformers() {
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tokenizer_l");
    int truncated = 0;
    for (const auto& c : cases()) {
      const auto got = tok.tokenize(c["prompt"].get<std::string>());
      QCOMPARE(got.attention_mask, c["mask_l"].get<std::vector<int>>());
      const int full = c["full_length"].get<int>();
      QCOMPARE(got.dropped, std::max(0, full - 77));
      QCOMPARE(static_cast<int>(tok.encode(c["prompt"].get<std::string>()).size()), full);
      truncated += got.dropped > 0;
    }
    QVERIFY(truncated >= 3);  // the oracle's long prompts really exercise truncation
    const auto empty = tok.tokenize("");
    QCOMPARE(empty.length, 2);
    QCOMPARE(empty.ids[0], tok.bos_id());
    QCOMPARE(empty.ids[1], tok.eos_id());
  }

  void rejectsBadInput() {
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tokenizer_l");
    DIFFRACT_EXPECT_ERROR(tok.encode(std::string("bad \xff byte")), "not valid UTF-8");
    DIFFRACT_EXPECT_ERROR(tok.encode(std::string("cut \xe2\x82")), "not valid UTF-8");
    DIFFRACT_EXPECT_ERROR(tok.encode(std::string("overlong \xc0\xaf")), "not valid UTF-8");
  }

  void rejectsMissingOrBrokenFiles() {
    QTemporaryDir tmp;
    const fs::path dir = tmp.path().toStdString();
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "no tokenizer files");
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir / "absent"), "tokenizer folder is missing");
    fs::copy_file(test::fixtures() / "clip_vocab" / "vocab.json", dir / "vocab.json");
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "merges.txt", "merges file is missing");
    std::ofstream(dir / "merges.txt") << "#version: 0.2\ni n\nbroken-line\n";
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "merges.txt", "line 3", "broken-line");
    std::ofstream(dir / "merges.txt") << "#version: 0.2\ni n\n";
    std::ofstream(dir / "vocab.json") << R"({"a": 0, "<|startoftext|>": 1, "<|endoftext|>": 2})";
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "lacks the byte symbol");
    std::ofstream(dir / "vocab.json") << R"({"a": 0})";
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "bos token '<|startoftext|>' is not in the vocabulary");
    std::ofstream(dir / "vocab.json") << R"({"a": )";
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_folder(dir), "vocab.json", "malformed JSON");
    DIFFRACT_EXPECT_ERROR(text::CLIPTokenizer::from_openai_bpe(dir / "none.txt.gz"), "none.txt.gz", "cannot open");
  }
};

QTEST_GUILESS_MAIN(TestCLIPTokenizer)
#include "test_clip_tokenizer.moc"
