// The main window driven like a user would: fields, buttons, shortcuts, live view, timings.
#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QElapsedTimer>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QSettings>
#include <QSignalSpy>
#include <QSpinBox>
#include <QStandardPaths>
#include <QTemporaryDir>
#include <QTimer>
#include <QWheelEvent>

#include "core/io/image.h"
#include "test_util.h"
#include "ui/image_view.h"
#include "ui/main_window.h"
#include "ui/timings_chart.h"

using namespace diffract;
using diffract::ui::EngineBridge;
using diffract::ui::MainWindow;

namespace {

template <typename T>
T* child(const MainWindow& w, const char* name) {
  auto* c = w.findChild<T*>(QString::fromLatin1(name));
  if (!c) qFatal("no child %s", name);
  return c;
}

QString tinyModel() { return QString::fromStdString((test::fixtures() / "tiny-sd").string()); }

// Fills the fields for a small, fast job on the tiny model.
void setUpJob(MainWindow& w, int steps, const QString& model = tinyModel()) {
  child<QLineEdit>(w, "modelEdit")->setText(model);
  child<QSpinBox>(w, "widthSpin")->setValue(64);
  child<QSpinBox>(w, "heightSpin")->setValue(64);
  child<QSpinBox>(w, "stepsSpin")->setValue(steps);
  child<QCheckBox>(w, "randomSeedCheck")->setChecked(false);
  child<QSpinBox>(w, "seedSpin")->setValue(5);
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
    qputenv("HF_HUB_CACHE", hub.toLocal8Bit());
  }

  void init() { QSettings().clear(); }

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

    QElapsedTimer clock;
    qint64 last = 0, maxGap = 0, ticks = 0;
    QTimer timer;
    timer.setInterval(10);
    timer.setTimerType(Qt::PreciseTimer);
    connect(&timer, &QTimer::timeout, this, [&] {
      const qint64 now = clock.elapsed();
      if (ticks > 0 && steps.count() > 0 && w.bridge()->isRunning()) maxGap = std::max(maxGap, now - last);
      last = now;
      ++ticks;
    });
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    clock.start();
    timer.start();
    // Measure over 25 steps of the running job (previews and repaints included), then stop it.
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 25 || !w.bridge()->isRunning(), 180000);
    const qint64 stepsMeasured = steps.count();
    timer.stop();
    QTest::mouseClick(child<QPushButton>(w, "cancelButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(!w.bridge()->isRunning(), 60000);
    double stepMs = 0;
    for (const auto& s : steps) stepMs += s[3].toDouble();
    qInfo("largest GUI-thread gap %lld ms over %lld ticks and %lld steps (mean step %.1f ms)", maxGap, ticks,
          stepsMeasured, steps.isEmpty() ? 0.0 : stepMs / steps.count());
    QVERIFY(stepsMeasured >= 25);
    QVERIFY2(maxGap < 50, qPrintable(QString("the GUI thread stalled for %1 ms").arg(maxGap)));
  }

  void settingsPersist() {
    {
      MainWindow w;
      setUpJob(w, 17);
      child<QPlainTextEdit>(w, "promptEdit")->setPlainText("a lighthouse");
      child<QComboBox>(w, "samplerCombo")->setCurrentText("dpmpp-2m-karras");
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
};

QTEST_MAIN(TestMainWindow)
#include "test_main_window.moc"
