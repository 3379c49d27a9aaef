// A1111's prompt syntax: parse_prompt_attention against the examples of A1111's own docstring,
// the chunking and weighted embeddings against tests/reference/make_prompt_fixtures.py (A1111's
// algorithm in Python over transformers' CLIP), and whole jobs against diffusers run on those
// embeddings; the extra-network tags; what a malformed prompt gets.
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/io/weights.h"
#include "core/models/text_encoders/clip_text.h"
#include "core/pipeline/prompt_encoding.h"
#include "core/text/clip_tokenizer.h"
#include "core/text/prompt_syntax.h"
#include "core/util/error.h"
#include "diffusers_case.h"
#include "test_util.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

using Pairs = std::vector<std::pair<std::string, double>>;

void check_parse(const std::string& prompt, const Pairs& expected) {
  const auto got = text::parse_prompt_attention(prompt);
  QString got_text;
  for (const auto& g : got) got_text += QString("[%1, %2] ").arg(g.text.c_str()).arg(g.weight, 0, 'g', 17);
  QVERIFY2(got.size() == expected.size(), qPrintable(QString("'%1' -> %2").arg(prompt.c_str(), got_text)));
  for (std::size_t i = 0; i < got.size(); ++i) {
    QVERIFY2(got[i].text == expected[i].first, qPrintable(QString("'%1' -> %2").arg(prompt.c_str(), got_text)));
    QVERIFY2(std::abs(got[i].weight - expected[i].second) < 1e-12,
             qPrintable(QString("'%1' -> %2").arg(prompt.c_str(), got_text)));
  }
}

fs::path dir() { return test::fixtures() / "prompts"; }

nlohmann::json cases() {
  std::ifstream in(dir() / "prompt_cases.json");
  return nlohmann::json::parse(in);
}

}  // namespace

class TestPromptSyntax : public QObject {
  Q_OBJECT
 private slots:
  // Every example of A1111's parse_prompt_attention docstring (modules/prompt_parser.py), verbatim.
  void a1111DocstringExamples() {
    check_parse("normal text", {{"normal text", 1.0}});
    check_parse("an (important) word", {{"an ", 1.0}, {"important", 1.1}, {" word", 1.0}});
    check_parse("(unbalanced", {{"unbalanced", 1.1}});
    check_parse("\\(literal\\]", {{"(literal]", 1.0}});
    check_parse("(unnecessary)(parens)", {{"unnecessaryparens", 1.1}});
    check_parse("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
                {{"a ", 1.0}, {"house", 1.5730000000000004}, {" ", 1.1}, {"on", 1.0}, {" a ", 1.1},
                 {"hill", 0.55}, {", sun, ", 1.1}, {"sky", 1.4641000000000006}, {".", 1.1}});
  }

  // What its grammar gives for the rest: BREAK, stray closers, weights outside brackets,
  // square-bracket prompt editing (read as text), lone backslashes, empty prompts.
  void a1111Grammar() {
    check_parse("", {{"", 1.0}});
    check_parse("a cat BREAK a dog", {{"a cat", 1.0}, {"BREAK", -1}, {"a dog", 1.0}});
    check_parse("BREAKFAST at noon", {{"BREAKFAST at noon", 1.0}});
    check_parse("(a BREAK b)", {{"a", 1.1}, {"BREAK", -1}, {"b", 1.1}});  // a BREAK stays one inside brackets
    check_parse("x) y]", {{"x) y]", 1.0}});
    check_parse("size:1.5) big", {{"size:1.5) big", 1.0}});
    check_parse("[cat:dog:0.5]", {{"cat:dog:0.5", 1 / 1.1}});
    check_parse("((a)", {{"a", 1.1 * 1.1}});
    check_parse("(a:-1)", {{"a", -1.0}});
    check_parse("(a:+.5)", {{"a", 0.5}});
    check_parse("a\\b \\\\ c", {{"ab \\ c", 1.0}});
    check_parse("(a:1.2:3)", {{"a:1.2", 3.0}});
    check_parse("(photo:1.2), [[blurry]]", {{"photo", 1.2}, {", ", 1.0}, {"blurry", 1 / 1.1 / 1.1}});
    DIFFRACT_EXPECT_ERROR(text::parse_prompt_attention("a (cat:1.2.3)"), "':1.2.3)'", "not a number");
    DIFFRACT_EXPECT_ERROR(text::parse_prompt_attention("(cat:.)"), "':.)'");
    QCOMPARE(text::plain_text(text::parse_prompt_attention("a \\(cat\\) (hat:1.2) BREAK [dog]")),
             std::string("a (cat) hat dog"));
  }

  // Where each run sits in the prompt, for the editor's colours.
  void spans() {
    const std::string p = "a (red:1.3) \\(x\\) BREAK [b]";
    const auto s = text::attention_spans(p);
    QString got;
    for (const auto& x : s) got += QString("%1[%2] ").arg(p.substr(x.begin, x.end - x.begin).c_str()).arg(x.weight);
    QCOMPARE(got, QString("a [1] red[1.3]  [1] ([1] x[1] )[1] BREAK[-1] b[0.909091] "));
  }

  void extraNetworks() {
    auto e = text::extract_extra_networks("a cat <lora:brand_style:0.8>, <lyco:Shoe v2>, red");
    QCOMPARE(e.prompt, std::string("a cat , , red"));
    QCOMPARE(e.tags.size(), std::size_t(2));
    QCOMPARE(e.tags[0].name, std::string("brand_style"));
    QCOMPARE(e.tags[0].weight, 0.8);
    QCOMPARE(e.tags[0].text_encoder_weight, 0.8);
    QCOMPARE(e.tags[1].name, std::string("Shoe v2"));
    QCOMPARE(e.tags[1].weight, 1.0);
    e = text::extract_extra_networks("<lora:x:0.5:1.25> 3 < 4 and a <b> tag <:x>");
    QCOMPARE(e.prompt, std::string(" 3 < 4 and a <b> tag <:x>"));
    QCOMPARE(e.tags.at(0).text_encoder_weight, 0.5);
    QCOMPARE(e.tags.at(0).weight, 1.25);
    DIFFRACT_EXPECT_ERROR(text::extract_extra_networks("a <lora:x:strong>"), "'strong'", "<lora:x:strong>", "not a number");
    DIFFRACT_EXPECT_ERROR(text::extract_extra_networks("a <hypernet:x:1>"), "'hypernet'", "only <lora");
    DIFFRACT_EXPECT_ERROR(text::extract_extra_networks("a <lora: :1>"), "names no LoRA");
    DIFFRACT_EXPECT_ERROR(text::extract_extra_networks("a <lora:x:1:2:3>"), "more than a name and two weights");
  }

  // Random prompts of brackets, colons, escapes and words: every one parses (or is refused with
  // diffract::Error), chunks, and keeps its tokens.
  void fuzzParser() {
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tiny-sd" / "tokenizer");
    const char* pieces[] = {"(", ")", "[", "]", ":", ":1.5)", "\\", "\\(", "BREAK", " ", "cat", ",", "<lora:", ">",
                            ":0.", "1", "é", "\n"};
    std::mt19937 rng(7);
    for (int n = 0; n < 3000; ++n) {
      std::string p;
      const int len = static_cast<int>(rng() % 40);
      for (int i = 0; i < len; ++i) p += pieces[rng() % std::size(pieces)];
      try {
        const auto parsed = text::parse_prompt_attention(p);
        const auto chunked = text::chunk_prompt(tok, parsed);
        QVERIFY(!chunked.chunks.empty());
        for (const auto& c : chunked.chunks) {
          QCOMPARE(c.ids.size(), std::size_t(77));
          QCOMPARE(c.weights.size(), std::size_t(77));
        }
        text::extract_extra_networks(p);
      } catch (const Error&) {
      }
    }
  }

  // The chunks' ids and weights for both tokenizers (SDXL's second pads with "!") as the Python
  // re-implementation makes them, a first chunk cut back to a comma included.
  void chunksMatchReference() {
    for (const auto& c : cases()) {
      for (const auto& [key, per] : c["encoders"].items()) {
        const auto folder = std::string(c["model"]) == "tiny-sd" ? "tokenizer" : key == "l" ? "tokenizer" : "tokenizer_2";
        const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / c["model"].get<std::string>() / folder);
        for (const char* which : {"prompt", "negative"}) {
          const std::string prompt = c[std::string(which) == "prompt" ? "prompt" : "negative_prompt"];
          const auto ours = text::chunk_prompt(tok, text::parse_prompt_attention(prompt));
          const auto& theirs = per[which];
          QCOMPARE(ours.chunks.size(), theirs.size());
          for (std::size_t k = 0; k < theirs.size(); ++k) {
            QCOMPARE(ours.chunks[k].ids, theirs[k]["ids"].get<std::vector<int>>());
            const auto w = theirs[k]["weights"].get<std::vector<double>>();
            for (std::size_t i = 0; i < w.size(); ++i) QVERIFY(std::abs(ours.chunks[k].weights[i] - w[i]) < 1e-6);
          }
        }
      }
    }
  }

  // Weighted, chunked embeddings per encoder against the reference's.
  void embeddingsMatchReference() {
    const auto expected = io::load_state_dict(dir() / "prompt_cases.safetensors");
    at::NoGradGuard no_grad;
    for (const auto& c : cases()) {
      if (!c["embeddings"].get<bool>()) continue;  // SD3's: checked through its images
      const std::string model = c["model"], name = c["name"];
      for (const auto& [key, per] : c["encoders"].items()) {
        const bool second = key == "g";
        const auto root = test::fixtures() / model;
        const auto tok = text::CLIPTokenizer::from_folder(root / (second ? "tokenizer_2" : "tokenizer"));
        models::CLIPTextModel l{nullptr};
        models::CLIPTextModelWithProjection g{nullptr};
        if (second)
          g = models::load_clip_text_model_with_projection(root / "text_encoder_2");
        else
          l = models::load_clip_text_model(root / "text_encoder");
        const bool last = model == "tiny-sd";
        for (const char* which : {"prompt", "negative"}) {
          const std::string prompt = c[std::string(which) == "prompt" ? "prompt" : "negative_prompt"];
          job::StageTimings t;
          const auto cp = pipeline::detail::clip_prompt(tok, prompt, job::PromptSyntax::A1111, at::kCPU, t);
          const auto e = pipeline::detail::encode_chunks(cp, [&](const at::Tensor& ids) {
            const auto o = second ? g->forward(ids, true) : l->forward(ids, true);
            return pipeline::detail::ChunkEncoding{last ? o.last_hidden_state : o.hidden_states.at(o.hidden_states.size() - 2), {}};
          });
          DIFFRACT_COMPARE_TENSORS(e.hidden, expected.at(name + "." + which + "." + key), 2e-5);
        }
      }
    }
  }

  void imagesMatchDiffusers_data() {
    QTest::addColumn<int>("index");
    const auto all = cases();
    for (std::size_t i = 0; i < all.size(); ++i) QTest::newRow(all[i]["name"].get<std::string>().c_str()) << static_cast<int>(i);
    QCOMPARE(all.size(), std::size_t(7));
  }

  // Whole jobs: diffusers' pipelines given the reference's embeddings (a prompt and a negative of
  // different lengths both repeated to a common one) against ours reading the prompts.
  void imagesMatchDiffusers() {
    QFETCH(int, index);
    const auto c = cases()[static_cast<std::size_t>(index)];
    const std::string name = c["name"];
    auto r = test::request_from_case(c);
    job::CancelToken never;
    job::GenerationResult result;
    try {
      result = engine_.run(r, {}, never);
    } catch (const std::exception& e) {
      QFAIL(e.what());
    }
    const auto mismatch = test::image_mismatch(
        result.images.front(), io::load_state_dict(dir() / "prompt_cases.safetensors").at(name + ".image")[0], name);
    QVERIFY2(mismatch.isEmpty(), qPrintable(mismatch));
    // Plain syntax reads the brackets as text, so the same request gives another image.
    r.prompt_syntax = job::PromptSyntax::Plain;
    const auto plain = engine_.run(r, {}, never);
    QVERIFY(plain.images.front().rgb != result.images.front().rgb);
  }

  void promptErrorsReachTheUser() {
    job::GenerationRequest r;
    r.model = (test::fixtures() / "tiny-sd").string();
    r.prompt = "a (cat:1..2) on a mat";
    r.steps = 2;
    r.preview_every = 0;
    job::CancelToken never;
    DIFFRACT_EXPECT_ERROR(engine_.run(r, {}, never), "':1..2)'", "not a number");
    r.prompt_syntax = job::PromptSyntax::Plain;  // read as text
    QCOMPARE(engine_.run(r, {}, never).images.size(), std::size_t(1));
  }

 private:
  engine::Engine engine_;
};

QTEST_GUILESS_MAIN(TestPromptSyntax)
#include "test_prompt_syntax.moc"
