// The ControlNet panel (folders, units with model, image, preprocessor, scale and steps; what a
// job, a preset and a restored PNG take from it) and the canny preprocessor, offscreen.
#include <QCheckBox>
#include <QComboBox>
#include <QPainter>
#include <QPushButton>
#include <QSignalSpy>
#include <QTemporaryDir>

#include "core/engine/controlnet_library.h"
#include "core/engine/output.h"
#include "core/engine/png_parameters.h"
#include "core/io/image.h"
#include "test_util.h"
#include "ui/control_preprocessors.h"
#include "ui/controlnet_panel.h"
#include "ui/engine_bridge.h"

using namespace diffract;
namespace fs = std::filesystem;

namespace {

QString controlnets() { return QString::fromStdString((test::fixtures() / "controlnet").string()); }
QString net(const char* name) { return QString::fromStdString((test::fixtures() / "controlnet" / name).string()); }

// A filled white rectangle on black, 50 px wide so that grey rows are padded in a QImage.
QImage square() {
  QImage img(50, 40, QImage::Format_RGB32);
  img.fill(Qt::black);
  QPainter p(&img);
  p.fillRect(QRect(10, 8, 24, 20), Qt::white);
  return img;
}

int white(const QImage& img, const QRect& area) {
  int n = 0;
  for (int y = area.top(); y <= area.bottom(); ++y)
    for (int x = area.left(); x <= area.right(); ++x) n += qRed(img.pixel(x, y)) == 255 ? 1 : 0;
  return n;
}

}  // namespace

class TestControlNetPanel : public QObject {
  Q_OBJECT
 private slots:
  void cannyFindsTheEdgesOnly() {
    const QImage e = ui::cannyEdges(square(), 100, 200);
    QCOMPARE(e.size(), QSize(50, 40));
    QCOMPARE(e.format(), QImage::Format_RGB888);
    for (int y = 0; y < e.height(); ++y)
      for (int x = 0; x < e.width(); ++x) {
        const QRgb c = e.pixel(x, y);
        QVERIFY(qRed(c) == qGreen(c) && qGreen(c) == qBlue(c));
        QVERIFY(qRed(c) == 0 || qRed(c) == 255);
      }
    // Edges on the rectangle's border (within a pixel), none inside it or away from it.
    const QRect rect(10, 8, 24, 20);
    const int total = white(e, e.rect());
    QVERIFY2(total >= 2 * (24 + 20) - 8, qPrintable(QString::number(total)));
    QCOMPARE(white(e, rect.adjusted(2, 2, -2, -2)), 0);
    QCOMPARE(total - white(e, rect.adjusted(-2, -2, 2, 2)), 0);
    // The thresholds decide: a faint square (40 on 0; its Sobel L1 gradient reaches 4 x 40 x 2 =
    // 320) is below 400 / 800 and found at 50 / 100. A flat image has no edges at all.
    QImage faint(50, 40, QImage::Format_RGB32);
    faint.fill(Qt::black);
    QPainter(&faint).fillRect(QRect(10, 8, 24, 20), QColor(40, 40, 40));
    QCOMPARE(white(ui::cannyEdges(faint, 400, 800), e.rect()), 0);
    QVERIFY(white(ui::cannyEdges(faint, 50, 100), e.rect()) > 60);
    QImage flat(33, 17, QImage::Format_RGB32);
    flat.fill(QColor(120, 30, 200));
    QCOMPARE(white(ui::cannyEdges(flat, 10, 20), flat.rect()), 0);
    QVERIFY(ui::cannyEdges(QImage(), 100, 200).isNull());
  }

  void controlImageIsMadeAtTheJobSize() {
    ui::ControlPreprocess canny{QStringLiteral("canny"), 100, 200};
    const QImage atJob = ui::controlImage(square(), canny, QSize(100, 80));
    QCOMPARE(atJob.size(), QSize(100, 80));
    QVERIFY(white(atJob, atJob.rect()) > 0);
    // "none" leaves the resizing to the core (Lanczos, as diffusers), so the image stays as given.
    const QImage asIs = ui::controlImage(square(), {}, QSize(100, 80));
    QCOMPARE(asIs.size(), QSize(50, 40));
    QCOMPARE(asIs.pixel(20, 20), square().pixel(20, 20));
  }

  void findsControlNetFolders() {
    const auto found = engine::find_controlnets({controlnets().toStdString()}, {});
    // Five folders, cn-sd-g32.safetensors, and lllyasviel's layout as .safetensors and .pth.
    QCOMPARE(found.size(), std::size_t(8));
    QCOMPARE(found[1].name, std::string("cn-sd-a"));
    QCOMPARE(found[1].base, std::string());  // a tiny test model: no family's cross-attention width
    QCOMPARE(found[4].name, std::string("cn-sd-g32.safetensors"));
    QCOMPARE(found[5].name, std::string("cn-sdxl"));
    QCOMPARE(found[5].base, std::string("SDXL"));
    QCOMPARE(found[6].name, std::string("control_tiny_sd15.safetensors"));
    QCOMPARE(found[7].name, std::string("control_tiny_v11.pth"));
    // The family from the config: SD 1.x's 768-wide and SD 2.x's 1024-wide cross-attention.
    QTemporaryDir tmp;
    for (const auto& [width, base] : {std::pair<int, const char*>{768, "SD 1.x"}, {1024, "SD 2.x"}}) {
      const auto d = fs::path(tmp.path().toStdString()) / std::to_string(width);
      fs::create_directories(d);
      std::ofstream(d / "config.json") << nlohmann::json{{"_class_name", "ControlNetModel"}, {"cross_attention_dim", width}}.dump();
      QCOMPARE(engine::read_controlnet_info(d).base, std::string(base));
    }
    // Not a ControlNet: a UNet folder, a missing folder.
    QVERIFY(engine::read_controlnet_info(test::fixtures() / "tiny-sd" / "unet").path.empty());
    QVERIFY(engine::find_controlnets({"/no/such/folder"}, {}).empty());
  }

  void unitsFillTheJob() {
    ui::ControlNetPanel panel;
    QSignalSpy folders(&panel, &ui::ControlNetPanel::foldersChanged);
    panel.setFolders({controlnets()});
    QCOMPARE(folders.count(), 1);
    QCOMPARE(panel.models().size(), 8);
    job::GenerationRequest r;
    r.width = 96;
    r.height = 64;
    QVERIFY(panel.fillRequest(r).isEmpty());  // no units: no ControlNet
    QVERIFY(r.controlnets.empty());

    QCOMPARE(panel.addUnit(), 0);
    ui::ControlNetPanel::Unit u;
    u.model = net("cn-sd-b");
    u.preprocess = {QStringLiteral("canny"), 50, 150};
    u.scale = 0.7;
    u.start = 0.1;
    u.end = 0.8;
    panel.setUnit(0, u);
    const QString error = panel.fillRequest(r);
    QVERIFY2(error.contains("unit 1") && error.contains("no control image"), qPrintable(error));
    panel.setImage(0, square(), "square");
    QVERIFY(panel.fillRequest(r).isEmpty());
    QCOMPARE(r.controlnets.size(), std::size_t(1));
    const auto& c = r.controlnets[0];
    QCOMPARE(QString::fromStdString(c.path), net("cn-sd-b"));
    QCOMPARE(c.scale, 0.7);
    QCOMPARE(c.start, 0.1);
    QCOMPARE(c.end, 0.8);
    // Canny ran at the job's size: the request's image is the preprocessed one, 96x64.
    QCOMPARE(c.image.width, 96);
    QCOMPARE(c.image.height, 64);
    QCOMPARE(ui::toQImage(c.image), panel.controlImage(0, QSize(96, 64)));

    // A second unit turned off is not in the job; removing the first leaves the second.
    QCOMPARE(panel.addUnit(), 1);
    auto off = panel.unit(1);
    off.enabled = false;
    panel.setUnit(1, off);
    QVERIFY(panel.fillRequest(r).isEmpty());
    QCOMPARE(r.controlnets.size(), std::size_t(1));
    QCOMPARE(panel.requestUnits().size(), std::size_t(1));
    while (panel.addUnit() >= 0) {
    }
    QCOMPARE(panel.unitCount(), ui::ControlNetPanel::kMaxUnits);
    QVERIFY(!panel.findChild<QPushButton*>("controlNetAddUnit")->isEnabled());
    panel.removeUnit(0);
    QCOMPARE(panel.unitCount(), ui::ControlNetPanel::kMaxUnits - 1);
    QVERIFY(!panel.unit(0).enabled);
    QVERIFY(panel.findChild<QPushButton*>("controlNetAddUnit")->isEnabled());
  }

  void badImagesAreNamed() {
    ui::ControlNetPanel panel;
    panel.addUnit();
    QTemporaryDir dir;
    const QString text = dir.filePath("notes.png");
    QFile f(text);
    QVERIFY(f.open(QIODevice::WriteOnly));
    f.write("not an image");
    f.close();
    QString error;
    QVERIFY(!panel.loadImage(0, text, &error));
    QVERIFY2(error.contains("unit 1") && error.contains("notes.png"), qPrintable(error));
    QVERIFY(panel.sourceImage(0).isNull());
    QVERIFY(!panel.loadImage(0, dir.filePath("missing.png"), &error));
    // The unit still has a model (the first found) but no image: the job says so.
    panel.setFolders({controlnets()});
    job::GenerationRequest r;
    QVERIFY(panel.fillRequest(r).contains("no control image"));
    // No model at all.
    ui::ControlNetPanel empty;
    empty.addUnit();
    empty.setImage(0, square(), "square");
    QVERIFY(empty.fillRequest(r).contains("no model"));
  }

  void presetsKeepTheUnits() {
    ui::ControlNetPanel panel;
    panel.setFolders({controlnets()});
    panel.addUnit();
    ui::ControlNetPanel::Unit u;
    u.model = net("cn-sd-a");
    u.preprocess = {QStringLiteral("canny"), 40, 90};
    u.scale = 1.25;
    u.start = 0.2;
    u.end = 0.6;
    panel.setUnit(0, u);
    const auto saved = panel.presetControlNets();
    QCOMPARE(saved.size(), std::size_t(1));
    // Through the preset file's JSON and back.
    engine::Preset p;
    p.name = "edges";
    p.controlnets = saved;
    const auto back = engine::parse_preset(engine::preset_to_json(p), "edges.json");
    ui::ControlNetPanel other;
    other.setFolders({controlnets()});
    QStringList missing;
    other.applyPreset(back.controlnets, missing);
    QVERIFY(missing.isEmpty());
    QCOMPARE(other.unitCount(), 1);
    const auto got = other.unit(0);
    QCOMPARE(got.model, u.model);
    QCOMPARE(got.preprocess.name, QStringLiteral("canny"));
    QCOMPARE(got.preprocess.low, 40);
    QCOMPARE(got.preprocess.high, 90);
    QCOMPARE(got.scale, 1.25);
    QCOMPARE(got.start, 0.2);
    QCOMPARE(got.end, 0.6);
    // A model that is gone is kept in the unit and listed.
    auto gone = back.controlnets;
    gone[0].model = "/no/such/controlnet";
    other.applyPreset(gone, missing);
    QCOMPARE(missing.size(), 1);
    QVERIFY(missing[0].contains("/no/such/controlnet"));
    QCOMPARE(other.unit(0).model, QStringLiteral("/no/such/controlnet"));
  }

  void pngKeepsTheControlImage() {
    QTemporaryDir dir;
    ui::ControlNetPanel panel;
    panel.setFolders({controlnets()});
    panel.addUnit();
    ui::ControlNetPanel::Unit u;
    u.model = net("cn-sd-a");
    u.preprocess = {QStringLiteral("canny"), 100, 200};
    u.scale = 0.5;
    panel.setUnit(0, u);
    panel.setImage(0, square(), "square");
    job::GenerationRequest r;
    r.width = r.height = 64;
    QVERIFY(panel.fillRequest(r).isEmpty());
    // What the window does once the job is done: the pipeline's metadata, the control image
    // written beside the PNG, the preprocessor added.
    const nlohmann::json meta = {{"prompt", "a cup"},
                                 {"controlnets", {{{"path", u.model.toStdString()}, {"scale", 0.5}, {"start", 0.0}, {"end", 1.0}}}}};
    const auto png = fs::path(dir.path().toStdString()) / "out.png";
    const std::string written = ui::ControlNetPanel::addPreprocessors(
        engine::save_inputs_beside(png, {}, r.controlnets, meta.dump()), panel.requestUnits());
    engine::save_image(png, io::Image{8, 8, std::vector<std::uint8_t>(8 * 8 * 3, 9)}, "", written);
    QVERIFY(fs::exists(fs::path(dir.path().toStdString()) / "inputs" / "out.control1.png"));
    const auto p = engine::read_png_parameters(png);
    QCOMPARE(p.controlnets.size(), std::size_t(1));
    QCOMPARE(p.controlnets[0].image_file, std::string("inputs/out.control1.png"));
    QCOMPARE(p.controlnets[0].preprocessor, std::string("canny"));
    QCOMPARE(p.controlnets[0].scale, 0.5);

    ui::ControlNetPanel restored;
    restored.setFolders({controlnets()});
    QStringList ok, notOk;
    restored.restore(p, QDir(dir.path()), ok, notOk);
    QVERIFY2(notOk.isEmpty(), qPrintable(notOk.join("; ")));
    QCOMPARE(ok, QStringList{"ControlNet unit 1"});
    QCOMPARE(restored.unitCount(), 1);
    QCOMPARE(restored.unit(0).model, u.model);
    QCOMPARE(restored.unit(0).preprocess.name, QStringLiteral("none"));  // the saved image is the edges
    QCOMPARE(restored.unit(0).scale, 0.5);
    // The job made again gets the very image the first one had.
    job::GenerationRequest again;
    again.width = again.height = 64;
    QVERIFY(restored.fillRequest(again).isEmpty());
    QCOMPARE(again.controlnets[0].image.rgb, r.controlnets[0].image.rgb);

    // The image file gone: the unit comes back off, and says why.
    fs::remove(fs::path(dir.path().toStdString()) / "inputs" / "out.control1.png");
    ok.clear();
    restored.restore(p, QDir(dir.path()), ok, notOk);
    QCOMPARE(notOk.size(), 1);
    QVERIFY2(notOk[0].contains("out.control1.png is missing"), qPrintable(notOk[0]));
    QVERIFY(!restored.unit(0).enabled);
  }
};

QTEST_MAIN(TestControlNetPanel)
#include "test_controlnet_panel.moc"
