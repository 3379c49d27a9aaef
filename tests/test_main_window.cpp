// The main window driven like a user would: fields, buttons, shortcuts, live view, timings.
#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QGroupBox>
#include <QElapsedTimer>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QScrollBar>
#include <QScrollArea>
#include <QFileInfo>
#include <QSettings>
#include <QSignalSpy>
#include <QSlider>
#include <QSpinBox>
#include <QStandardPaths>
#include <QTemporaryDir>
#include <QTimer>
#include <QWheelEvent>

#include <QApplication>
#include <QDoubleSpinBox>
#include <QDropEvent>
#include <QListWidget>
#include <QMimeData>
#include <QTableWidget>
#include <QUrl>
#include <nlohmann/json.hpp>

#include "core/engine/devices.h"
#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/io/image.h"
#include "core/pipeline/image_processor.h"
#include "masked_change.h"
#include "test_util.h"
#include "window_test_util.h"
#include "ui/compare_view.h"
#include "ui/controlnet_panel.h"
#include "ui/gallery.h"
#include "ui/image_view.h"
#include "ui/input_panel.h"
#include "core/engine/model_discovery.h"
#include "ui/main_window.h"
#include "ui/mask_editor.h"
#include "ui/timings_chart.h"

using namespace diffract;
using diffract::ui::EngineBridge;
using diffract::ui::MainWindow;

namespace {

using test::child;
using test::setUpJob;
using test::tinyModel;

std::filesystem::path shippedPresets() {
  const char* d = std::getenv("DIFFRACT_PRESETS_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::path("presets");
}

QString imageFixture(const char* name) {
  return QString::fromStdString((test::fixtures() / "image" / name).string());
}

// The window on show with a 3-step job on the tiny model, `prompt`, and the photo fixture as input.
void setUpPhotoJob(MainWindow& w, const char* prompt) {
  w.show();
  if (!QTest::qWaitForWindowExposed(&w)) qFatal("the window was not exposed");
  setUpJob(w, 3);
  w.findChild<QPlainTextEdit*>("promptEdit")->setPlainText(QString::fromLatin1(prompt));
  QString error;
  if (!w.inputPanel()->loadFile(imageFixture("photo.png"), &error)) qFatal("photo.png: %s", qPrintable(error));
}

// Runs the job the fields describe; returns its first image (fails the test on an error).
QImage runJob(MainWindow& w) {
  QSignalSpy finished(w.bridge(), &EngineBridge::finished);
  QSignalSpy failed(w.bridge(), &EngineBridge::failed);
  QTest::mouseClick(w.findChild<QPushButton*>("generateButton"), Qt::LeftButton);
  if (!QTest::qWaitFor([&] { return finished.count() + failed.count() > 0; }, 180000)) qFatal("the job never ended");
  if (!failed.isEmpty()) qFatal("the job failed: %s", qPrintable(failed[0][0].toString()));
  return finished[0][0].value<QList<QImage>>().front();
}

QString pngFixture(const char* name) {
  return QString::fromStdString((test::fixtures() / "png_parameters" / name).string());
}

// Drags `mime` over the window and drops it, as the platform's drag and drop would.
bool dropOnto(MainWindow& w, QMimeData* mime) {
  const QPoint pos = w.rect().center();
  QDragEnterEvent enter(pos, Qt::CopyAction, mime, Qt::LeftButton, Qt::NoModifier);
  QApplication::sendEvent(&w, &enter);
  if (!enter.isAccepted()) return false;
  QDropEvent drop(QPointF(pos), Qt::CopyAction, mime, Qt::LeftButton, Qt::NoModifier);
  QApplication::sendEvent(&w, &drop);
  return drop.isAccepted();
}

// Drops a file URL and waits for the restore to finish; returns whether it succeeded.
bool dropFile(MainWindow& w, const QString& path) {
  QSignalSpy done(&w, &MainWindow::restoreFinished);
  QMimeData mime;
  mime.setUrls({QUrl::fromLocalFile(path)});
  if (!dropOnto(w, &mime)) qFatal("the window refused a file drop");
  if (!done.wait(10000)) qFatal("no restoreFinished after dropping %s", qPrintable(path));
  return done.first().first().toBool();
}

}  // namespace

class TestMainWindow : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

  QString outDir() const { return m_tmp.filePath("out"); }

 private slots:
  void initTestCase() {
    QVERIFY(m_tmp.isValid());
    QStandardPaths::setTestModeEnabled(true);  // QSettings go to a test location
    QCoreApplication::setOrganizationName("DiffractTests");
    QCoreApplication::setApplicationName("test_main_window");
    qputenv("DIFFRACT_OUTPUT_DIR", outDir().toLocal8Bit());
    // A Hugging Face cache with one diffusers model and one repository that is not one.
    const QString hub = m_tmp.filePath("hub");
    QVERIFY(QDir().mkpath(hub + "/models--acme--tiny-diffusion/snapshots/abc123"));
    QVERIFY(QDir().mkpath(hub + "/models--acme--bert/snapshots/def456"));
    QFile index(hub + "/models--acme--tiny-diffusion/snapshots/abc123/model_index.json");
    QVERIFY(index.open(QIODevice::WriteOnly));
    index.write("{}");
    index.close();
    // madebyollin's TAESD for SDXL (a diffusers AutoencoderTiny: config.json, no model_index.json).
    QVERIFY(QDir().mkpath(hub + "/models--madebyollin--taesdxl/snapshots/s1"));
    QFile taesd(hub + "/models--madebyollin--taesdxl/snapshots/s1/config.json");
    QVERIFY(taesd.open(QIODevice::WriteOnly));
    taesd.write("{}");
    taesd.close();
    qputenv("HF_HUB_CACHE", hub.toLocal8Bit());
  }

  void init() {
    QSettings().clear();
    QDir(MainWindow::userPresetDir()).removeRecursively();
  }

  void firstStartSaysWhatToDo() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    auto* hint = child<QLabel>(w, "hintLabel");
    QVERIFY(hint->isVisible());
    QVERIFY(hint->text().contains("model", Qt::CaseInsensitive));
    QVERIFY(child<QLabel>(w, "buildInfoLabel")->text().contains("LibTorch 2.11"));
    QVERIFY(!child<QPushButton>(w, "cancelButton")->isEnabled());
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    auto* error = child<QLabel>(w, "errorLabel");
    QVERIFY(error->isVisible());
    QVERIFY(error->text().contains("Choose a model"));
    QVERIFY(!w.bridge()->isRunning());
    child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
    QVERIFY(!hint->isVisible());
  }

  // Settings that cannot be written (a full disk, a read-only file; here a folder where the file
  // goes) are said in the window, the job runs anyway, and the next save that works clears it.
  void unwritableSettingsAreSaidNotLost() {
    const QString file = QSettings().fileName();
    QFile::remove(file);
    QVERIFY(QDir().mkpath(file));  // QSettings cannot rename its temporary file over a folder
    {
      MainWindow w;
      w.show();
      QVERIFY(QTest::qWaitForWindowExposed(&w));
      child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
      QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
      auto* warning = child<QLabel>(w, "settingsWarning");
      QVERIFY(warning->isVisible());
      QVERIFY2(warning->text().contains(file) && warning->text().contains("disk full"), qPrintable(warning->text()));
      QTRY_VERIFY_WITH_TIMEOUT(!w.bridge()->isRunning(), 60000);
      QVERIFY(!child<QLabel>(w, "errorLabel")->isVisible());  // the job ran
      QVERIFY(QDir(file).removeRecursively());
      QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
      QVERIFY(!warning->isVisible());
      QTRY_VERIFY_WITH_TIMEOUT(!w.bridge()->isRunning(), 60000);
    }
    QCOMPARE(QSettings().value("model").toString(), tinyModel());
  }

  // With an embedded model (the shipped diffract-emoji) the first start opens with it selected.
  void firstStartSelectsTheEmbeddedModel() {
    const QString embedded = m_tmp.filePath("embedded/diffract-emoji");
    QVERIFY(QDir().mkpath(embedded));
    QFile index(embedded + "/model_index.json");
    QVERIFY(index.open(QIODevice::WriteOnly));
    index.write("{}");
    index.close();
    const QByteArray before = qgetenv("DIFFRACT_EMBEDDED_MODEL");
    qputenv("DIFFRACT_EMBEDDED_MODEL", embedded.toLocal8Bit());
    {
      MainWindow w;
      w.show();
      QVERIFY(QTest::qWaitForWindowExposed(&w));
      QCOMPARE(QFileInfo(child<QLineEdit>(w, "modelEdit")->text()).canonicalFilePath(), QFileInfo(embedded).canonicalFilePath());
      QVERIFY(!child<QLabel>(w, "hintLabel")->isVisible());
      // After choosing another model, the models menu leads back to the embedded one.
      child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
      auto* combo = child<QComboBox>(w, "discoveredModelsCombo");
      const int last = combo->count() - 1;
      QCOMPARE(combo->itemText(last), QStringLiteral("diffract-emoji (embedded)"));
      combo->activated(last);
      QCOMPARE(QFileInfo(child<QLineEdit>(w, "modelEdit")->text()).canonicalFilePath(), QFileInfo(embedded).canonicalFilePath());
    }
    qputenv("DIFFRACT_EMBEDDED_MODEL", before);
  }

  void taesdFollowsTheModelFamily() {
    auto folder = [&](const QString& name, const QByteArray& pipeline) {
      const QString dir = m_tmp.filePath(name);
      QDir().mkpath(dir);
      QFile index(dir + "/model_index.json");
      index.open(QIODevice::WriteOnly);
      index.write("{\"_class_name\": \"" + pipeline + "\"}");
      return dir;
    };
    const QString sdxl = folder("family/sdxl", "StableDiffusionXLPipeline");
    const QString sd15 = folder("family/sd15", "StableDiffusionPipeline");
    MainWindow w;
    auto* model = child<QLineEdit>(w, "modelEdit");
    auto* taesd = child<QLineEdit>(w, "taesdEdit");
    model->setText(sdxl);
    QVERIFY2(taesd->text().endsWith("models--madebyollin--taesdxl/snapshots/s1"), qPrintable(taesd->text()));
    model->setText(sd15);  // no SD 1.x TAESD in the cache: the matched one goes
    QCOMPARE(taesd->text(), QString());
    model->setText(sdxl);
    QVERIFY(!taesd->text().isEmpty());
    taesd->setText("/my/taesd");  // the user's choice stays whatever the model
    model->setText(sd15);
    QCOMPARE(taesd->text(), QStringLiteral("/my/taesd"));
    QCOMPARE(MainWindow::matchingTaesd(m_tmp.filePath("nowhere")), QString());
  }

  // Flux.1-dev's distilled guidance: a field of its own, enabled for Flux models, in the request.
  void guidanceFieldFollowsTheModel() {
    const auto folder = [&](const QString& name, const QByteArray& pipeline) {
      const QString dir = m_tmp.filePath(name);
      QDir().mkpath(dir);
      QFile index(dir + "/model_index.json");
      index.open(QIODevice::WriteOnly);
      index.write("{\"_class_name\": \"" + pipeline + "\"}");
      return dir;
    };
    MainWindow w;
    auto* model = child<QLineEdit>(w, "modelEdit");
    auto* guidance = child<QDoubleSpinBox>(w, "guidanceSpin");
    model->setText(folder("guidance/flux", "FluxPipeline"));
    QVERIFY(guidance->isEnabled());
    guidance->setValue(5.0);
    QCOMPARE(w.requestFromFields().guidance, 5.0);
    auto* t5 = child<QComboBox>(w, "t5PlacementCombo");
    QVERIFY(t5->isEnabled());
    t5->setCurrentIndex(t5->findData(QStringLiteral("offload")));
    QCOMPARE(w.requestFromFields().t5_placement, std::string("offload"));
    t5->setCurrentIndex(0);
    model->setText(folder("guidance/sdxl", "StableDiffusionXLPipeline"));
    QVERIFY(!guidance->isEnabled());
    QVERIFY(!t5->isEnabled());
    // The First-Block Cache's threshold shows with its strategy and goes into the request.
    auto* strategy = child<QComboBox>(w, "strategyCombo");
    auto* threshold = child<QDoubleSpinBox>(w, "cacheThresholdSpin");
    strategy->setCurrentIndex(strategy->findData(QStringLiteral("fbcache")));
    QVERIFY(!threshold->isHidden());
    // Each step cache brings its own default threshold until the user sets one.
    QCOMPARE(threshold->value(), 0.12);
    strategy->setCurrentIndex(strategy->findData(QStringLiteral("teacache")));
    QCOMPARE(threshold->value(), 0.4);
    QCOMPARE(w.requestFromFields().strategy.cache_threshold, 0.4);
    strategy->setCurrentIndex(strategy->findData(QStringLiteral("fbcache")));
    QCOMPARE(threshold->value(), 0.12);
    threshold->setValue(0.2);
    QCOMPARE(w.requestFromFields().strategy.cache_threshold, 0.2);
    strategy->setCurrentIndex(strategy->findData(QStringLiteral("teacache")));
    QCOMPARE(threshold->value(), 0.2);  // the user's value stays
    strategy->setCurrentIndex(0);
    QVERIFY(threshold->isHidden());
    QVERIFY(guidance->toolTip().contains("Flux.1-dev"));
  }

  void discoversTheHuggingFaceCache() {
    const QStringList found = MainWindow::discoverHuggingFaceModels();
    QCOMPARE(found.size(), 1);
    QVERIFY(found[0].endsWith("models--acme--tiny-diffusion/snapshots/abc123"));
    MainWindow w;
    auto* combo = child<QComboBox>(w, "discoveredModelsCombo");
    QCOMPARE(combo->count(), 2);
    QCOMPARE(combo->itemText(1), QStringLiteral("acme/tiny-diffusion"));
  }

  void generatesWithLivePreviewsAndSaves() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 6);
    QTest::keyClicks(child<QPlainTextEdit>(w, "promptEdit"), "a red apple");
    QSignalSpy previews(w.bridge(), &EngineBridge::previewReady);
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    QSignalSpy failed(w.bridge(), &EngineBridge::failed);
    auto* view = child<ui::ImageView>(w, "imageView");
    int previewsShown = 0;
    connect(w.bridge(), &EngineBridge::previewReady, this, [&] {
      QVERIFY(!view->isFinal());  // runs after the window's slot: the preview is on show
      ++previewsShown;
    });

    // The chart fills in bar by bar and the status line counts steps while the job runs.
    auto* chart = child<ui::TimingsChart>(w, "timingsChart");
    QList<int> barsSeen;
    QStringList statusSeen;
    connect(w.bridge(), &EngineBridge::stepDone, this, [&] {
      barsSeen << chart->barCount();
      statusSeen << child<QLabel>(w, "statusLabel")->text();
    });
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    QVERIFY(w.bridge()->isRunning());
    QVERIFY(child<QPushButton>(w, "cancelButton")->isEnabled());
    QTRY_COMPARE_WITH_TIMEOUT(finished.count() + failed.count(), 1, 180000);
    QVERIFY2(failed.isEmpty(), failed.isEmpty() ? "" : qPrintable(failed[0][0].toString()));
    QCOMPARE(previews.count(), 6);
    QCOMPARE(previewsShown, 6);

    // The final render replaces the preview.
    const auto images = finished[0][0].value<QList<QImage>>();
    QVERIFY(view->isFinal());
    QCOMPARE(view->image().size(), QSize(64, 64));
    QCOMPARE(view->image(), images[0]);

    QCOMPARE(barsSeen, (QList<int>{1, 2, 3, 4, 5, 6}));
    QVERIFY2(statusSeen.first().startsWith("Step 1/6 · ") && statusSeen.first().contains(" it/s · ETA "),
             qPrintable(statusSeen.first()));
    QVERIFY(statusSeen.last().startsWith("Step 6/6"));
    QCOMPARE(chart->totalSteps(), 6);
    QCOMPARE(chart->barCount(), 6);
    const QString rows = chart->rows().join('\n');
    QVERIFY2(rows.contains("text encode: ") && rows.contains("VAE decode: ") && rows.contains("preview decode: ") &&
                 rows.contains("total: ") && !rows.contains("total: –"),
             qPrintable(rows));
    QVERIFY(child<QLabel>(w, "statusLabel")->text().startsWith("Done"));
    QVERIFY(!child<QPushButton>(w, "cancelButton")->isEnabled());

    // Saved with its parameters.
    QCOMPARE(w.results().size(), 1);
    QCOMPARE(w.results()[0].timings.stepMs.size(), 6);
    const QString saved = w.results()[0].savedPath;
    QVERIFY(saved.startsWith(outDir()));
    io::PngText text;
    const auto png = io::read_png(saved.toStdString(), &text);
    QCOMPARE(png.width, 64);
    QCOMPARE(ui::toQImage(png), images[0].convertToFormat(QImage::Format_RGB888));
    std::map<std::string, std::string> chunks(text.begin(), text.end());
    QVERIFY(chunks["parameters"].find("a red apple") != std::string::npos);
    QVERIFY(chunks["parameters"].find("Seed: 5") != std::string::npos);
    QVERIFY(chunks["diffract"].find("\"timings_ms\"") != std::string::npos);
  }

  void devicesPanelShowsTheCpuWithoutAGpu() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    // The GPUs are listed off the GUI thread; the panel says so until the list arrives.
    auto* summary = child<QLabel>(w, "deviceSummaryLabel");
    QTRY_VERIFY2(!summary->text().contains("Looking for GPUs"), qPrintable(summary->text()));
    const auto gpus = engine::list_devices();
    auto* panel = child<QGroupBox>(w, "devicesGroup");
    QCOMPARE(panel->findChildren<QCheckBox*>().size(), static_cast<qsizetype>(gpus.size()));
    if (!gpus.empty()) QSKIP("this machine has a GPU; the fake-GPU cases below cover the panel");
    auto* cpu = child<QLabel>(w, "cpuDeviceLabel");
    QVERIFY(cpu->isVisible());
    QCOMPARE(cpu->text(), QStringLiteral("CPU"));
    QVERIFY(w.enabledGpus().empty());
    setUpJob(w, 2);
    auto request = w.requestFromFields();
    QCOMPARE(request.device, std::string("cpu"));
    QCOMPARE(request.strategy.devices, 1);
    // Without a GPU the device count is the CPU's virtual devices.
    child<QComboBox>(w, "strategyCombo")->setCurrentIndex(child<QComboBox>(w, "strategyCombo")->findData("driffusion"));
    child<QSpinBox>(w, "devicesSpin")->setValue(3);
    request = w.requestFromFields();
    QCOMPARE(request.device, std::string("cpu"));
    QCOMPARE(request.strategy.name, std::string("driffusion"));
    QCOMPARE(request.strategy.devices, 3);
    QVERIFY2(child<QLabel>(w, "deviceSummaryLabel")->text().contains("CPU as 3 virtual devices"),
             qPrintable(child<QLabel>(w, "deviceSummaryLabel")->text()));
    // Patches count only for the PipeFusion strategies.
    auto* patches = child<QSpinBox>(w, "patchesSpin");
    QVERIFY(!patches->isEnabled());
    patches->setValue(4);
    QCOMPARE(w.requestFromFields().strategy.patches, 0);
    for (const char* name : {"pipefusion", "cfg-pipefusion"}) {
      child<QComboBox>(w, "strategyCombo")->setCurrentIndex(child<QComboBox>(w, "strategyCombo")->findData(name));
      QVERIFY(patches->isEnabled());
      QCOMPARE(w.requestFromFields().strategy.patches, 4);
    }
    patches->setValue(0);
    QCOMPARE(patches->text(), QStringLiteral("auto"));
    QCOMPARE(w.requestFromFields().strategy.patches, 0);
  }

  void gpuTogglesDecideTheRequestAndPersist() {
    const std::vector<engine::DeviceInfo> fakes = {{"Fake GPU A", 0, 80ull << 30, 3ull << 30},
                                                   {"Fake GPU B", 1, 80ull << 30, 0}};
    {
      MainWindow w;
      QVERIFY(child<QLabel>(w, "deviceSummaryLabel")->text().contains("Looking for GPUs"));
      w.setDevices(fakes);
      QTest::qWait(300);  // the listing started by the constructor ends meanwhile: the given list wins
      auto* a = child<QCheckBox>(w, "gpuCheck0");
      auto* b = child<QCheckBox>(w, "gpuCheck1");
      QVERIFY(a->text().contains("cuda:0 Fake GPU A · 80.0 GiB, 3.0 GiB in use"));
      QVERIFY(a->isChecked() && b->isChecked());  // every GPU starts enabled
      QVERIFY(!child<QLabel>(w, "cpuDeviceLabel")->isVisibleTo(&w));
      setUpJob(w, 2);
      auto* strategy = child<QComboBox>(w, "strategyCombo");
      strategy->setCurrentIndex(strategy->findData("cfg-parallel"));
      auto request = w.requestFromFields();
      QCOMPARE(request.device, std::string("cuda:0"));
      QCOMPARE(request.strategy.devices, 2);
      a->setChecked(false);
      strategy->setCurrentIndex(strategy->findData("single"));
      request = w.requestFromFields();
      QCOMPARE(request.device, std::string("cuda:1"));
      QCOMPARE(request.strategy.devices, 1);
      b->setChecked(false);
      QCOMPARE(w.requestFromFields().device, std::string("cpu"));
      b->setChecked(true);
    }
    MainWindow again;
    again.setDevices(fakes);
    QVERIFY(!child<QCheckBox>(again, "gpuCheck0")->isChecked());
    QVERIFY(child<QCheckBox>(again, "gpuCheck1")->isChecked());
    QCOMPARE(again.requestFromFields().device, std::string("cuda:1"));
  }

  void cfgParallelOnOneGpuIsAReadableError() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    w.setDevices({{"Fake GPU", 0, 24ull << 30, 1ull << 30}});
    setUpJob(w, 2);
    auto* strategy = child<QComboBox>(w, "strategyCombo");
    strategy->setCurrentIndex(strategy->findData("cfg-parallel"));
    QVERIFY(child<QLabel>(w, "deviceSummaryLabel")->text().contains("needs 2 devices"));
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    auto* error = child<QLabel>(w, "errorLabel");
    QVERIFY(error->isVisible());
    QVERIFY2(error->text().contains("cfg-parallel needs 2 devices; 1 GPU is enabled"), qPrintable(error->text()));
    QVERIFY(!w.bridge()->isRunning());
  }

  void viewZoomsAndPans() {
    ui::ImageView view;
    view.resize(200, 200);
    QImage image(100, 50, QImage::Format_RGB888);
    image.fill(Qt::red);
    view.setImage(image, true);
    view.show();
    QVERIFY(QTest::qWaitForWindowExposed(&view));
    QVERIFY(view.fitted());
    QCOMPARE(view.zoom(), 2.0);
    QWheelEvent wheel(QPointF(100, 100), view.mapToGlobal(QPointF(100, 100)), QPoint(), QPoint(0, 120), Qt::NoButton,
                      Qt::NoModifier, Qt::NoScrollPhase, false);
    QApplication::sendEvent(&view, &wheel);
    QVERIFY(!view.fitted());
    QVERIFY(view.zoom() > 2.0);
    const QPointF before = view.offset();
    QTest::mousePress(&view, Qt::LeftButton, {}, QPoint(100, 100));
    QTest::mouseMove(&view, QPoint(130, 90));
    QTest::mouseRelease(&view, Qt::LeftButton, {}, QPoint(130, 90));
    QCOMPARE(view.offset() - before, QPointF(30, -10));
    QTest::mouseDClick(&view, Qt::LeftButton, {}, QPoint(100, 100));
    QVERIFY(view.fitted());
  }

  void shortcutsGenerateAndCancel() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    w.activateWindow();
    QVERIFY(QTest::qWaitForWindowActive(&w));
    setUpJob(w, 500);
    QSignalSpy steps(w.bridge(), &EngineBridge::stepDone);
    QSignalSpy cancelled(w.bridge(), &EngineBridge::cancelled);
    auto* prompt = child<QPlainTextEdit>(w, "promptEdit");
    prompt->setFocus();
    QTest::keyClicks(prompt, "a cat");
    QTest::keyClick(prompt, Qt::Key_Return, Qt::ControlModifier);
    QVERIFY(w.bridge()->isRunning());
    QCOMPARE(prompt->toPlainText(), QStringLiteral("a cat"));  // the shortcut, not a newline
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 2, 180000);
    QTest::keyClick(prompt, Qt::Key_Escape);
    QTRY_COMPARE_WITH_TIMEOUT(cancelled.count(), 1, 60000);
    QVERIFY(!w.bridge()->isRunning());
    QVERIFY(steps.count() < 500);
    QVERIFY(child<QLabel>(w, "statusLabel")->text().startsWith("Cancelled"));
    QVERIFY(w.results().isEmpty());
  }

  void badModelShowsAnErrorAndTheWindowKeepsWorking() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 2, QString::fromStdString((test::fixtures() / "nowhere").string()));
    QSignalSpy failed(w.bridge(), &EngineBridge::failed);
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    auto* generate = child<QPushButton>(w, "generateButton");
    QTest::mouseClick(generate, Qt::LeftButton);
    QTRY_COMPARE_WITH_TIMEOUT(failed.count(), 1, 60000);
    auto* error = child<QLabel>(w, "errorLabel");
    QVERIFY(error->isVisible());
    QVERIFY2(error->text().startsWith("Generation failed: ") && error->text().contains("nowhere"),
             qPrintable(error->text()));
    QVERIFY(error->textInteractionFlags() & Qt::TextSelectableByMouse);

    child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
    QTest::mouseClick(generate, Qt::LeftButton);
    QVERIFY(!error->isVisible());  // cleared by the new job
    QTRY_COMPARE_WITH_TIMEOUT(finished.count() + failed.count(), 2, 180000);
    QCOMPARE(finished.count(), 1);
    QVERIFY(child<ui::ImageView>(w, "imageView")->isFinal());
  }

  void staysResponsiveWhileGenerating() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 200);
    QSignalSpy steps(w.bridge(), &EngineBridge::stepDone);
    QSignalSpy ended(w.bridge(), &EngineBridge::finished);
    QSignalSpy cancelled(w.bridge(), &EngineBridge::cancelled);

    test::StallMeter meter([&] { return steps.count() > 0 && w.bridge()->isRunning(); });
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    meter.start();
    // Measure over 25 steps of the running job (previews and repaints included), then stop it.
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 25 || !w.bridge()->isRunning(), 180000);
    const qint64 stepsMeasured = steps.count();
    meter.stop();
    QTest::mouseClick(child<QPushButton>(w, "cancelButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(!w.bridge()->isRunning(), 60000);
    double stepMs = 0;
    for (const auto& s : steps) stepMs += s[3].toDouble();
    const qint64 maxGap = meter.maxGap();
    qInfo("largest GUI-thread gap %lld ms over %lld ticks and %lld steps (mean step %.1f ms)", maxGap, meter.ticks(),
          stepsMeasured, steps.isEmpty() ? 0.0 : stepMs / steps.count());
    QVERIFY(stepsMeasured >= 25);
    QVERIFY2(maxGap < 50, qPrintable(QString("the GUI thread stalled for %1 ms").arg(maxGap)));
  }

  // Every strategy in the list says in its tooltip what it does (the registry's hint).
  void strategiesExplainThemselves() {
    MainWindow w;
    auto* combo = child<QComboBox>(w, "strategyCombo");
    QVERIFY(combo->count() >= 14);
    for (int i = 0; i < combo->count(); ++i)
      QVERIFY2(!combo->itemData(i, Qt::ToolTipRole).toString().isEmpty(), qPrintable(combo->itemText(i)));
    const int i = combo->findData(QStringLiteral("driffusion-aggressive"));
    QVERIFY(combo->itemData(i, Qt::ToolTipRole).toString().contains(QStringLiteral("Draft")));
  }

  void settingsPersist() {
    {
      MainWindow w;
      setUpJob(w, 17);
      child<QPlainTextEdit>(w, "promptEdit")->setPlainText("a lighthouse");
      child<QComboBox>(w, "samplerCombo")->setCurrentText("dpmpp-2m-karras");
      child<QLineEdit>(w, "seedEdit")->setText("18446744073709551615");
      QCOMPARE(w.requestFromFields().preview_max_side, -1);  // the default: auto
      auto* preview = child<QComboBox>(w, "previewSizeCombo");
      preview->setCurrentIndex(preview->findData(256));
      QCOMPARE(w.requestFromFields().preview_max_side, 256);
      w.close();
    }
    MainWindow w;
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(), QStringLiteral("a lighthouse"));
    QCOMPARE(child<QLineEdit>(w, "modelEdit")->text(), tinyModel());
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), 17);
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 64);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("dpmpp-2m-karras"));
    QCOMPARE(child<QComboBox>(w, "sizePresetCombo")->currentText(), QStringLiteral("Custom"));
    QVERIFY(!child<QCheckBox>(w, "randomSeedCheck")->isChecked());
    QCOMPARE(w.requestFromFields().seed, std::uint64_t(18446744073709551615ull));
    QCOMPARE(w.requestFromFields().preview_max_side, 256);
  }

  void seedPast64BitsIsRefused() {
    MainWindow w;
    setUpJob(w, 2);
    child<QLineEdit>(w, "seedEdit")->setText("18446744073709551616");
    w.generate();
    QVERIFY(!w.bridge()->isRunning());
    const QString error = child<QLabel>(w, "errorLabel")->text();
    QVERIFY2(error.contains("Seed '18446744073709551616' is not a whole number from 0 to 18446744073709551615"),
             qPrintable(error));
  }

  void sizePresetsFillTheSize() {
    MainWindow w;
    auto* preset = child<QComboBox>(w, "sizePresetCombo");
    const int i = preset->findText("1216 × 832 (SDXL)");
    QVERIFY(i > 0);
    preset->setCurrentIndex(i);
    emit preset->activated(i);
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 1216);
    QCOMPARE(child<QSpinBox>(w, "heightSpin")->value(), 832);
    child<QSpinBox>(w, "widthSpin")->setValue(1000);
    QCOMPARE(preset->currentText(), QStringLiteral("Custom"));
  }

  void selectingAPresetFillsTheFields() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    auto* combo = child<QComboBox>(w, "presetCombo");
    QCOMPARE(combo->count(), 6);  // "No preset" and the five shipped ones
    const int i = combo->findText("Studio packshot on white");
    QVERIFY(i > 0);
    combo->setFocus();
    for (int k = 0; k < i; ++k) QTest::keyClick(combo, Qt::Key_Down);  // a user stepping through the list
    QCOMPARE(combo->currentIndex(), i);
    const auto p = engine::load_preset(shippedPresets() / "studio-packshot.json");
    QCOMPARE(child<QPlainTextEdit>(w, "negativeEdit")->toPlainText().toStdString(), p.negative_prompt);
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 1024);
    QCOMPARE(child<QSpinBox>(w, "heightSpin")->value(), 1024);
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), p.steps);
    QCOMPARE(child<QDoubleSpinBox>(w, "cfgSpin")->value(), p.cfg);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("dpmpp-2m-karras"));
    QCOMPARE(child<QComboBox>(w, "strategyCombo")->currentData().toString(), QStringLiteral("single"));
    auto* templ = child<QLabel>(w, "promptTemplateLabel");
    QVERIFY(templ->isVisible());
    QVERIFY(templ->text().contains("{subject}"));
    // Changing a setting the preset holds marks its name; undoing the change clears the mark.
    const QString name = QStringLiteral("Studio packshot on white");
    QCOMPARE(combo->currentText(), name);
    auto* steps = child<QSpinBox>(w, "stepsSpin");
    steps->setValue(p.steps + 5);
    QCOMPARE(combo->currentText(), name + " (changed)");
    steps->setValue(p.steps);
    QCOMPARE(combo->currentText(), name);
    child<QPlainTextEdit>(w, "negativeEdit")->appendPlainText("fingerprints");
    QCOMPARE(combo->currentText(), name + " (changed)");
    child<QPlainTextEdit>(w, "negativeEdit")->setPlainText(QString::fromStdString(p.negative_prompt));
    QCOMPARE(combo->currentText(), name);
    child<QComboBox>(w, "samplerCombo")->setCurrentIndex(0);
    QCOMPARE(combo->currentText(), name + " (changed)");
    emit combo->activated(i);  // applying it again restores its settings and its name
    QCOMPARE(combo->currentText(), name);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("dpmpp-2m-karras"));
    // The model and the prompt are not the preset's: changing them keeps the name.
    child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
    QCOMPARE(combo->currentText(), name);
    QTest::keyClicks(child<QPlainTextEdit>(w, "promptEdit"), "a ceramic mug");
    QCOMPARE(w.requestFromFields().prompt, engine::fill_prompt_template(p.prompt_template, "a ceramic mug"));
    QVERIFY(w.requestFromFields().prompt.find("studio packshot of a ceramic mug, centered") != std::string::npos);

    // Back to no preset: the prompt is used as typed, the fields stay.
    combo->setCurrentIndex(0);
    emit combo->activated(0);
    QVERIFY(!templ->isVisible());
    QCOMPARE(w.requestFromFields().prompt, std::string("a ceramic mug"));
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 1024);
  }

  void savesAUserPreset() {
    {
      MainWindow w;
      setUpJob(w, 9);
      child<QPlainTextEdit>(w, "promptEdit")->setPlainText("macro shot of {subject}, dark slate");
      child<QPlainTextEdit>(w, "negativeEdit")->setPlainText("glare");
      child<QDoubleSpinBox>(w, "cfgSpin")->setValue(4.5);
      QVERIFY(w.savePreset("  ").contains("field 'name' is empty"));
      QCOMPARE(w.savePreset("My Macro"), QString());
      QCOMPARE(child<QComboBox>(w, "presetCombo")->currentText(), QStringLiteral("My Macro"));
      QVERIFY(child<QPlainTextEdit>(w, "promptEdit")->toPlainText().isEmpty());  // it became the template
      QTest::keyClicks(child<QPlainTextEdit>(w, "promptEdit"), "a watch");
      QCOMPARE(w.requestFromFields().prompt, std::string("macro shot of a watch, dark slate"));
    }
    const QString file = QDir(MainWindow::userPresetDir()).filePath("my-macro.json");
    QVERIFY2(QFileInfo::exists(file), qPrintable(file));
    const auto p = engine::load_preset(file.toStdString());
    QCOMPARE(p.prompt_template, std::string("macro shot of {subject}, dark slate"));
    QCOMPARE(p.negative_prompt, std::string("glare"));
    QCOMPARE(p.steps, 9);
    QCOMPARE(p.width, 64);
    QCOMPARE(p.cfg, 4.5);
    {
      // A new window lists it after the shipped ones, and remembers it was selected.
      MainWindow again;
      auto* combo = child<QComboBox>(again, "presetCombo");
      QCOMPARE(combo->count(), 7);
      QCOMPARE(combo->itemText(6), QStringLiteral("My Macro"));
      QCOMPARE(combo->currentIndex(), 6);
      child<QDoubleSpinBox>(again, "cfgSpin")->setValue(6.0);
      QCOMPARE(combo->currentText(), QStringLiteral("My Macro (changed)"));
    }
    // Changed, it stays marked in the next session.
    MainWindow third;
    QCOMPARE(child<QComboBox>(third, "presetCombo")->currentText(), QStringLiteral("My Macro (changed)"));
    QCOMPARE(child<QDoubleSpinBox>(third, "cfgSpin")->value(), 6.0);
  }

  // Every preset and lane setup in presets/ is compiled into the window (the CMake lists name
  // them one by one), and each one parses.
  void shipsEveryPresetFile() {
    for (const QString sub : {QString(), QStringLiteral("lanes")}) {
      const QDir source(QString::fromStdString((shippedPresets() / sub.toStdString()).string()));
      const QDir compiled(QStringLiteral(":/presets/") + sub);
      const QStringList want = source.entryList({QStringLiteral("*.json")}, QDir::Files, QDir::Name);
      QVERIFY(!want.isEmpty());
      QCOMPARE(compiled.entryList({QStringLiteral("*.json")}, QDir::Files, QDir::Name), want);
    }
  }

  void brokenUserPresetIsNamedNotFatal() {
    QVERIFY(QDir().mkpath(MainWindow::userPresetDir()));
    QFile bad(QDir(MainWindow::userPresetDir()).filePath("broken.json"));
    QVERIFY(bad.open(QIODevice::WriteOnly));
    bad.write(R"({"name": "Broken", "prompt_template": "{subject}", "width": 512, "height": 512, "steps": "many",
                 "sampler": "", "cfg": 7})");
    bad.close();
    MainWindow w;
    QCOMPARE(child<QComboBox>(w, "presetCombo")->count(), 6);
    const QString error = child<QLabel>(w, "errorLabel")->text();
    QVERIFY2(error.contains("broken.json: field 'steps' must be a whole number"), qPrintable(error));
  }

  void droppingAnA1111PngRestoresItsParameters() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    QVERIFY(dropFile(w, pngFixture("a1111.png")));
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(),
             QStringLiteral("studio packshot of a ceramic coffee mug, centered,\non a seamless white background <lora:product_v2:0.7>"));
    QCOMPARE(child<QPlainTextEdit>(w, "negativeEdit")->toPlainText(), QStringLiteral("text, watermark,\nblurry"));
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 1152);
    QCOMPARE(child<QSpinBox>(w, "heightSpin")->value(), 896);
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), 28);
    QCOMPARE(child<QDoubleSpinBox>(w, "cfgSpin")->value(), 6.5);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("dpmpp-2m-karras"));
    const QString note = child<QLabel>(w, "restoredLabel")->text();
    QVERIFY2(note.contains("AUTOMATIC1111"), qPrintable(note));
    QVERIFY2(note.contains("Clip skip: 2"), qPrintable(note));
    QCOMPARE(w.requestFromFields().seed, std::uint64_t(3141592653ull));  // past 2^31, as A1111 seeds go
    QVERIFY2(note.contains("Model: sd_xl_base_1.0 (a checkpoint name"), qPrintable(note));
    QVERIFY(!child<QLabel>(w, "errorLabel")->isVisible());
  }

  void droppingAComfyUiPngRestoresItsParameters() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    QVERIFY(dropFile(w, pngFixture("comfyui.png")));
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(),
             QStringLiteral("beautiful scenery nature glass bottle landscape, purple galaxy bottle,"));
    QCOMPARE(child<QPlainTextEdit>(w, "negativeEdit")->toPlainText(), QStringLiteral("text, watermark"));
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 512);
    QCOMPARE(child<QSpinBox>(w, "heightSpin")->value(), 768);
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), 20);
    QCOMPARE(child<QDoubleSpinBox>(w, "cfgSpin")->value(), 8.0);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("euler"));
    QCOMPARE(child<QLineEdit>(w, "seedEdit")->text(), QStringLiteral("156680208700286"));
    QCOMPARE(w.requestFromFields().seed, std::uint64_t(156680208700286ull));
    const QString note = child<QLabel>(w, "restoredLabel")->text();
    QVERIFY2(note.contains("ComfyUI") && note.contains("LoRA: glass_style.safetensors"), qPrintable(note));
    QVERIFY2(note.contains("v1-5-pruned-emaonly.safetensors"), qPrintable(note));
  }

  void droppingOurOwnPngRestoresEverything() {
    const QString png = m_tmp.filePath("ours.png");
    const nlohmann::json meta = {{"model", tinyModel().toStdString()}, {"prompt", "a blue vase"},
                                 {"negative_prompt", "dust"}, {"width", 96}, {"height", 64}, {"steps", 7},
                                 {"cfg", 3.5}, {"seed", 77}, {"sampler", "ddim"}, {"device", "cpu"}, {"batch", 2},
                                 {"taesd", ""}, {"strategy_name", "step-skip"}, {"devices", 2}};
    io::write_png(png.toStdString(), io::Image{8, 8, std::vector<std::uint8_t>(8 * 8 * 3, 10)},
                  {{"parameters", "ignored\nSteps: 1, Sampler: Euler, CFG scale: 1"}, {"diffract", meta.dump()}});
    MainWindow w;
    child<QCheckBox>(w, "randomSeedCheck")->setChecked(true);
    QVERIFY(dropFile(w, png));
    QCOMPARE(child<QLineEdit>(w, "modelEdit")->text(), tinyModel());
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(), QStringLiteral("a blue vase"));
    QCOMPARE(child<QLineEdit>(w, "seedEdit")->text(), QStringLiteral("77"));
    QVERIFY(!child<QCheckBox>(w, "randomSeedCheck")->isChecked());  // the seed is the point of restoring
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), 7);
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 96);
    QCOMPARE(child<QSpinBox>(w, "batchSpin")->value(), 2);
    QCOMPARE(child<QComboBox>(w, "samplerCombo")->currentData().toString(), QStringLiteral("ddim"));
    QCOMPARE(child<QComboBox>(w, "strategyCombo")->currentData().toString(), QStringLiteral("step-skip"));
    QCOMPARE(child<QSpinBox>(w, "devicesSpin")->value(), 2);
    QVERIFY(child<QLabel>(w, "restoredLabel")->text().contains("Diffract"));
  }

  void galleryDoubleClickRestoresParameters() {
    QVERIFY(QDir().mkpath(outDir()));
    const QString png = QDir(outDir()).filePath("from-gallery.png");
    const nlohmann::json meta = {{"prompt", "from the gallery"}, {"steps", 13}, {"seed", 31}, {"width", 64}, {"height", 64}};
    io::write_png(png.toStdString(), io::Image{8, 8, std::vector<std::uint8_t>(8 * 8 * 3, 50)}, {{"diffract", meta.dump()}});
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    auto* list = w.gallery()->findChild<QListWidget*>("galleryList");
    QTRY_VERIFY_WITH_TIMEOUT(list->count() > 0, 10000);
    int row = -1;
    for (int i = 0; i < list->count(); ++i)
      if (list->item(i)->data(Qt::UserRole).toString() == png) row = i;
    QVERIFY(row >= 0);
    list->scrollToItem(list->item(row));
    QSignalSpy done(&w, &MainWindow::restoreFinished);
    const QPoint at = list->visualItemRect(list->item(row)).center();
    QTest::mouseClick(list->viewport(), Qt::LeftButton, {}, at);
    QTest::mouseDClick(list->viewport(), Qt::LeftButton, {}, at);
    QVERIFY(done.wait(10000));
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(), QStringLiteral("from the gallery"));
    QCOMPARE(child<QSpinBox>(w, "stepsSpin")->value(), 13);
    QCOMPARE(child<QLineEdit>(w, "seedEdit")->text(), QStringLiteral("31"));
    // The restored picture shows in the view.
    const QImage shown = child<ui::ImageView>(w, "imageView")->image();
    QCOMPARE(shown.size(), QSize(8, 8));
    QCOMPARE(QColor(shown.pixel(3, 3)), QColor(50, 50, 50));
  }

  void compareOpensOnTheLastTwoImages() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    auto* compare = child<QPushButton>(w, "compareButton");
    QVERIFY(!compare->isEnabled());
    setUpJob(w, 2);
    child<QSpinBox>(w, "batchSpin")->setValue(2);
    child<QPlainTextEdit>(w, "promptEdit")->setPlainText("two pears");
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    w.generate();
    QVERIFY(finished.wait(60000));
    QCOMPARE(w.results().size(), 2);
    // The view shows the batch as one picture of both; each image carries its position.
    QCOMPARE(child<ui::ImageView>(w, "imageView")->image().height(), w.results()[0].image.height());
    QVERIFY(child<ui::ImageView>(w, "imageView")->image().width() > 2 * w.results()[0].image.width());
    QVERIFY2(w.results()[1].parameters.endsWith("Batch size: 2, Batch pos: 1"), qPrintable(w.results()[1].parameters));
    QCOMPARE(engine::read_png_parameters(w.results()[1].savedPath.toStdString()).batch_index.value_or(-1), 1);
    QVERIFY(compare->isEnabled());
    QSignalSpy opened(&w, &MainWindow::compareOpened);
    compare->click();
    QCOMPARE(opened.size(), 1);
    auto* view = opened.first().first().value<ui::CompareView*>();
    QVERIFY(view && view->isVisible());
    QSignalSpy computed(view, &ui::CompareView::computed);
    QVERIFY(computed.wait(10000));
    QCOMPARE(view->comparison().heatmap.size(), QSize(64, 64));
    QVERIFY(view->comparison().error.isEmpty());
    QVERIFY(view->comparison().ssim > -1 && view->comparison().ssim <= 1);
    // One job's batch: the same settings, so only the position in the batch differs.
    auto* differences = view->findChild<QTableWidget*>("differencesTable");
    QCOMPARE(differences->rowCount(), 1);
    QCOMPARE(differences->item(0, 0)->text(), QStringLiteral("batch_index"));
    view->close();
    // A result whose file was deleted meanwhile says so in the pick lists.
    QVERIFY(QFile::remove(w.results()[0].savedPath));
    auto* again = w.compareResults(0, 1);
    QVERIFY(again->findChild<QComboBox*>("compareA")->itemText(0).endsWith("(file deleted)"));
    QVERIFY(!again->findChild<QComboBox*>("compareA")->itemText(1).contains("deleted"));
    again->close();
  }

  void inpaintsTheMaskPaintedWithTheMouse() {
    MainWindow w;
    setUpPhotoJob(w, "a golden helmet");
    // The editor is on show with the photo; the size fields keep the job small.
    auto* editor = w.maskEditor();
    QTRY_VERIFY(editor->isVisible());
    QCOMPARE(editor->inputImage().size(), QSize(75, 61));
    QCOMPARE(child<QSpinBox>(w, "widthSpin")->value(), 64);
    QVERIFY(!editor->hasMask());

    // A stroke across the middle with real mouse events; the wheel still zooms.
    child<QSpinBox>(w, "maskBrushSize")->setValue(16);
    const QPoint mid = editor->rect().center();
    QTest::mousePress(editor, Qt::LeftButton, Qt::NoModifier, mid - QPoint(editor->width() / 4, 0));
    for (int i = -3; i <= 3; ++i) QTest::mouseMove(editor, mid + QPoint(i * editor->width() / 12, 0));
    QTest::mouseRelease(editor, Qt::LeftButton, Qt::NoModifier, mid + QPoint(editor->width() / 4, 0));
    QVERIFY(editor->hasMask());
    QCOMPARE(editor->mask().pixelColor(37, 30).value(), 255);  // the middle is repainted
    QCOMPARE(editor->mask().pixelColor(37, 2).value(), 0);     // the top is kept
    QCOMPARE(child<QSlider>(w, "inputStrength")->value(), 100);  // inpainting's default strength

    const QImage out = runJob(w).convertToFormat(QImage::Format_RGB888);
    QCOMPARE(out.size(), QSize(64, 64));
    // Paste-back is on: outside the mask the original's pixels (at the job's size) come back
    // exactly; inside, the model repainted.
    const auto original = pipeline::resize_lanczos(ui::toCoreImage(editor->inputImage()), 64, 64);
    const auto mask = pipeline::to_grey(pipeline::resize_lanczos(ui::toCoreImage(editor->mask()), 64, 64));
    const auto ours = ui::toCoreImage(out);
    const auto c = test::masked_change(ours.rgb, original.rgb, mask);
    QCOMPARE(c.changed_outside, 0);
    QVERIFY(c.kept > 1500);
    QVERIFY2(c.repainted > 200, qPrintable(QString("only %1 masked pixels changed").arg(c.repainted)));

    // The input and the mask are saved beside the PNG, and dropping the PNG brings them back.
    const QString saved = w.results().back().savedPath;
    const auto meta = nlohmann::json::parse(w.results().back().metadataJson.toStdString());
    const QString inputFile = QFileInfo(saved).dir().filePath(QString::fromStdString(meta["input"]["input_file"]));
    QVERIFY(QFileInfo::exists(inputFile));
    w.inputPanel()->clear();
    QVERIFY(!w.inputPanel()->hasImage());
    QVERIFY(dropFile(w, saved));
    QVERIFY(w.inputPanel()->hasImage());
    QCOMPARE(editor->inputImage().size(), QSize(75, 61));
    QVERIFY(editor->hasMask());
    QCOMPARE(editor->mask().pixelColor(37, 30).value(), 255);
    QVERIFY(child<QLabel>(w, "restoredLabel")->text().contains("input image"));
  }

  // Saving to the output folder fails (here the "folder" is a file): the error says the image was
  // made but not saved, the image stays in the session, and Save as writes it with its metadata.
  void failedSaveKeepsTheImageForSaveAs() {
    const QByteArray kept = qgetenv("DIFFRACT_OUTPUT_DIR");
    const QString blocked = m_tmp.filePath("not-a-folder");
    {
      QFile f(blocked);
      QVERIFY(f.open(QIODevice::WriteOnly));
      f.write("x");
    }
    qputenv("DIFFRACT_OUTPUT_DIR", blocked.toLocal8Bit());
    MainWindow w;
    setUpJob(w, 2);
    w.findChild<QPlainTextEdit*>("promptEdit")->setPlainText("a red apple");
    const QImage out = runJob(w);
    qputenv("DIFFRACT_OUTPUT_DIR", kept);
    const QString error = child<QLabel>(w, "errorLabel")->text();
    QVERIFY2(error.contains("made but not saved"), qPrintable(error));
    QCOMPARE(w.results().size(), 1);
    QVERIFY(w.results()[0].savedPath.isEmpty());
    QVERIFY(child<QPushButton>(w, "saveResultAsButton")->isEnabled());
    const QString to = m_tmp.filePath("saved-as.png");
    QCOMPARE(w.saveResultAs(0, to), QString());
    QCOMPARE(w.results()[0].savedPath, to);
    QCOMPARE(engine::read_png_parameters(to.toStdString()).prompt.value_or(""), std::string("a red apple"));
    QVERIFY(io::read_png(to.toStdString()).rgb == ui::toCoreImage(out).rgb);
    // Where it cannot write: said, and the image is still there for another try.
    QVERIFY(w.saveResultAs(0, m_tmp.filePath("no/such/folder/x.png")).contains("not saved"));
    QCOMPARE(w.results().size(), 1);
  }

  void imageToImageAtStrengthZeroReturnsTheInput() {
    MainWindow w;
    setUpPhotoJob(w, "anything");
    child<QSlider>(w, "inputStrength")->setValue(0);
    const QImage out = runJob(w);
    const auto expected = pipeline::resize_lanczos(ui::toCoreImage(w.maskEditor()->inputImage()), 64, 64);
    QCOMPARE(ui::toCoreImage(out).rgb, expected.rgb);

    // "Use as input" on the result: it becomes the input.
    QTest::mouseClick(child<QPushButton>(w, "useAsInputButton"), Qt::LeftButton);
    QCOMPARE(w.maskEditor()->inputImage().size(), QSize(64, 64));
    QVERIFY(w.inputPanel()->source().contains("result"));
  }

  // A ControlNet unit on the photo (canny edges) drives the job; the PNG keeps the control image,
  // and dropping it on a fresh window brings the unit back with that image.
  void controlNetUnitRunsSavesAndRestores() {
    const QString nets = QString::fromStdString((test::fixtures() / "controlnet").string());
    QString png;
    QImage control;
    {
      MainWindow w;
      setUpPhotoJob(w, "a red apple");
      w.inputPanel()->clear();  // text-to-image, the photo only as the control image
      auto* panel = w.controlNetPanel();
      panel->setFolders({nets});
      QCOMPARE(panel->addUnit(), 0);
      ui::ControlNetPanel::Unit u;
      u.model = nets + "/cn-sd-a";
      u.preprocess = {QStringLiteral("canny"), 100, 200};
      panel->setUnit(0, u);
      // No image yet: the job does not start, and says why.
      QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
      QVERIFY(!w.bridge()->isRunning());
      QVERIFY2(child<QLabel>(w, "errorLabel")->text().contains("no control image"),
               qPrintable(child<QLabel>(w, "errorLabel")->text()));
      QString error;
      QVERIFY2(panel->loadImage(0, imageFixture("photo.png"), &error), qPrintable(error));
      const QImage with = runJob(w);
      control = panel->controlImage(0, QSize(64, 64));
      png = w.results().back().savedPath;
      QVERIFY(!png.isEmpty());
      const auto meta = nlohmann::json::parse(w.results().back().metadataJson.toStdString());
      QCOMPARE(meta["controlnets"].size(), std::size_t(1));
      QCOMPARE(meta["controlnets"][0]["preprocessor"].get<std::string>(), std::string("canny"));
      QVERIFY(QFileInfo::exists(QFileInfo(png).dir().filePath(QString::fromStdString(meta["controlnets"][0]["image_file"]))));
      // The same job with the unit off is another image: the ControlNet acted.
      auto off = panel->unit(0);
      off.enabled = false;
      panel->setUnit(0, off);
      QVERIFY(runJob(w) != with);
    }
    MainWindow w;
    QVERIFY(dropFile(w, png));
    auto* panel = w.controlNetPanel();
    QCOMPARE(panel->unitCount(), 1);
    QCOMPARE(panel->unit(0).model, nets + "/cn-sd-a");
    QVERIFY(panel->unit(0).enabled);
    QCOMPARE(panel->controlImage(0).convertToFormat(QImage::Format_RGB888), control);
    QVERIFY(child<QLabel>(w, "restoredLabel")->text().contains("ControlNet unit 1"));
  }

  void hiresFixDoublesTheImageInOneJob() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 2);
    child<QSpinBox>(w, "widthSpin")->setValue(32);
    child<QSpinBox>(w, "heightSpin")->setValue(32);
    child<QPlainTextEdit>(w, "promptEdit")->setPlainText("a red apple");
    child<QDoubleSpinBox>(w, "hiresScale")->setValue(2.0);
    QSignalSpy steps(w.bridge(), &EngineBridge::stepDone);
    const QImage out = runJob(w);
    QCOMPARE(out.size(), QSize(64, 64));
    // 2 steps, then 1 of the second pass (strength 0.5), numbered as one run of 3.
    QCOMPARE(steps.count(), 3);
    QCOMPARE(steps[2][0].toInt(), 2);
    QCOMPARE(steps[2][1].toInt(), 3);
    QCOMPARE(child<ui::TimingsChart>(w, "timingsChart")->totalSteps(), 3);
    QVERIFY(w.results().back().parameters.contains("Hires upscale: 2"));
  }

  // A step cache's reused steps are marked in the chart, live and once the job is done.
  void stepCacheShowsInTheChart() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 3, QString::fromStdString((test::fixtures() / "sd3_pipeline" / "tiny-sd3").string()));
    child<QSpinBox>(w, "widthSpin")->setValue(32);
    child<QSpinBox>(w, "heightSpin")->setValue(32);
    child<QPlainTextEdit>(w, "promptEdit")->setPlainText("a red apple");
    auto* strategy = child<QComboBox>(w, "strategyCombo");
    strategy->setCurrentIndex(strategy->findData(QStringLiteral("fbcache")));
    child<QDoubleSpinBox>(w, "cacheThresholdSpin")->setValue(10);  // every step after the first
    QSignalSpy steps(w.bridge(), &EngineBridge::stepDone);
    runJob(w);
    QCOMPARE(steps.count(), 3);
    QCOMPARE(steps[0][4].toBool(), false);
    QCOMPARE(steps[2][4].toBool(), true);
    auto* chart = child<ui::TimingsChart>(w, "timingsChart");
    QCOMPARE(chart->cachedCount(), 2);
    QVERIFY2(chart->rows().join('\n').contains("2 from the cache"), qPrintable(chart->rows().join('\n')));
    // The strategy's result in plain words under the view.
    auto* result = child<QLabel>(w, "strategyResultLabel");
    QVERIFY(!result->isHidden());
    QVERIFY2(result->text().startsWith("fbcache on 1 device: 2 of 3 steps reused cached work"), qPrintable(result->text()));
    QVERIFY(result->text().contains("the image changes a little"));
    // The list shows the speed-up the job measured, as the result line says it.
    const int fb = strategy->findData(QStringLiteral("fbcache"));
    const QString times = result->text().section(QStringLiteral("steps' worth ("), 1).section(QStringLiteral("×"), 0, 0);
    QVERIFY2(times.toDouble() > 1.0, qPrintable(result->text()));
    QCOMPARE(strategy->itemText(fb), QStringLiteral("fbcache · %1× last run").arg(times));
    QVERIFY(strategy->itemData(fb, Qt::ToolTipRole).toString().contains(times + QStringLiteral("× less sequential")));
    QCOMPARE(strategy->itemText(0), QStringLiteral("single"));
    strategy->setCurrentIndex(0);
    runJob(w);
    QVERIFY(result->isHidden());  // the plain loop says nothing more
    QCOMPARE(strategy->itemText(fb), QStringLiteral("fbcache · %1× last run").arg(times));  // kept until fbcache runs again
  }

  // Sizes far beyond the model's native one are warned of before the job: the embedded model is
  // 128 px (its UNet's sample size 16 x its VAE's 8); tiny-sd 32 px (16 x 2).
  void warnsOfSizesFarBeyondTheModel() {
    MainWindow w;
    auto* warning = child<QLabel>(w, "sizeWarningLabel");
    child<QLineEdit>(w, "modelEdit")->setText(QString::fromStdString(test::emoji_model().string()));
    child<QSpinBox>(w, "widthSpin")->setValue(1024);
    child<QSpinBox>(w, "heightSpin")->setValue(1024);
    QVERIFY(!warning->isHidden());
    QVERIFY2(warning->text().contains("64× the pixels of this model's native 128×128"), qPrintable(warning->text()));
    child<QSpinBox>(w, "widthSpin")->setValue(256);
    child<QSpinBox>(w, "heightSpin")->setValue(256);
    QVERIFY(warning->isHidden());
    child<QSpinBox>(w, "widthSpin")->setValue(0);
    QVERIFY(warning->isHidden());
    child<QLineEdit>(w, "modelEdit")->setText(tinyModel());
    child<QSpinBox>(w, "widthSpin")->setValue(128);
    child<QSpinBox>(w, "heightSpin")->setValue(128);
    QVERIFY2(warning->text().contains("native 32×32"), qPrintable(warning->text()));
    QVERIFY(!warning->text().contains("Decoding"));
    // A decode no machine here can hold (16 images of 8192², ~2.7 TB in fp32) is named before the job.
    child<QSpinBox>(w, "widthSpin")->setValue(8192);
    child<QSpinBox>(w, "heightSpin")->setValue(8192);
    child<QSpinBox>(w, "batchSpin")->setValue(16);
    QVERIFY2(warning->text().contains("Decoding a batch of 16 at 8192×8192 needs about 2749 GB on the CPU") &&
                 warning->text().contains("more than this machine's"),
             qPrintable(warning->text()));
    // On a GPU: the model's weights and the decode in bf16 against the memory it has free.
    w.setDevices({{"Fake GPU", 0, 8ull << 30, 1ull << 30}});
    QVERIFY2(warning->text().contains("This job needs about 1374 GB on cuda:0 (Fake GPU)") &&
                 warning->text().contains("decoding a batch of 16 at 8192×8192 1374 GB") &&
                 warning->text().contains("more than its 8 GB free") && !warning->text().contains("on the CPU"),
             qPrintable(warning->text()));
    child<QSpinBox>(w, "batchSpin")->setValue(1);
    child<QSpinBox>(w, "widthSpin")->setValue(1024);
    child<QSpinBox>(w, "heightSpin")->setValue(1024);
    QVERIFY2(!warning->text().contains("needs about"), qPrintable(warning->text()));  // 2.7 GB fits
    w.setDevices({});
    QCOMPARE(engine::model_weight_bytes(test::emoji_model()),
             std::uint64_t(std::filesystem::file_size(test::emoji_model() / "unet" / "diffusion_pytorch_model.safetensors") +
                           std::filesystem::file_size(test::emoji_model() / "text_encoder" / "model.safetensors") +
                           std::filesystem::file_size(test::emoji_model() / "vae" / "diffusion_pytorch_model.safetensors")));
    QCOMPARE(engine::model_weight_bytes("/nonexistent"), std::uint64_t(0));
    QCOMPARE(engine::guess_native_size(test::fixtures() / "tiny-sdxl"), std::optional<int>(32));
    QCOMPARE(engine::guess_native_size("/nonexistent"), std::optional<int>());
  }

  void generateStaysInSightAndTheWheelScrollsPastFields() {
    MainWindow w;
    w.resize(1280, 720);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    // The settings fit the left pane's width: no control cut off behind a sideways scroll.
    auto* settings = child<QScrollArea>(w, "settingsScroll");
    QVERIFY2(settings->widget()->minimumSizeHint().width() <= settings->viewport()->width(),
             qPrintable(QString("the form needs %1 px, the pane gives %2")
                            .arg(settings->widget()->minimumSizeHint().width())
                            .arg(settings->viewport()->width())));
    QVERIFY(!settings->horizontalScrollBar()->isVisible());
    // Generate and Cancel sit below the scrolled form: inside the window at 1280x720.
    for (const char* name : {"generateButton", "cancelButton"}) {
      auto* b = child<QPushButton>(w, name);
      const QRect inWindow(b->mapTo(&w, QPoint(0, 0)), b->size());
      QVERIFY2(w.rect().contains(inWindow), name);
      QVERIFY(b->isVisible());
    }
    // The wheel over an unfocused field leaves it alone; once focused, it changes it.
    auto* steps = child<QSpinBox>(w, "stepsSpin");
    steps->setValue(20);
    const QPoint at = steps->rect().center();
    QWheelEvent wheel(at, steps->mapToGlobal(at), QPoint(), QPoint(0, 120), Qt::NoButton, Qt::NoModifier,
                      Qt::NoScrollPhase, false);
    QApplication::sendEvent(steps, &wheel);
    QCOMPARE(steps->value(), 20);
    w.activateWindow();
    QVERIFY(QTest::qWaitForWindowActive(&w));
    steps->setFocus();
    QTRY_VERIFY(steps->hasFocus());
    QWheelEvent again(at, steps->mapToGlobal(at), QPoint(), QPoint(0, 120), Qt::NoButton, Qt::NoModifier,
                      Qt::NoScrollPhase, false);
    QApplication::sendEvent(steps, &again);
    QCOMPARE(steps->value(), 21);
  }

  void droppingAPngWithoutParametersSaysSo() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    child<QPlainTextEdit>(w, "promptEdit")->setPlainText("keep me");
    QVERIFY(!dropFile(w, pngFixture("no_parameters.png")));
    auto* error = child<QLabel>(w, "errorLabel");
    QVERIFY(error->isVisible());
    QVERIFY2(error->text().contains("no_parameters.png: no generation parameters"), qPrintable(error->text()));
    QCOMPARE(child<QPlainTextEdit>(w, "promptEdit")->toPlainText(), QStringLiteral("keep me"));

    // A file URL dragged as text, pointing at something that is not a PNG.
    const QString notPng = m_tmp.filePath("notes.txt");
    QFile f(notPng);
    QVERIFY(f.open(QIODevice::WriteOnly));
    f.write("hello");
    f.close();
    QSignalSpy done(&w, &MainWindow::restoreFinished);
    QMimeData mime;
    mime.setText(QUrl::fromLocalFile(notPng).toString());
    QVERIFY(dropOnto(w, &mime));
    QVERIFY(done.wait(10000));
    QVERIFY2(error->text().contains("notes.txt: not a PNG file"), qPrintable(error->text()));

    QMimeData plain;  // plain text is not a file: refused
    plain.setText("just words");
    QVERIFY(!dropOnto(w, &plain));
  }

  void droppingOnThePromptRestoresInsteadOfPastingTheUrl() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    auto* prompt = child<QPlainTextEdit>(w, "promptEdit");
    QSignalSpy done(&w, &MainWindow::restoreFinished);
    QMimeData mime;
    mime.setUrls({QUrl::fromLocalFile(pngFixture("comfyui.png"))});
    const QPoint pos = prompt->viewport()->rect().center();
    QDragEnterEvent enter(pos, Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
    QApplication::sendEvent(prompt->viewport(), &enter);
    QVERIFY(enter.isAccepted());
    QDropEvent drop(QPointF(pos), Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
    QApplication::sendEvent(prompt->viewport(), &drop);
    QVERIFY(done.wait(10000));
    QVERIFY(!prompt->toPlainText().contains("file:"));
    QVERIFY(prompt->toPlainText().startsWith("beautiful scenery"));
  }
};

QTEST_MAIN(TestMainWindow)
#include "test_main_window.moc"
