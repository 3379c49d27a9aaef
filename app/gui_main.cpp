// diffract: the desktop application.
#include <QApplication>
#include <QCheckBox>
#include <QCommandLineParser>
#include <QDir>
#include <QDockWidget>
#include <QElapsedTimer>
#include <QFile>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QSettings>
#include <QSpinBox>
#include <QTemporaryDir>
#include <QTimer>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include <QPainter>

#include "core/engine/lanes.h"
#include "ui/compare_view.h"
#include "ui/gallery.h"
#include "ui/input_panel.h"
#include "ui/lanes_panel.h"
#include "ui/main_window.h"
#include "ui/mask_editor.h"

namespace {

using diffract::ui::EngineBridge;
using diffract::ui::MainWindow;

// --screenshots DIR --model PATH: drives the real window through two generations, then saves
// main-window.png, compare.png and gallery.png into DIR; then uses the last result as input,
// masks its centre and inpaints it with another prompt, saving inpaint-mask.png (the mask on
// the input) and inpaint.png (the result), and quits (docs/screenshots, the CTest).
// Settings and output go to a temporary folder, so the user's are left alone.
class ScreenshotTour : public QObject {
 public:
  struct Job {
    QString prompt, negative;
    int size = 96, steps = 10;
    QString inpaintPrompt;  // the masked centre's
  };
  ScreenshotTour(QString dir, QString model, Job job, int timeoutS)
      : m_dir(std::move(dir)), m_model(std::move(model)), m_job(std::move(job)) {
    m_clock.start();
    QTimer::singleShot(timeoutS * 1000, this, [this, timeoutS] {
      fail(QStringLiteral("timed out after %1 s (%2)").arg(timeoutS).arg(m_stage));
    });
  }

  // Call before the window exists: its settings, output folder and model cache come from here.
  bool prepare() {
    if (!m_tmp.isValid()) return fail(QStringLiteral("cannot create a temporary folder"));
    QSettings::setDefaultFormat(QSettings::IniFormat);
    QSettings::setPath(QSettings::IniFormat, QSettings::UserScope, m_tmp.filePath(QStringLiteral("settings")));
    qputenv("DIFFRACT_OUTPUT_DIR", m_tmp.filePath(QStringLiteral("out")).toLocal8Bit());
    qputenv("HF_HUB_CACHE", m_tmp.filePath(QStringLiteral("hub")).toLocal8Bit());
    if (!QDir().mkpath(m_dir)) return fail(QStringLiteral("cannot create %1").arg(m_dir));
    return true;
  }

  void start(MainWindow* w) {
    m_window = w;
    w->resize(1280, 800);
    w->findChild<QLineEdit*>(QStringLiteral("modelEdit"))->setText(m_model);
    w->findChild<QSpinBox*>(QStringLiteral("widthSpin"))->setValue(m_job.size);
    w->findChild<QSpinBox*>(QStringLiteral("heightSpin"))->setValue(m_job.size);
    w->findChild<QSpinBox*>(QStringLiteral("stepsSpin"))->setValue(m_job.steps);
    w->findChild<QCheckBox*>(QStringLiteral("randomSeedCheck"))->setChecked(false);
    w->findChild<QPlainTextEdit*>(QStringLiteral("promptEdit"))->setPlainText(m_job.prompt);
    w->findChild<QPlainTextEdit*>(QStringLiteral("negativeEdit"))->setPlainText(m_job.negative);
    connect(w->bridge(), &EngineBridge::failed, this,
            [this](const QString& message) { fail(QStringLiteral("generation failed: %1").arg(message)); });
    connect(w->bridge(), &EngineBridge::finished, this, [this] {
      // After the window's own slot has shown and saved the image.
      QTimer::singleShot(0, this, [this] {
        if (m_racing) return;  // the lanes end with their own signal
        const auto n = m_window->results().size();
        if (n < 2) generate(43);
        else if (n == 2) shootMain();
        else shootInpaintResult();
      });
    });
    // Room for the settings; the gallery has its own screenshot.
    if (auto* dock = w->findChild<QDockWidget*>(QStringLiteral("galleryDock")))
      w->resizeDocks({dock}, {190}, Qt::Vertical);
    generate(42);
  }

 private:
  void generate(int seed) {
    m_stage = QStringLiteral("generating with seed %1").arg(seed);
    m_window->findChild<QLineEdit*>(QStringLiteral("seedEdit"))->setText(QString::number(seed));
    std::printf("screenshots: %s after %.1f s\n", qPrintable(m_stage), m_clock.elapsed() / 1000.0);
    std::fflush(stdout);
    m_window->generate();
  }

  void shootMain() {
    m_stage = QStringLiteral("waiting for the gallery");
    std::printf("screenshots: %s after %.1f s\n", qPrintable(m_stage), m_clock.elapsed() / 1000.0);
    std::fflush(stdout);
    // The gallery reads the saved files off the GUI thread.
    auto* poll = new QTimer(this);
    connect(poll, &QTimer::timeout, this, [this, poll] {
      if (m_window->gallery()->entries().size() < 2) return;
      poll->deleteLater();
      QTimer::singleShot(200, this, [this] {
        if (!save(m_window->grab(), QStringLiteral("main-window.png"))) return;
        shootGallery();
      });
    });
    poll->start(50);
  }

  void shootGallery() {
    auto* dock = m_window->findChild<QDockWidget*>(QStringLiteral("galleryDock"));
    if (!dock) {
      fail(QStringLiteral("no gallery dock"));
      return;
    }
    dock->setFloating(true);
    dock->resize(900, 340);
    QTimer::singleShot(200, this, [this, dock] {
      if (!save(dock->grab(), QStringLiteral("gallery.png"))) return;
      dock->setFloating(false);
      shootCompare();
    });
  }

  void shootCompare() {
    m_stage = QStringLiteral("comparing");
    auto* view = m_window->compareResults(0, 1);
    if (!view) {
      fail(QStringLiteral("the compare view did not open"));
      return;
    }
    view->resize(1280, 800);
    connect(view, &diffract::ui::CompareView::computed, this, [this, view] {
      QTimer::singleShot(200, this, [this, view] {
        if (!save(view->grab(), QStringLiteral("compare.png"))) return;
        view->close();
        inpaint();
      });
    });
  }

  // The last result as input, a disc in its centre masked (white = repaint), another prompt.
  void inpaint() {
    m_stage = QStringLiteral("inpainting");
    const QImage last = m_window->results().back().image;
    m_window->inputPanel()->setImage(last, QStringLiteral("the last result"));
    QImage mask(last.size(), QImage::Format_Grayscale8);
    mask.fill(0);
    {
      QPainter p(&mask);
      p.setPen(Qt::NoPen);
      p.setBrush(Qt::white);
      const double r = last.width() * 0.3;
      p.drawEllipse(QPointF(last.width() / 2.0, last.height() / 2.0), r, r);
    }
    m_window->maskEditor()->setMask(mask);
    m_window->findChild<QPlainTextEdit*>(QStringLiteral("promptEdit"))->setPlainText(m_job.inpaintPrompt);
    QTimer::singleShot(200, this, [this] {
      if (!save(m_window->grab(), QStringLiteral("inpaint-mask.png"))) return;
      generate(44);
    });
  }

  void shootInpaintResult() {
    QTimer::singleShot(200, this, [this] {
      if (!save(m_window->grab(), QStringLiteral("inpaint.png"))) return;
      raceLanes();
    });
  }

  // The shipped "baseline vs DeepCache x3 vs step skip x3" lanes on the first prompt, without
  // the input image: lanes.png (the Lanes tab as the last lane ends) and lanes-compare.png (the
  // compare window the window opens on the baseline against the next lane).
  void raceLanes() {
    m_stage = QStringLiteral("racing lanes");
    m_racing = true;
    std::printf("screenshots: %s after %.1f s\n", qPrintable(m_stage), m_clock.elapsed() / 1000.0);
    std::fflush(stdout);
    QFile file(QStringLiteral(":/presets/lanes/baseline-vs-deepcache-vs-step-skip.json"));
    if (!file.open(QIODevice::ReadOnly)) {
      fail(QStringLiteral("the shipped lane setup is missing"));
      return;
    }
    try {
      m_window->lanesPanel()->setLaneSet(diffract::engine::parse_lane_set(file.readAll().toStdString(), "lanes"));
    } catch (const std::exception& e) {
      fail(QString::fromUtf8(e.what()));
      return;
    }
    m_window->inputPanel()->clear();
    m_window->findChild<QPlainTextEdit*>(QStringLiteral("promptEdit"))->setPlainText(m_job.prompt);
    m_window->findChild<QLineEdit*>(QStringLiteral("seedEdit"))->setText(QStringLiteral("42"));
    m_window->lanesPanel()->setChecked(true);
    connect(m_window, &MainWindow::compareOpened, this, [this](diffract::ui::CompareView* view) {
      view->resize(1280, 800);
      connect(view, &diffract::ui::CompareView::computed, this, [this, view] {
        QTimer::singleShot(200, this, [this, view] {
          if (!save(m_window->grab(), QStringLiteral("lanes.png"))) return;
          if (!save(view->grab(), QStringLiteral("lanes-compare.png"))) return;
          view->close();
          std::printf("screenshots: wrote main-window.png, gallery.png, compare.png, inpaint-mask.png, inpaint.png, "
                      "lanes.png, lanes-compare.png to %s\n",
                      qPrintable(m_dir));
          m_done = true;
          QApplication::exit(0);
        });
      });
    });
    m_window->generate();
  }

  bool save(const QPixmap& shot, const QString& name) {
    const QString path = QDir(m_dir).filePath(name);
    if (shot.isNull() || !shot.save(path, "PNG", 9)) return fail(QStringLiteral("cannot write %1").arg(path));
    std::printf("screenshots: %s after %.1f s\n", qPrintable(name), m_clock.elapsed() / 1000.0);
    return true;
  }

  bool fail(const QString& message) {
    if (m_done) return false;
    m_done = true;
    std::fprintf(stderr, "diffract: screenshots: %s\n", qPrintable(message));
    QApplication::exit(1);
    return false;
  }

  QString m_dir;
  QString m_model;
  Job m_job;
  QTemporaryDir m_tmp;
  MainWindow* m_window = nullptr;
  QString m_stage = QStringLiteral("starting");
  bool m_racing = false;
  bool m_done = false;
  QElapsedTimer m_clock;
};

}  // namespace

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName(QStringLiteral("Diffract"));
  QApplication::setOrganizationName(QStringLiteral("Diffract"));
  QApplication::setApplicationVersion(QStringLiteral(DIFFRACT_VERSION));
  QCommandLineParser parser;
  parser.setApplicationDescription(QStringLiteral("Fast interactive diffusion image generation"));
  parser.addHelpOption();
  parser.addVersionOption();
  parser.addPositionalArgument(QStringLiteral("png"), QStringLiteral("A PNG whose generation parameters to restore"),
                               QStringLiteral("[png]"));
  // Hidden: the documentation's screenshots (scripts/screenshots.sh).
  QCommandLineOption screenshots(QStringLiteral("screenshots"),
                                 QStringLiteral("Generate twice with --model and save screenshots into DIR"),
                                 QStringLiteral("DIR"));
  QCommandLineOption model(QStringLiteral("model"), QStringLiteral("The model for --screenshots"), QStringLiteral("PATH"));
  QCommandLineOption timeout(QStringLiteral("timeout"), QStringLiteral("Seconds --screenshots may take"),
                             QStringLiteral("S"), QStringLiteral("120"));
  QCommandLineOption prompt(QStringLiteral("prompt"), QStringLiteral("The prompt for --screenshots"), QStringLiteral("TEXT"),
                            QStringLiteral("a studio packshot of a red apple on a white background"));
  QCommandLineOption negative(QStringLiteral("negative"), QStringLiteral("The negative prompt for --screenshots"),
                              QStringLiteral("TEXT"), QStringLiteral("blurry"));
  QCommandLineOption size(QStringLiteral("size"), QStringLiteral("Image side for --screenshots"), QStringLiteral("PX"),
                          QStringLiteral("96"));
  QCommandLineOption steps(QStringLiteral("steps"), QStringLiteral("Steps for --screenshots"), QStringLiteral("N"),
                           QStringLiteral("10"));
  QCommandLineOption inpaintPrompt(QStringLiteral("inpaint-prompt"),
                                   QStringLiteral("The prompt --screenshots inpaints the masked centre with"),
                                   QStringLiteral("TEXT"), QStringLiteral("a yellow star in the centre"));
  for (QCommandLineOption* o : {&screenshots, &model, &timeout, &prompt, &negative, &size, &steps, &inpaintPrompt}) {
    o->setFlags(QCommandLineOption::HiddenFromHelp);
    parser.addOption(*o);
  }
  parser.process(app);

  std::unique_ptr<ScreenshotTour> tour;
  if (parser.isSet(screenshots)) {
    if (parser.value(model).isEmpty()) {
      std::fprintf(stderr, "diffract: --screenshots needs --model PATH (a diffusers folder or checkpoint)\n");
      return 2;
    }
    bool ok = false;
    const int seconds = parser.value(timeout).toInt(&ok);
    if (!ok || seconds <= 0) {
      std::fprintf(stderr, "diffract: --timeout '%s' is not a positive number of seconds\n", qPrintable(parser.value(timeout)));
      return 2;
    }
    ScreenshotTour::Job job{parser.value(prompt), parser.value(negative), parser.value(size).toInt(&ok), 0};
    if (!ok || job.size <= 0) {
      std::fprintf(stderr, "diffract: --size '%s' is not a positive number of pixels\n", qPrintable(parser.value(size)));
      return 2;
    }
    job.inpaintPrompt = parser.value(inpaintPrompt);
    job.steps = parser.value(steps).toInt(&ok);
    if (!ok || job.steps <= 0) {
      std::fprintf(stderr, "diffract: --steps '%s' is not a positive number\n", qPrintable(parser.value(steps)));
      return 2;
    }
    tour = std::make_unique<ScreenshotTour>(parser.value(screenshots), parser.value(model), job, seconds);
    if (!tour->prepare()) return 1;
  }

  diffract::ui::MainWindow window;
  window.show();
  if (tour) {
    tour->start(&window);
  } else if (!parser.positionalArguments().isEmpty()) {
    window.restoreFromPng(parser.positionalArguments().constFirst());
  }
  const int rc = QApplication::exec();
  // Closing the window cancelled the job; its blocks stop within one (models/common/cancel_point.h).
  // Should the engine still be busy two seconds on (a long CUDA graph, a decode), the process
  // ends without waiting for it: the settings are saved and every file is written whole.
  if (window.bridge()->isRunning())
    std::thread([rc] {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      std::fflush(nullptr);
      std::_Exit(rc);
    }).detach();
  return rc;
}
