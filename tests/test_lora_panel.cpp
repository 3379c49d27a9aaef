// The LoRA panel (folders, rows with enable box, weight and trigger words, what a job and a
// restored PNG take from it) and the prompt editor's weights and token counts, offscreen.
#include <QCheckBox>
#include <QLabel>
#include <QPushButton>
#include <QSignalSpy>
#include <QTemporaryDir>
#include <QTextDocument>
#include <fstream>

#include "core/engine/lora_library.h"
#include "core/text/clip_tokenizer.h"
#include "test_util.h"
#include "ui/lora_panel.h"
#include "ui/prompt_highlighter.h"

using namespace diffract;
namespace fs = std::filesystem;

class TestLoraPanel : public QObject {
  Q_OBJECT
 private slots:
  void initTestCase() {
    QVERIFY(m_dir.isValid());
    const auto from = test::fixtures() / "lora";
    fs::create_directories(fs::path(m_dir.path().toStdString()) / "styles");
    for (const char* f : {"sd-a-kohya.safetensors", "sd-b-kohya.safetensors"})
      fs::copy_file(from / f, fs::path(m_dir.path().toStdString()) / "styles" / f);
    fs::copy_file(from / "sd-a-peft.safetensors", fs::path(m_dir.path().toStdString()) / "product.safetensors");
  }

  // The LoRAs shipped beside the embedded model are listed on first start, before any folder,
  // and a prompt's tag finds them (the engine looks there after the request's folders).
  void listsTheShippedLoras() {
    QTemporaryDir shipped;
    const fs::path root = shipped.path().toStdString();
    fs::create_directories(root / "diffract-emoji");
    std::ofstream(root / "diffract-emoji" / "model_index.json") << "{}";
    fs::create_directories(root / "loras");
    fs::copy_file(test::fixtures() / "lora" / "sd-a-peft.safetensors", root / "loras" / "outline.safetensors");
    const QByteArray before = qgetenv("DIFFRACT_EMBEDDED_MODEL");
    qputenv("DIFFRACT_EMBEDDED_MODEL", QByteArray::fromStdString((root / "diffract-emoji").string()));
    {
      ui::LoraPanel panel;
      QCOMPARE(panel.names(), QStringList{"outline"});
      QVERIFY(panel.findChild<QLabel*>("loraSummary")->text().contains("shipped with Diffract"));
      panel.setFolders({m_dir.path()});
      QCOMPARE(panel.count(), 4);
      job::GenerationRequest r;
      r.prompt = "a bottle <lora:outline:0.5>";
      engine::resolve_lora_tags(r);
      QCOMPARE(r.loras.size(), std::size_t(1));
      QCOMPARE(fs::path(r.loras[0].path), root / "loras" / "outline.safetensors");
      QCOMPARE(r.loras[0].weight, 0.5);
    }
    qputenv("DIFFRACT_EMBEDDED_MODEL", before);
  }

  void listsFoldersAndTriggers() {
    ui::LoraPanel panel;
    QCOMPARE(panel.count(), 0);
    QSignalSpy folders(&panel, &ui::LoraPanel::foldersChanged);
    panel.setFolders({m_dir.path()});
    QCOMPARE(folders.count(), 1);
    QCOMPARE(panel.count(), 3);
    QCOMPARE(panel.names(), (QStringList{"product", "sd-a-kohya", "sd-b-kohya"}));
    // ss_tag_frequency summed over the dataset folders, most frequent first, spaces trimmed.
    QCOMPARE(panel.triggerWords("SD-B-kohya"), (QStringList{"brandx", "studio", "red bottle"}));
    QVERIFY(panel.triggerWords("sd-a-kohya").isEmpty());
    QSignalSpy insert(&panel, &ui::LoraPanel::insertText);
    auto* button = panel.findChild<QWidget*>("loraRow_sd-b-kohya")->findChild<QPushButton*>("loraInsertTriggers");
    QVERIFY(button);
    button->click();
    QCOMPARE(insert.count(), 1);
    QCOMPARE(insert.at(0).at(0).toString(), QString("brandx"));
  }

  void fillsTheJob() {
    ui::LoraPanel panel;
    panel.setFolders({m_dir.path()});
    QVERIFY(panel.enable("sd-b-kohya", true, 0.6));
    QVERIFY(panel.enable("product", true, 2.5));  // clamped to 2
    QVERIFY(!panel.enable("nothing", true));
    job::GenerationRequest r;
    r.prompt = "a bottle <lora:product:0.3>";  // the tag's weight wins over the row's
    panel.fillRequest(r);
    QCOMPARE(r.lora_dirs, std::vector<std::string>{m_dir.path().toStdString()});
    QCOMPARE(r.loras.size(), std::size_t(1));
    QCOMPARE(r.loras[0].name, std::string("sd-b-kohya"));
    QCOMPARE(r.loras[0].weight, 0.6);
    QVERIFY(fs::exists(r.loras[0].path));
    QCOMPARE(panel.weight("product"), 2.0);
    // A rescan keeps what was set.
    panel.refresh();
    QVERIFY(panel.isEnabled("sd-b-kohya"));
    QCOMPARE(panel.weight("sd-b-kohya"), 0.6);
  }

  void restoresFromPng() {
    ui::LoraPanel panel;
    panel.setFolders({m_dir.path()});
    engine::PngParameters p;
    p.prompt = "a bottle <lora:product:0.5>";
    p.loras = {{"sd-a-kohya", "/elsewhere/sd-a-kohya.safetensors", 0.3, 0.3},
               {"product", "/x/product.safetensors", 0.5, 0.5},
               {"", "/gone/brand-v2.safetensors", 1.0, 1.0}};
    QStringList restored, notRestored;
    QCOMPARE(panel.restore(p, restored, notRestored), QString("a bottle <lora:product:0.5>"));
    QVERIFY(panel.isEnabled("sd-a-kohya"));
    QCOMPARE(panel.weight("sd-a-kohya"), 0.3);
    QVERIFY(!panel.isEnabled("product"));  // the prompt's tag brings it
    QCOMPARE(restored, QStringList{"LoRA sd-a-kohya"});
    QCOMPARE(notRestored, QStringList{"LoRA brand-v2 (not in the LoRA folders)"});
  }

  // A tag naming a file renamed since: found by the PNG's "Lora hashes", the tag rewritten.
  void restoresByHash() {
    const auto hash = engine::lora_short_hash(test::fixtures() / "lora" / "sd-a-peft.safetensors");
    if (hash.empty()) QSKIP("this build has no OpenSSL: no LoRA hashes");
    ui::LoraPanel panel;
    panel.setFolders({m_dir.path()});
    engine::PngParameters p;
    p.prompt = "a bottle <lora:brand-v1:0.7>, <lora:lost:1>";
    p.lora_hashes = {{"brand-v1", hash}, {"lost", "0123456789ab"}};
    QStringList restored, notRestored;
    QCOMPARE(panel.restore(p, restored, notRestored), QString("a bottle <lora:product:0.7>, <lora:lost:1>"));
    QCOMPARE(restored, QStringList{"LoRA brand-v1 (found by its hash as product)"});
    QCOMPARE(notRestored, QStringList{"LoRA lost (not in the LoRA folders, hash 0123456789ab)"});
  }

  void highlighterWeights() {
    QTextDocument doc;
    ui::PromptHighlighter h(&doc);
    const QString text = QString::fromUtf8("é (red:1.5) [b] BREAK c <lora:x:1>");
    doc.setPlainText(text);
    QCOMPARE(h.weightAt(0), 1.0);                                   // é
    QCOMPARE(h.weightAt(text.indexOf("red")), 1.5);
    QCOMPARE(h.weightAt(text.indexOf("(")), 0.0);                   // syntax
    QVERIFY(std::abs(h.weightAt(text.indexOf("b]")) - 1 / 1.1) < 1e-9);
    QCOMPARE(h.weightAt(text.indexOf("BREAK")), -1.0);
    QCOMPARE(h.weightAt(text.indexOf("lora")), -2.0);
    QCOMPARE(h.weightAt(text.indexOf("c <")), 1.0);
    doc.setPlainText("(a:1.2.3)");
    QCOMPARE(h.weightAt(1), 1.0);  // a parse error leaves the text plain; the job names the error
  }

  void tokenCounts() {
    const auto tok = text::CLIPTokenizer::from_folder(test::fixtures() / "tiny-sd" / "tokenizer");
    QCOMPARE(ui::promptTokenSummary(tok, "a red apple"), QString("3 / 75 tokens"));
    QCOMPARE(ui::promptTokenSummary(tok, "a red apple BREAK on a table <lora:x:1>"),
             QString("6 tokens in 2 chunks (3 + 3), 1 LoRA tag(s)"));
    QString longer;
    for (int i = 0; i < 40; ++i) longer += "red apple, ";
    QVERIFY(ui::promptTokenSummary(tok, longer).contains("in 2 chunks"));
    QVERIFY(ui::promptTokenSummary(tok, "(a:1.2.3)").contains("not a number"));
  }

 private:
  QTemporaryDir m_dir;
};

QTEST_MAIN(TestLoraPanel)
#include "test_lora_panel.moc"
