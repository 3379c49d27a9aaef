#include "ui/main_window.h"
#include "ui/lane_grid.h"
#include "ui/job_queue.h"
#include "ui/lanes_panel.h"

#include <QApplication>
#include <QCheckBox>
#include <QCloseEvent>
#include <QComboBox>
#include <QDir>
#include <QDockWidget>
#include <QDoubleSpinBox>
#include <QDragEnterEvent>
#include <QDropEvent>
#include <QFile>
#include <QFutureWatcher>
#include <QMimeData>
#include <QtConcurrent/QtConcurrentRun>
#include <QFileDialog>
#include <QFileInfo>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QKeySequence>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QRandomGenerator>
#include <QScrollArea>
#include <QSet>
#include <QSettings>
#include <QSignalBlocker>
#include <QShortcut>
#include <QSpinBox>
#include <QSplitter>
#include <QStandardPaths>
#include <QStatusBar>
#include <QTabWidget>
#include <nlohmann/json.hpp>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <utility>
#include <exception>
#include <limits>
#include <optional>

#include "core/engine/model_discovery.h"
#include "core/engine/output.h"
#include "core/io/read_file.h"
#include "core/util/build_info.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "ui/compare_view.h"
#include "ui/devices_panel.h"
#include "ui/settings_panel.h"
#include "ui/gallery.h"
#include "ui/image_view.h"
#include "ui/input_panel.h"
#include "ui/controlnet_panel.h"
#include "ui/lora_panel.h"
#include "ui/mask_editor.h"
#include "ui/preset_bar.h"
#include "ui/timings_chart.h"
#include "ui/wheel_guard.h"

namespace diffract::ui {

namespace {

// The first local file among dragged URLs (or a file URL dragged as text), else "".
QString droppedFile(const QMimeData* mime) {
  if (!mime) return {};
  for (const QUrl& url : mime->urls())
    if (url.isLocalFile()) return url.toLocalFile();
  if (mime->hasText()) {
    const QUrl url(mime->text().trimmed());
    if (url.isLocalFile()) return url.toLocalFile();
  }
  return {};
}

struct RestoreOutcome {
  engine::PngParameters parameters;
  QImage image;  // the PNG itself, shown once its parameters are restored
  QString error;
};

// What a strategy's job saved, from its metadata: the plain loop's steps over the sequential
// model work a step cache ran, or over the rounds of one that runs fewer rounds than steps (step
// skipping, DRiffusion); 0 for the others (the plain loop, the exact parallel strategies, whose
// gain is each round's time on several devices, not measured here).
double strategySpeedup(const nlohmann::json& meta) {
  if (!meta.contains("strategy") || !meta["strategy"].is_object()) return 0;
  const auto& s = meta["strategy"];
  const int steps = s.value("steps", 0), rounds = s.value("rounds", 0);
  if (steps <= 0) return 0;
  if (s.contains("model_work") && s["model_work"].is_number()) {
    const double work = s["model_work"].get<double>();
    return work > 0 ? steps / work : 0;
  }
  return rounds > 0 && rounds < steps ? double(steps) / rounds : 0;
}

// A strategy's run in plain words, from a job's metadata: what it ran on, how much sequential
// model work it saved, and whether the image is the plain loop's; empty for the plain loop.
QString strategyResultText(const nlohmann::json& meta) {
  if (!meta.contains("strategy") || !meta["strategy"].is_object()) return {};
  const auto& s = meta["strategy"];
  const std::string name = s.value("strategy", std::string());
  const auto* info = parallel::find_strategy(name);
  if (!info || info == &parallel::strategies().front()) return {};  // the plain loop
  const int devices = s.value("devices", 1), steps = s.value("steps", 0), rounds = s.value("rounds", 0);
  QString text = QObject::tr("%1 on %2 %3").arg(QString::fromStdString(name)).arg(devices)
                     .arg(devices == 1 ? QObject::tr("device") : QObject::tr("devices"));
  if (s.contains("model_work") && s["model_work"].is_number() && steps > 0) {
    const double work = s["model_work"].get<double>();
    const auto reused = s.value("reused_steps", nlohmann::json::array()).size();
    text += QObject::tr(": %1 of %2 steps reused cached work, the model ran %3 steps' worth (%4× less)")
                .arg(reused).arg(steps).arg(work, 0, 'f', 1).arg(strategySpeedup(meta), 0, 'f', 2);
  } else if (rounds > 0 && rounds < steps) {
    text += QObject::tr(": %1 sequential rounds for %2 steps (%3× fewer)").arg(rounds).arg(steps)
                .arg(strategySpeedup(meta), 0, 'f', 2);
  } else if (steps > 0) {
    text += QObject::tr(": %1 rounds for %2 steps").arg(rounds).arg(steps);
  }
  text += info->exact ? QObject::tr("; the same image as one device") : QObject::tr("; the image changes a little");
  return text + QStringLiteral(". ") + QString::fromUtf8(info->hint.data(), static_cast<int>(info->hint.size()));
}

QString noModelHint() {
  return QObject::tr(
      "No model chosen yet. Pick a Stable Diffusion model under Model: a diffusers folder "
      "(with model_index.json) via Folder…, or a single .safetensors / .ckpt checkpoint via File… "
      "Models found in your Hugging Face cache are listed in the menu below it. "
      "Then write a prompt and press Generate (Ctrl+Enter).");
}

}  // namespace

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent), m_bridge(new EngineBridge(this)) {
  setObjectName(QStringLiteral("mainWindow"));
  setWindowTitle(QStringLiteral("Diffract"));
  m_prepareTimer = new QTimer(this);
  m_prepareTimer->setSingleShot(true);
  m_prepareTimer->setInterval(800);
  connect(m_prepareTimer, &QTimer::timeout, this, [this] {
    if (m_bridge->isRunning() || m_model->text().trimmed().isEmpty() || !deviceChoice().error.empty()) return;
    const auto r = requestFromFields();
    if (r.strategy.single()) m_bridge->prepare(r);
  });
  buildUi();
  loadSettings();
  schedulePrepare();
  m_gallery->setFolder(outputDir());

  connect(m_bridge, &EngineBridge::stageTimed, m_timings, &TimingsChart::setStage);
  connect(m_bridge, &EngineBridge::stepDone, this, &MainWindow::onStep);
  connect(m_bridge, &EngineBridge::previewReady, this, [this](int, const QImage& image, double decodeMs) {
    m_view->setImage(image, false);
    m_timings->addPreviewDecode(decodeMs);
  });
  connect(m_bridge, &EngineBridge::finished, this, &MainWindow::onFinished);
  connect(m_bridge, &EngineBridge::failed, this, [this](const QString& message) {
    showError(tr("Generation failed: %1").arg(message));
    m_status->setText(tr("Failed after %1").arg(formatSeconds(m_jobClock.elapsed() / 1000.0)));
    if (m_jobGrid) endGridCell(std::exchange(m_jobGrid, 0), m_jobGridCell, {}, {});
    updateControls();
  });
  connect(m_bridge, &EngineBridge::cancelled, this, [this] {
    m_status->setText(tr("Cancelled after %1 of %2 steps").arg(m_stepsSeen).arg(m_timings->totalSteps()));
    if (m_jobGrid) endGridCell(std::exchange(m_jobGrid, 0), m_jobGridCell, {}, {});
    updateControls();
  });
  connect(m_bridge, &EngineBridge::laneStarted, m_laneGrid, &LaneGrid::setStarted);
  connect(m_bridge, &EngineBridge::laneStep, m_laneGrid, &LaneGrid::setStep);
  connect(m_bridge, &EngineBridge::lanePreview, m_laneGrid, &LaneGrid::setPreview);
  connect(m_bridge, &EngineBridge::laneFinished, this,
          [this](int lane, const QList<QImage>& images, const QString& meta, const QString& params, const JobTimings& t) {
            m_laneGrid->setFinished(lane, images.isEmpty() ? QImage() : images.first(), t);
            if (lane >= 0 && lane < m_laneImages.size() && !images.isEmpty())
              m_laneImages[lane] = RenderedImage{images.first(), params, meta, t, QString()};
          });
  connect(m_bridge, &EngineBridge::laneFailed, m_laneGrid, &LaneGrid::setFailed);
  connect(m_bridge, &EngineBridge::laneCancelled, m_laneGrid, &LaneGrid::setCancelled);
  connect(m_bridge, &EngineBridge::lanesFinished, this, &MainWindow::onLanesFinished);
  // Whatever ended the job, the next one waiting starts (after the slots above have run).
  const auto next = [this] { QTimer::singleShot(0, this, &MainWindow::startNextQueued); };
  connect(m_bridge, &EngineBridge::failed, this, next);
  connect(m_bridge, &EngineBridge::cancelled, this, next);
  connect(m_bridge, &EngineBridge::finished, this, next);
  connect(m_bridge, &EngineBridge::lanesFinished, this, next);
  connect(m_laneGrid, &LaneGrid::compareRequested, this, [this](int lane) { compareLane(lane); });
  updateControls();
}

MainWindow::~MainWindow() { saveSettings(); }

void MainWindow::buildUi() {
  // Left: prompt and settings.
  auto* form = new QWidget;
  auto* formLayout = new QVBoxLayout(form);

  m_hint = new QLabel(noModelHint());
  m_hint->setObjectName(QStringLiteral("hintLabel"));
  m_hint->setWordWrap(true);
  m_hint->setFrameShape(QFrame::StyledPanel);
  m_hint->setMargin(6);
  formLayout->addWidget(m_hint);

  m_presetBar = new PresetBar;
  formLayout->addWidget(m_presetBar);
  connect(m_presetBar, &PresetBar::applied, this, [this](const engine::Preset& p) {
    m_settings->applyPreset(p);
    // A preset that names adapters sets those panels; one that names none leaves them as they are.
    QStringList missing;
    if (!p.loras.empty()) m_loraPanel->applyPreset(p.loras, missing);
    if (!p.controlnets.empty()) m_controlNetPanel->applyPreset(p.controlnets, missing);
    if (!missing.isEmpty()) m_status->setText(tr("Preset %1: not found: %2").arg(QString::fromStdString(p.name), missing.join(QStringLiteral(", "))));
    m_presetFingerprint = presetFingerprint();
    m_presetBar->setModified(false);
  });
  connect(m_presetBar, &PresetBar::saveRequested, this, [this](const QString& name) {
    const QString error = savePreset(name);
    if (!error.isEmpty()) showError(error);
  });

  m_settings = new SettingsPanel;
  formLayout->addWidget(m_settings, 3);
  m_prompt = m_settings->prompt();
  m_model = m_settings->model();
  m_taesd = m_settings->taesd();
  m_seed = m_settings->seed();
  m_strategy = m_settings->strategy();
  m_devices = m_settings->devices();
  connect(m_presetBar, &PresetBar::templateChanged, this, [this](const QString&, bool active) {
    m_prompt->setPlaceholderText(active ? tr("The subject: fills {subject} in the template (Ctrl+Enter generates)")
                                        : tr("What to draw (Ctrl+Enter generates)"));
  });
  // The form's changes the window acts on: the background prepare, the TAESD matched to the
  // model, the hint, the device summary.
  connect(m_model, &QLineEdit::textChanged, this, &MainWindow::schedulePrepare);
  connect(m_model, &QLineEdit::textChanged, this, [this] {
    matchTaesdToModel();
    updateControls();
  });
  connect(m_taesd, &QLineEdit::textChanged, this, &MainWindow::schedulePrepare);
  connect(m_taesd, &QLineEdit::textChanged, this, [this] {
    m_taesdMatched = false;
    m_taesd->setToolTip(QString());
  });
  for (QSpinBox* s : {m_settings->widthSpin(), m_settings->heightSpin(), m_settings->batch()})
    connect(s, &QSpinBox::valueChanged, this, &MainWindow::schedulePrepare);
  connect(m_settings->cfg(), &QDoubleSpinBox::valueChanged, this, &MainWindow::schedulePrepare);
  connect(m_strategy, &QComboBox::currentIndexChanged, this, [this] { updateDeviceSummary(); });
  connect(m_devices, &QSpinBox::valueChanged, this, [this] { updateDeviceSummary(); });
  // A preset's name stands only while the form holds its settings.
  for (QSpinBox* f : {m_settings->widthSpin(), m_settings->heightSpin(), m_settings->steps(), m_devices})
    connect(f, &QSpinBox::valueChanged, this, &MainWindow::notePresetChange);
  for (QDoubleSpinBox* f : {m_settings->cfg(), m_settings->guidance(), m_settings->cacheThreshold()})
    connect(f, &QDoubleSpinBox::valueChanged, this, &MainWindow::notePresetChange);
  for (QComboBox* f : {m_settings->sampler(), m_strategy, m_settings->precision()})
    connect(f, &QComboBox::currentIndexChanged, this, &MainWindow::notePresetChange);
  connect(m_settings->negative(), &QPlainTextEdit::textChanged, this, &MainWindow::notePresetChange);

  // The input image and its mask live in the editor on the right; the panel drives it.
  m_maskPane = new MaskEditorPane;
  m_inputPanel = new InputPanel(m_maskPane->editor());
  formLayout->addWidget(m_inputPanel);
  connect(m_inputPanel, &InputPanel::imageChanged, this, [this](bool has) {
    if (has) m_viewTabs->setCurrentWidget(m_maskPane);
  });
  connect(m_inputPanel, &InputPanel::notice, this, [this](const QString& text) { m_status->setText(text); });
  connect(m_inputPanel, &InputPanel::sizeSuggested, m_settings, &SettingsPanel::fitSizeTo);
  m_loraPanel = new LoraPanel;
  formLayout->addWidget(m_loraPanel);
  connect(m_loraPanel, &LoraPanel::insertText, this, [this](const QString& text) {
    const QString now = m_prompt->toPlainText().trimmed();
    m_prompt->setPlainText(now.isEmpty() ? text : now + QStringLiteral(", ") + text);
  });
  m_controlNetPanel = new ControlNetPanel;
  formLayout->addWidget(m_controlNetPanel);
  connect(m_controlNetPanel, &ControlNetPanel::notice, this, [this](const QString& text) { m_status->setText(text); });
  connect(m_controlNetPanel, &ControlNetPanel::inputImageWanted, this, [this](int unit) {
    if (!m_inputPanel->hasImage()) {
      m_status->setText(tr("There is no input image yet: open one in Input, or open the control image on the unit."));
      return;
    }
    m_controlNetPanel->setImage(unit, m_maskPane->editor()->inputImage(), tr("the input image"));
  });
  m_maskPane->editor()->setAcceptDrops(true);
  m_maskPane->editor()->installEventFilter(this);

  m_devicesPanel = new DevicesPanel;
  formLayout->addWidget(m_devicesPanel);
  connect(m_devicesPanel, &DevicesPanel::gpusChanged, this, &MainWindow::updateDeviceSummary);
  m_devicesPanel->refresh();

  m_lanesPanel = new LanesPanel;
  formLayout->addWidget(m_lanesPanel);
  connect(m_lanesPanel, &LanesPanel::changed, this, &MainWindow::updateLanePlan);
  connect(m_devicesPanel, &DevicesPanel::gpusChanged, this, &MainWindow::updateLanePlan);
  m_queuePanel = new JobQueuePanel;
  formLayout->addWidget(m_queuePanel);
  connect(m_queuePanel, &JobQueuePanel::variationsRequested, this, &MainWindow::queueVariations);
  connect(m_queuePanel, &JobQueuePanel::gridRequested, this, &MainWindow::queueGrid);
  connect(m_queuePanel, &JobQueuePanel::removed, this, [this](const QList<QueuedJob>& jobs) {
    for (const auto& j : jobs)
      if (j.grid) endGridCell(j.grid, j.gridCell, {}, {});
  });

  auto* buttons = new QHBoxLayout;
  m_generate = new QPushButton(tr("Generate"));
  m_generate->setObjectName(QStringLiteral("generateButton"));
  m_generate->setToolTip(tr("Ctrl+Enter"));
  m_generate->setDefault(true);
  m_cancel = new QPushButton(tr("Cancel"));
  m_cancel->setObjectName(QStringLiteral("cancelButton"));
  m_cancel->setToolTip(tr("Esc"));
  buttons->addWidget(m_generate, 1);
  buttons->addWidget(m_cancel);
  connect(m_generate, &QPushButton::clicked, this, &MainWindow::generate);
  connect(m_cancel, &QPushButton::clicked, this, &MainWindow::cancel);

  m_error = new QLabel;
  m_error->setObjectName(QStringLiteral("errorLabel"));
  m_error->setWordWrap(true);
  m_error->setTextInteractionFlags(Qt::TextSelectableByMouse | Qt::TextSelectableByKeyboard);
  m_error->setTextFormat(Qt::PlainText);
  m_error->setStyleSheet(QStringLiteral("color: #c62828;"));
  m_error->hide();
  m_restored = new QLabel;
  m_restored->setObjectName(QStringLiteral("restoredLabel"));
  m_restored->setWordWrap(true);
  m_restored->setTextFormat(Qt::PlainText);
  m_restored->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_restored->hide();
  formLayout->addWidget(m_restored);
  formLayout->addStretch(0);
  setAcceptDrops(true);
  // The prompt editors take text drops themselves; a dropped PNG restores parameters instead.
  m_prompt->viewport()->installEventFilter(this);
  m_settings->negative()->viewport()->installEventFilter(this);

  guardWheel(form);
  // Long entries (lane setups, T5 placements, model names) must not widen the form past its pane,
  // which cut off the rows' buttons at 1280 px: each combo shows what fits, its list the whole text.
  for (auto* combo : form->findChildren<QComboBox*>()) {
    combo->setSizeAdjustPolicy(QComboBox::AdjustToMinimumContentsLengthWithIcon);
    combo->setMinimumContentsLength(8);
  }
  auto* scroll = new QScrollArea;
  scroll->setObjectName(QStringLiteral("settingsScroll"));
  scroll->setWidget(form);
  scroll->setWidgetResizable(true);
  scroll->setMinimumWidth(300);
  // Generate, Cancel and the error stay in sight below the scrolled form, at any window height.
  auto* left = new QWidget;
  auto* leftLayout = new QVBoxLayout(left);
  leftLayout->setContentsMargins(0, 0, 0, 0);
  leftLayout->addWidget(scroll, 1);
  leftLayout->addLayout(buttons);
  leftLayout->addWidget(m_error);
  m_settingsWarning = new QLabel;
  m_settingsWarning->setObjectName(QStringLiteral("settingsWarning"));
  m_settingsWarning->setWordWrap(true);
  m_settingsWarning->setTextFormat(Qt::PlainText);
  m_settingsWarning->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_settingsWarning->setStyleSheet(QStringLiteral("color: #b26a00;"));
  m_settingsWarning->hide();
  leftLayout->addWidget(m_settingsWarning);

  // Right: the live view, its status line, the stage timings.
  m_view = new ImageView;
  m_status = new QLabel(tr("Ready"));
  m_status->setObjectName(QStringLiteral("statusLabel"));
  // Its text changes every step: keep that from re-laying-out the window each time.
  m_status->setSizePolicy(QSizePolicy::Ignored, QSizePolicy::Fixed);
  m_status->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_strategyResult = new QLabel;
  m_strategyResult->setObjectName(QStringLiteral("strategyResultLabel"));
  m_strategyResult->setWordWrap(true);
  m_strategyResult->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_strategyResult->hide();
  m_timings = new TimingsChart;
  auto* viewPane = new QWidget;
  auto* viewLayout = new QVBoxLayout(viewPane);
  viewLayout->setContentsMargins(0, 0, 0, 0);
  viewLayout->addWidget(m_view, 1);
  viewLayout->addWidget(m_strategyResult);
  auto* statusRow = new QHBoxLayout;
  statusRow->addWidget(m_status, 1);
  m_compare = new QPushButton(tr("Compare…"));
  m_compare->setObjectName(QStringLiteral("compareButton"));
  m_compare->setToolTip(tr("The last two images of this session side by side, their difference and PSNR / SSIM "
                           "(or select two in the gallery)"));
  statusRow->addWidget(m_compare);
  m_saveAs = new QPushButton(tr("Save as…"));
  m_saveAs->setObjectName(QStringLiteral("saveResultAsButton"));
  m_saveAs->setToolTip(tr("Write the last result to a file of your choice (also when saving it to the output folder failed)"));
  statusRow->addWidget(m_saveAs);
  connect(m_saveAs, &QPushButton::clicked, this, [this] {
    if (m_results.isEmpty()) return;
    const QString path = QFileDialog::getSaveFileName(this, tr("Save image as"), QStringLiteral("diffract.png"),
                                                      tr("PNG images (*.png)"));
    if (path.isEmpty()) return;
    const QString error = saveResultAs(static_cast<int>(m_results.size()) - 1, path);
    if (!error.isEmpty()) showError(error);
    else m_status->setText(tr("Saved %1").arg(QDir::toNativeSeparators(path)));
  });
  auto* useAsInput = new QPushButton(tr("Use as input"));
  useAsInput->setObjectName(QStringLiteral("useAsInputButton"));
  useAsInput->setToolTip(tr("Vary this result: it becomes the input image (paint a mask to repaint part of it)"));
  statusRow->addWidget(useAsInput);
  connect(useAsInput, &QPushButton::clicked, this, [this] {
    if (m_view->isFinal() && !m_view->image().isNull()) m_inputPanel->setImage(m_view->image(), tr("the last result"));
  });
  viewLayout->addLayout(statusRow);
  connect(m_compare, &QPushButton::clicked, this, [this] {
    if (m_results.size() >= 2) compareResults(static_cast<int>(m_results.size()) - 2, static_cast<int>(m_results.size()) - 1);
  });
  m_viewTabs = new QTabWidget;
  m_viewTabs->setObjectName(QStringLiteral("viewTabs"));
  m_viewTabs->addTab(viewPane, tr("Render"));
  m_viewTabs->addTab(m_maskPane, tr("Input && mask"));
  m_laneGrid = new LaneGrid;
  // Scrolled, so that many lanes (each tile with its chart and timings) never make the window
  // taller than the screen.
  m_laneScroll = new QScrollArea;
  m_laneScroll->setObjectName(QStringLiteral("laneScroll"));
  m_laneScroll->setWidgetResizable(true);
  m_laneScroll->setFrameShape(QFrame::NoFrame);
  m_laneScroll->setWidget(m_laneGrid);
  m_viewTabs->addTab(m_laneScroll, tr("Lanes"));
  m_viewSplitter = new QSplitter(Qt::Vertical);
  m_viewSplitter->setObjectName(QStringLiteral("viewSplitter"));
  m_viewSplitter->addWidget(m_viewTabs);
  m_viewSplitter->addWidget(m_timings);
  m_viewSplitter->setStretchFactor(0, 3);
  m_viewSplitter->setStretchFactor(1, 1);

  m_mainSplitter = new QSplitter(Qt::Horizontal);
  m_mainSplitter->setObjectName(QStringLiteral("mainSplitter"));
  m_mainSplitter->addWidget(left);
  m_mainSplitter->addWidget(m_viewSplitter);
  m_mainSplitter->setStretchFactor(1, 1);
  setCentralWidget(m_mainSplitter);

  m_gallery = new GalleryView;
  auto* galleryDock = new QDockWidget(tr("Gallery"));
  galleryDock->setObjectName(QStringLiteral("galleryDock"));
  galleryDock->setWidget(m_gallery);
  addDockWidget(Qt::BottomDockWidgetArea, galleryDock);
  connect(m_gallery, &GalleryView::restoreRequested, this, &MainWindow::restoreFromPng);
  connect(m_gallery, &GalleryView::compareRequested, this, &MainWindow::compareFiles);
  connect(m_gallery, &GalleryView::lanesRequested, this, &MainWindow::openSavedLanes);
  connect(m_gallery, &GalleryView::useAsInputRequested, this, [this](const QString& path) {
    QString error;
    if (!m_inputPanel->loadFile(path, &error)) showError(error);
  });

  auto* buildLabel = new QLabel(QString::fromStdString(describe(build_info())));
  buildLabel->setObjectName(QStringLiteral("buildInfoLabel"));
  statusBar()->addPermanentWidget(buildLabel);

  // Shortcuts work from anywhere in the window, the prompt editors included.
  for (const auto key : {Qt::Key_Return, Qt::Key_Enter}) {
    auto* go = new QShortcut(QKeySequence(Qt::CTRL | key), this);
    connect(go, &QShortcut::activated, this, &MainWindow::generate);
  }
  auto* stop = new QShortcut(QKeySequence(Qt::Key_Escape), this);
  stop->setObjectName(QStringLiteral("cancelShortcut"));
  connect(stop, &QShortcut::activated, this, &MainWindow::cancel);

  resize(1200, 760);
}

QString MainWindow::outputDir() {
  const QString pictures =
      QDir(QStandardPaths::writableLocation(QStandardPaths::PicturesLocation)).filePath(QStringLiteral("Diffract"));
  return QString::fromStdString(engine::output_dir(pictures.toStdString()).string());
}

QString MainWindow::matchingTaesd(const QString& modelDir) {
  return QString::fromStdString(engine::matching_taesd(modelDir.toStdString()).string());
}

void MainWindow::matchTaesdToModel() {
  if (!m_taesd) return;  // while the form is being built
  // A TAESD the user chose stays; one this window picked follows the model.
  if (!m_taesd->text().isEmpty() && !m_taesdMatched) return;
  const QString match = matchingTaesd(m_model->text().trimmed());
  QSignalBlocker block(m_taesd);
  m_taesd->setText(match);
  m_taesdMatched = !match.isEmpty();
  m_taesd->setToolTip(m_taesdMatched ? tr("Matched to the model from the Hugging Face cache") : QString());
}

QStringList MainWindow::discoverHuggingFaceModels() {
  QStringList models;
  for (const auto& path : engine::discover_hugging_face_models()) models << QString::fromStdString(path.string());
  return models;
}

job::GenerationRequest MainWindow::requestFromFields() {
  job::GenerationRequest r = m_settings->request();
  r.prompt = engine::fill_prompt_template(m_presetBar->promptTemplate().toStdString(), r.prompt);
  const engine::DeviceChoice choice = deviceChoice();
  r.device = choice.device;
  r.strategy.devices = choice.devices;
  r.strategy.skip = choice.skip;
  r.gpus = choice.gpus;
  m_inputPanel->fillRequest(r);
  m_loraPanel->fillRequest(r);
  return r;
}

std::optional<QueuedJob> MainWindow::jobFromFields() {
  m_error->hide();
  m_error->clear();
  m_restored->hide();
  if (m_model->text().trimmed().isEmpty()) {
    showError(tr("Choose a model first: a diffusers folder or a .safetensors / .ckpt checkpoint (Model, above)."));
    return std::nullopt;
  }
  if (m_settings->randomSeed()->isChecked()) m_seed->setText(QString::number(QRandomGenerator::global()->generate()));
  if (!seedValue()) {
    showError(tr("Seed '%1' is not a whole number from 0 to %2.")
                  .arg(m_seed->text())
                  .arg(std::numeric_limits<std::uint64_t>::max()));
    return std::nullopt;
  }
  const bool lanes = m_lanesPanel->lanesEnabled();
  if (lanes) {
    if (const QString problem = m_lanesPanel->problem(); !problem.isEmpty()) {
      showError(tr("Cannot start the lanes: %1").arg(problem));
      return std::nullopt;
    }
  } else if (const engine::DeviceChoice choice = deviceChoice(); !choice.error.empty()) {
    showError(tr("Cannot start: %1.").arg(QString::fromStdString(choice.error)));
    return std::nullopt;
  }
  auto request = requestFromFields();
  // The control images are made here, for the job only (not for the background prepare or a preset).
  if (const QString error = m_controlNetPanel->fillRequest(request); !error.isEmpty()) {
    showError(error);
    return std::nullopt;
  }
  QueuedJob job{request, m_controlNetPanel->requestUnits(), std::nullopt, {}};
  if (lanes) job.lanes = m_lanesPanel->laneSet();
  return job;
}

void MainWindow::generate() {
  auto job = jobFromFields();
  if (!job) return;
  saveSettings();
  if (m_bridge->isRunning()) {
    m_queuePanel->add(std::move(*job));
    m_status->setText(tr("Added to the queue (%n waiting)", nullptr, m_queuePanel->count()));
    return;
  }
  startJob(std::move(*job));
}

void MainWindow::queueVariations(int count) {
  auto job = jobFromFields();
  if (!job) return;
  saveSettings();
  for (int i = 0; i < count; ++i) {
    QueuedJob v = *job;
    v.request.seed = job->request.seed + static_cast<std::uint64_t>(i);
    v.label.clear();
    m_queuePanel->add(std::move(v));
  }
  m_status->setText(tr("Queued %1 seeds from %2").arg(count).arg(job->request.seed));
  startNextQueued();
}

void MainWindow::queueGrid(const QString& xParameter, const QString& xValues, const QString& yParameter,
                           const QString& yValues) {
  auto job = jobFromFields();
  if (!job) return;
  std::vector<engine::GridCell> cells;
  engine::GridAxis x;
  std::optional<engine::GridAxis> y;
  try {
    x = engine::parse_grid_axis(xParameter.toStdString(), xValues.toStdString());
    if (!yParameter.isEmpty()) y = engine::parse_grid_axis(yParameter.toStdString(), yValues.toStdString());
    cells = engine::expand_grid(job->request, x, y);
  } catch (const std::exception& e) {
    showError(tr("The grid cannot be queued: %1").arg(QString::fromUtf8(e.what())));
    m_status->setText(tr("The grid was not queued"));
    return;
  }
  m_error->hide();
  saveSettings();
  const int id = m_nextGrid++;
  for (std::size_t k = 0; k < cells.size(); ++k) {
    QueuedJob cell = *job;
    cell.request = cells[k].request;
    cell.label = describeJob(cell) + QStringLiteral(" · ") +
                 QString::fromStdString(engine::grid_label(x, cells[k].x) + (y ? ", " + engine::grid_label(*y, cells[k].y) : ""));
    cell.grid = id;
    cell.gridCell = static_cast<int>(k);
    m_queuePanel->add(std::move(cell));
  }
  m_grids.emplace(id, GridRun(x, y, std::move(cells)));
  m_status->setText(tr("Queued a grid of %1 × %2 jobs").arg(x.values.size()).arg(y ? y->values.size() : 1));
  startNextQueued();
}

void MainWindow::endGridCell(int grid, int cell, const QImage& image, const QString& savedFile) {
  const auto it = m_grids.find(grid);
  if (it == m_grids.end()) return;
  it->second.setCell(cell, image, savedFile);
  if (it->second.complete()) finishGrid(grid);
}

void MainWindow::finishGrid(int grid) {
  const auto it = m_grids.find(grid);
  if (it == m_grids.end()) return;
  const GridRun run = std::move(it->second);
  m_grids.erase(it);
  const QImage image = run.compose();
  m_view->setImage(image, true);
  const QDir dir(outputDir());
  const auto file = engine::unused_output_file(dir.path().toStdString(), engine::output_stamp(std::time(nullptr)), "grid", 0);
  const std::string json = run.json();
  try {
    if (!QDir().mkpath(dir.path())) throw Error("cannot create the output folder " + dir.path().toStdString());
    engine::save_png(file, toCoreImage(image), {{"diffract-grid", json}});
    io::write_file_atomically(std::filesystem::path(file).replace_extension(".json"), json + "\n", "grid");
    if (m_gallery->folder() == dir.path()) m_gallery->addFile(QString::fromStdString(file.string()));
    m_results.append(RenderedImage{image, QString(), QString::fromStdString(json), JobTimings{},
                                   QString::fromStdString(file.string())});
    m_status->setText(tr("Grid of %1 × %2 done: saved %3")
                          .arg(run.columns())
                          .arg(run.rows())
                          .arg(QDir::toNativeSeparators(QString::fromStdString(file.string()))));
  } catch (const std::exception& e) {
    m_results.append(RenderedImage{image, QString(), QString::fromStdString(json), JobTimings{}, QString()});
    showError(tr("The grid was made but not saved: %1").arg(QString::fromUtf8(e.what())));
  }
  updateControls();
}

void MainWindow::startNextQueued() {
  if (m_bridge->isRunning()) return;
  if (auto next = m_queuePanel->takeNext()) startJob(std::move(*next));
}

void MainWindow::startJob(QueuedJob job) {
  const auto& request = job.request;
  m_jobControlUnits = job.controlUnits;
  m_jobGrid = job.grid;
  m_jobGridCell = job.gridCell;
  if (job.lanes) {
    generateLanes(request, *job.lanes);
    return;
  }
  m_timings->reset(request.steps);
  m_stepsSeen = 0;
  m_stepMsSum = 0;
  m_jobClock.start();
  if (request.width > 0 && request.height > 0) m_view->setDisplaySize(QSize(request.width, request.height));
  // Only a model (or device) not run before is loaded: say so then, not on every job.
  const QString modelKey = QString::fromStdString(request.model + "\n" + request.device);
  m_status->setText(m_startedModels.contains(modelKey) ? tr("Starting…") : tr("Loading the model, then starting…"));
  m_startedModels.insert(modelKey);
  m_jobRequest = request;
  m_viewTabs->setCurrentIndex(0);
  m_bridge->start(request);
  updateControls();
}

void MainWindow::generateLanes(const job::GenerationRequest& request, const engine::LaneSet& lanes) {
  m_jobLanes = lanes;
  const auto plans = engine::plan_lanes(request, m_jobLanes, enabledGpus());
  QStringList titles, waiting;
  QList<int> steps;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    titles << QString::fromStdString(engine::lane_title(m_jobLanes.lanes[i]));
    steps << plans[i].request.steps;
    QStringList after;
    for (int j : plans[i].after) after << QString::number(j + 1);
    waiting << (after.isEmpty() ? QString() : tr("Waits for lane %1 (a shared device)").arg(after.join(QStringLiteral(", "))));
  }
  m_laneGrid->reset(titles, steps, waiting, m_jobLanes.baseline);
  m_laneImages = QList<RenderedImage>(static_cast<int>(plans.size()));
  m_laneResults.clear();
  m_stepsSeen = 0;
  m_stepMsSum = 0;
  m_jobClock.start();
  m_jobRequest = request;
  const std::string stamp = engine::output_stamp(std::time(nullptr));
  m_laneDir = QDir(outputDir()).filePath(QStringLiteral("lanes-%1-%2").arg(QString::fromStdString(stamp), m_seed->text()));
  m_status->setText(tr("Running %1 lanes…").arg(plans.size()));
  m_viewTabs->setCurrentWidget(m_laneScroll);
  m_bridge->startLanes(request, m_jobLanes, enabledGpus(), m_laneDir);
  updateControls();
}

void MainWindow::onLanesFinished(const QList<LaneRow>& rows, bool cancelled, const QString& savedFile,
                                 const QString& saveError) {
  m_laneGrid->setRows(rows);
  m_laneResults.clear();
  int done = 0;
  for (int i = 0; i < m_laneImages.size(); ++i) {
    if (m_laneImages[i].image.isNull()) {
      m_laneResults << -1;
      continue;
    }
    ++done;
    auto r = m_laneImages[i];
    if (!savedFile.isEmpty()) r.savedPath = QDir(m_laneDir).filePath(QString::fromStdString(engine::lane_file(i)));
    m_laneResults << static_cast<int>(m_results.size());
    m_results.append(r);
  }
  if (!saveError.isEmpty()) showError(tr("The lanes ran but were not saved: %1").arg(saveError));
  const QString took = formatSeconds(m_jobClock.elapsed() / 1000.0);
  if (cancelled) m_status->setText(tr("Lanes cancelled after %1 (%2 of %3 finished)").arg(took).arg(done).arg(rows.size()));
  else
    m_status->setText(tr("%1 of %2 lanes done in %3 · saved %4")
                          .arg(done)
                          .arg(rows.size())
                          .arg(took)
                          .arg(savedFile.isEmpty() ? tr("nothing") : QDir::toNativeSeparators(savedFile)));
  updateControls();
  // The comparison opens on the baseline against the first other lane that finished.
  if (cancelled) return;
  for (int i = 0; i < m_laneResults.size(); ++i)
    if (i != m_jobLanes.baseline && m_laneResults[i] >= 0) {
      compareLane(i);
      break;
    }
}

CompareView* MainWindow::compareLane(int lane) {
  const int baseline = m_jobLanes.baseline;
  if (lane < 0 || lane >= m_laneResults.size() || baseline >= m_laneResults.size() || m_laneResults[lane] < 0 ||
      m_laneResults[baseline] < 0)
    return nullptr;
  QList<CompareView::Item> items;
  int a = -1, b = -1;
  for (int i = 0; i < m_laneResults.size(); ++i) {
    if (m_laneResults[i] < 0) continue;
    const auto& r = m_results[m_laneResults[i]];
    if (i == baseline) a = static_cast<int>(items.size());
    if (i == lane) b = static_cast<int>(items.size());
    items.append({tr("Lane %1: %2").arg(i + 1).arg(QString::fromStdString(engine::lane_title(m_jobLanes.lanes[static_cast<std::size_t>(i)]))),
                  r.image, r.metadataJson});
  }
  auto* view = CompareView::openWindow(items, a, b, this);
  emit compareOpened(view);
  return view;
}

CompareView* MainWindow::openSavedLanes(const QString& lanesJson) {
  engine::SavedLaneGroup group;
  try {
    group = engine::read_lane_group(lanesJson.toStdString());
  } catch (const std::exception& e) {
    showError(tr("The lane group was not opened: %1").arg(QString::fromUtf8(e.what())));
    return nullptr;
  }
  QList<CompareView::Item> items;
  int a = -1, b = -1;
  for (std::size_t i = 0; i < group.lanes.size(); ++i) {
    const auto& lane = group.lanes[i];
    const QImage image = lane.image.empty() ? QImage() : QImage(QString::fromStdString(lane.image));
    if (image.isNull()) continue;
    if (static_cast<int>(i) == group.baseline) a = static_cast<int>(items.size());
    else if (b < 0) b = static_cast<int>(items.size());
    items.append({tr("Lane %1: %2").arg(i + 1).arg(QString::fromStdString(lane.title)), image,
                  image.text(QStringLiteral("diffract"))});
  }
  if (a < 0 || b < 0) {
    showError(tr("%1: the baseline lane and another lane must have finished (and their images be readable) to compare them")
                  .arg(QDir::toNativeSeparators(lanesJson)));
    return nullptr;
  }
  auto* view = CompareView::openWindow(items, a, b, this);
  emit compareOpened(view);
  return view;
}

void MainWindow::updateLanePlan() {
  if (!m_lanesPanel || !m_devicesPanel) return;
  m_lanesPanel->showPlan(requestFromFields(), enabledGpus());
}

void MainWindow::cancel() {
  if (!m_bridge->isRunning()) return;
  m_bridge->cancel();
  m_status->setText(tr("Cancelling…"));
}

void MainWindow::onStep(int index, int total, double, double ms, bool cached) {
  m_timings->setStep(index, total, ms, cached);
  ++m_stepsSeen;
  m_stepMsSum += ms;
  const double perStep = m_stepMsSum / m_stepsSeen;
  const double itPerSec = perStep > 0 ? 1000.0 / perStep : 0;
  const double eta = perStep * (total - index - 1) / 1000.0;
  m_status->setText(tr("Step %1/%2 · %3 it/s · ETA %4")
                        .arg(index + 1)
                        .arg(total)
                        .arg(itPerSec, 0, 'f', itPerSec >= 10 ? 1 : 2)
                        .arg(formatSeconds(eta)));
}

void MainWindow::onFinished(const QList<QImage>& images, const QString& metadataJson, const QString& parameters,
                            const JobTimings& timings) {
  m_timings->setTimings(timings);
  if (!images.isEmpty() && !timings.stepMs.isEmpty()) {
    double sum = 0;
    for (double ms : timings.stepMs) sum += ms;
    const double megapixels = double(images.first().width()) * images.first().height() * images.size() / 1e6;
    if (megapixels > 0) m_queuePanel->setStepCost(sum / timings.stepMs.size() / megapixels);
  }
  if (!images.isEmpty()) m_view->setImage(tileBatch(images), true);

  const QDir dir(outputDir());
  QString saveError;
  QString firstSaved;
  if (!QDir().mkpath(dir.path())) saveError = tr("cannot create the output folder %1").arg(dir.path());
  const std::string stamp = engine::output_stamp(std::time(nullptr));
  std::string metadata = metadataJson.toStdString();  // with the input's files once they are written
  for (int i = 0; i < images.size(); ++i) {
    RenderedImage r{images[i], parameters, metadataJson, timings, QString()};
    // This image's texts: the job's, with its place in the batch.
    const auto keep = [&] {
      const auto text = engine::batch_image_text(parameters.toStdString(), metadata, i, static_cast<int>(images.size()));
      r.parameters = QString::fromStdString(text.parameters);
      r.metadataJson = QString::fromStdString(text.metadata_json);
    };
    keep();
    if (saveError.isEmpty()) {
      try {
        const auto file = engine::unused_output_file(dir.path().toStdString(), stamp, std::to_string(m_jobRequest.seed), i);
        if (i == 0) {  // the inputs' files join the metadata of every image of the batch
          metadata = ControlNetPanel::addPreprocessors(
              engine::save_inputs_beside(file, m_jobRequest.input, m_jobRequest.controlnets, metadata), m_jobControlUnits);
          keep();
        }
        engine::save_image(file, toCoreImage(images[i]), r.parameters.toStdString(), r.metadataJson.toStdString());
        const QString path = QString::fromStdString(file.string());
        r.savedPath = path;
        if (firstSaved.isEmpty()) firstSaved = path;
        if (m_gallery->folder() == dir.path()) m_gallery->addFile(path);
      } catch (const std::exception& e) {
        saveError = QString::fromUtf8(e.what());
      }
    }
    m_results.append(r);
  }
  if (!saveError.isEmpty()) showError(tr("The image was made but not saved: %1").arg(saveError));
  m_status->setText(tr("Done in %1 · %2 it/s · saved %3")
                        .arg(formatSeconds(timings.totalMs / 1000.0))
                        .arg(m_stepMsSum > 0 ? 1000.0 * m_stepsSeen / m_stepMsSum : 0.0, 0, 'f', 2)
                        .arg(firstSaved.isEmpty() ? tr("nothing") : QDir::toNativeSeparators(firstSaved)));
  QString strategyText;
  try {
    const auto meta = nlohmann::json::parse(metadataJson.toStdString());
    strategyText = strategyResultText(meta);
    if (!strategyText.isEmpty())
      m_settings->noteStrategySpeedup(QString::fromStdString(meta["strategy"].value("strategy", std::string())),
                                      strategySpeedup(meta));
  } catch (const std::exception&) {
  }
  m_strategyResult->setText(strategyText);
  m_strategyResult->setVisible(!strategyText.isEmpty());
  if (m_jobGrid) endGridCell(std::exchange(m_jobGrid, 0), m_jobGridCell, images.isEmpty() ? QImage() : images.first(), firstSaved);
  updateControls();
}

QString MainWindow::saveResultAs(int index, const QString& path) {
  if (index < 0 || index >= m_results.size()) return tr("no result %1 to save").arg(index + 1);
  auto& r = m_results[index];
  try {
    engine::save_image(path.toStdString(), toCoreImage(r.image), r.parameters.toStdString(), r.metadataJson.toStdString());
  } catch (const std::exception& e) {
    return tr("The image was not saved: %1").arg(QString::fromUtf8(e.what()));
  }
  r.savedPath = path;
  return {};
}

void MainWindow::showError(const QString& message) {
  m_error->setText(message);
  m_error->show();
}

void MainWindow::updateControls() {
  const bool running = m_bridge->isRunning();
  const bool haveModel = !m_model->text().trimmed().isEmpty();
  m_cancel->setEnabled(running);
  m_compare->setEnabled(m_results.size() >= 2);
  m_saveAs->setEnabled(!m_results.isEmpty());
  m_generate->setText(running ? tr("Add to queue") : tr("Generate"));
  m_generate->setToolTip(running ? tr("Ctrl+Enter: this job runs after the running one (and those queued before it)")
                                 : tr("Ctrl+Enter"));
  m_hint->setVisible(!haveModel);
  m_view->setPlaceholder(haveModel ? tr("Press Generate (Ctrl+Enter) to see every step here.") : noModelHint());
}

void MainWindow::loadSettings() {
  QSettings s;
  // The TAESD first: setting the model (in the form's own settings) matches one only when none was saved.
  m_taesd->setText(s.value(QStringLiteral("taesd")).toString());
  m_taesdMatched = s.value(QStringLiteral("taesdMatched"), false).toBool();
  m_settings->loadSettings(s);
  // Every GPU is enabled until the user unticks it.
  QSet<int> disabledGpus;
  for (const QString& i : s.value(QStringLiteral("disabledGpus")).toStringList()) disabledGpus.insert(i.toInt());
  m_devicesPanel->setDisabledGpus(disabledGpus);
  m_loraPanel->setFolders(s.value(QStringLiteral("loraFolders")).toStringList());
  m_controlNetPanel->setFolders(s.value(QStringLiteral("controlNetFolders")).toStringList());
  reloadPresets(s.value(QStringLiteral("preset")).toString());
  if (s.value(QStringLiteral("presetChanged"), false).toBool() && m_presetBar->current()) {
    m_presetFingerprint.clear();  // changed before this session: stays marked until applied again
    m_presetBar->setModified(true);
  }
  if (const QString lanes = s.value(QStringLiteral("lanes/set")).toString(); !lanes.isEmpty()) {
    try {
      m_lanesPanel->setLaneSet(engine::parse_lane_set(lanes.toStdString(), "the saved lanes"));
    } catch (const std::exception& e) {
      m_status->setText(tr("The lanes of the last session were not restored: %1").arg(QString::fromUtf8(e.what())));
    }
  }
  m_lanesPanel->setChecked(s.value(QStringLiteral("lanes/enabled"), false).toBool());
  restoreGeometry(s.value(QStringLiteral("window/geometry")).toByteArray());
  restoreState(s.value(QStringLiteral("window/state")).toByteArray());
  m_mainSplitter->restoreState(s.value(QStringLiteral("window/mainSplitter")).toByteArray());
  m_viewSplitter->restoreState(s.value(QStringLiteral("window/viewSplitter")).toByteArray());
}

void MainWindow::saveSettings() {
  QSettings s;
  writeSettings(s);
  // QSettings writes a temporary file and renames it, so a failed write leaves the old settings
  // whole; the window says so (a full disk, a read-only file) and tries again at the next save.
  s.sync();
  if (s.status() == QSettings::NoError) {
    m_settingsWarning->hide();
    return;
  }
  const QString why = s.status() == QSettings::AccessError ? tr("it could not be written: is the disk full or the file read-only?")
                                                           : tr("the file is not a valid settings file");
  m_settingsWarning->setText(tr("Settings not saved to %1: %2 Your jobs and images are not affected; the next Generate "
                                "tries again.").arg(s.fileName(), why));
  m_settingsWarning->show();
  log::get("ui").warn("settings not saved to " + s.fileName().toStdString());
}

void MainWindow::writeSettings(QSettings& s) const {
  m_settings->saveSettings(s);
  s.setValue(QStringLiteral("taesd"), m_taesd->text());
  s.setValue(QStringLiteral("taesdMatched"), m_taesdMatched);
  const QSet<int> disabledGpus = m_devicesPanel->disabledGpus();
  QList<int> disabled(disabledGpus.begin(), disabledGpus.end());
  std::sort(disabled.begin(), disabled.end());
  QStringList disabledText;
  for (const int i : disabled) disabledText << QString::number(i);
  s.setValue(QStringLiteral("disabledGpus"), disabledText);
  s.setValue(QStringLiteral("loraFolders"), m_loraPanel->folders());
  s.setValue(QStringLiteral("controlNetFolders"), m_controlNetPanel->folders());
  s.setValue(QStringLiteral("preset"), m_presetBar->currentName());
  s.setValue(QStringLiteral("presetChanged"), m_presetBar->isModified());
  s.setValue(QStringLiteral("lanes/enabled"), m_lanesPanel->lanesEnabled());
  if (m_lanesPanel->problem().isEmpty())
    s.setValue(QStringLiteral("lanes/set"), QString::fromStdString(engine::lane_set_to_json(m_lanesPanel->laneSet())));
  s.setValue(QStringLiteral("window/geometry"), saveGeometry());
  s.setValue(QStringLiteral("window/state"), saveState());
  s.setValue(QStringLiteral("window/mainSplitter"), m_mainSplitter->saveState());
  s.setValue(QStringLiteral("window/viewSplitter"), m_viewSplitter->saveState());
}

std::optional<std::uint64_t> MainWindow::seedValue() const { return m_settings->seedValue(); }

const std::vector<engine::Preset>& MainWindow::presets() const { return m_presetBar->presets(); }

QString MainWindow::userPresetDir() { return PresetBar::userPresetDir(); }

void MainWindow::reloadPresets(const QString& select) {
  const QStringList problems = m_presetBar->reload(select);
  m_presetFingerprint = m_presetBar->current() ? presetFingerprint() : QString();
  if (!problems.isEmpty()) showError(tr("Some presets were skipped:\n%1").arg(problems.join(QLatin1Char('\n'))));
}

QString MainWindow::presetFingerprint() {
  job::GenerationRequest r = m_settings->request();
  r.strategy.devices = r.strategy.skip = m_devices->value();
  m_loraPanel->fillRequest(r);
  try {
    auto p = engine::preset_from_request("", engine::kSubjectPlaceholder, r);
    // What the preset leaves to the model (its native size, its sampler) follows the model: a
    // new model changing those fields is not the user changing the preset.
    if (const auto* active = m_presetBar->current()) {
      if (active->width == 0 || active->height == 0) p.width = p.height = 0;
      if (active->sampler.empty()) p.sampler.clear();
    }
    return QString::fromStdString(engine::preset_to_json(p));
  } catch (const std::exception& e) {
    return QString::fromUtf8(e.what());
  }
}

void MainWindow::notePresetChange() {
  if (!m_presetBar->current() || m_presetFingerprint.isEmpty()) return;
  m_presetBar->setModified(presetFingerprint() != m_presetFingerprint);
}

QString MainWindow::savePreset(const QString& name) {
  const QString prompt = m_prompt->toPlainText();
  job::GenerationRequest r = requestFromFields();
  // The preset keeps the devices field (a skip factor, or the count a CPU job takes), not what the
  // GPUs enabled on this machine make of it.
  r.strategy.devices = r.strategy.skip = m_devices->value();
  const bool promptIsTemplate = prompt.contains(QLatin1String(engine::kSubjectPlaceholder));
  QString file;
  try {
    auto preset = engine::preset_from_request(
        name.toStdString(), (promptIsTemplate ? prompt : m_presetBar->promptTemplate()).toStdString(), r);
    // The units as set, with or without their images (those belong to each job).
    preset.controlnets = m_controlNetPanel->presetControlNets();
    file = m_presetBar->save(preset);
  } catch (const std::exception& e) {
    return tr("The preset was not saved: %1").arg(QString::fromUtf8(e.what()));
  }
  // A prompt that was the template is now the preset's job: leave the subject to the user.
  if (promptIsTemplate) m_prompt->clear();
  reloadPresets(name);
  m_status->setText(tr("Saved preset %1 to %2").arg(name, QDir::toNativeSeparators(file)));
  return {};
}

bool MainWindow::eventFilter(QObject* watched, QEvent* event) {
  const auto type = event->type();
  if (type == QEvent::DragEnter || type == QEvent::DragMove || type == QEvent::Drop) {
    auto* drop = static_cast<QDropEvent*>(event);
    const QString file = droppedFile(drop->mimeData());
    if (watched == m_maskPane->editor()) {  // any image dropped on the editor is the input
      if (file.isEmpty() && !drop->mimeData()->hasImage()) return false;
      drop->acceptProposedAction();
      if (type == QEvent::Drop) {
        QString error;
        if (file.isEmpty()) m_inputPanel->setImage(qvariant_cast<QImage>(drop->mimeData()->imageData()), tr("a dropped image"));
        else if (!m_inputPanel->loadFile(file, &error)) showError(error);
      }
      return true;
    }
    if (file.endsWith(QLatin1String(".png"), Qt::CaseInsensitive)) {
      drop->acceptProposedAction();
      if (type == QEvent::Drop) restoreFromPng(file);
      return true;
    }
  }
  return QMainWindow::eventFilter(watched, event);
}

void MainWindow::dragEnterEvent(QDragEnterEvent* event) {
  if (!droppedFile(event->mimeData()).isEmpty()) event->acceptProposedAction();
}

void MainWindow::dragMoveEvent(QDragMoveEvent* event) {
  if (!droppedFile(event->mimeData()).isEmpty()) event->acceptProposedAction();
}

void MainWindow::dropEvent(QDropEvent* event) {
  const QString file = droppedFile(event->mimeData());
  if (file.isEmpty()) return;
  event->acceptProposedAction();
  // A PNG brings back the parameters it was made with; photos become the input; anything else
  // is tried as a PNG (and says why not).
  static const QStringList kPhotos = {QStringLiteral("jpg"), QStringLiteral("jpeg"), QStringLiteral("webp"),
                                      QStringLiteral("bmp"), QStringLiteral("tif"), QStringLiteral("tiff")};
  if (!kPhotos.contains(QFileInfo(file).suffix().toLower())) {
    restoreFromPng(file);
    return;
  }
  QString error;
  if (!m_inputPanel->loadFile(file, &error)) showError(error);
}

void MainWindow::restoreFromPng(const QString& png) {
  m_error->hide();
  m_restored->hide();
  m_status->setText(tr("Reading %1…").arg(QFileInfo(png).fileName()));
  auto* watcher = new QFutureWatcher<RestoreOutcome>(this);
  connect(watcher, &QFutureWatcher<RestoreOutcome>::finished, this, [this, watcher, png] {
    const RestoreOutcome outcome = watcher->result();
    watcher->deleteLater();
    if (!outcome.error.isEmpty()) {
      showError(tr("Cannot restore parameters: %1").arg(outcome.error));
      m_status->setText(tr("Nothing restored"));
      emit restoreFinished(false);
      return;
    }
    applyRestored(outcome.parameters, png);
    if (!outcome.image.isNull()) m_view->setImage(outcome.image, true);
    emit restoreFinished(true);
  });
  watcher->setFuture(QtConcurrent::run([path = png.toStdString()] {
    RestoreOutcome out;
    try {
      // One read: the picture and its text chunks.
      io::PngText text;
      out.image = toQImage(io::read_png(path, &text));
      out.parameters = engine::parse_png_parameters(text, path);
    } catch (const std::exception& e) {
      out.error = QString::fromUtf8(e.what());
    }
    return out;
  }));
}

void MainWindow::applyRestored(const engine::PngParameters& p, const QString& file) {
  QStringList restored;
  QStringList notRestored;
  for (const auto& u : p.unmapped) notRestored << QString::fromStdString(u);
  // The prompt is the whole prompt, not a subject for a template.
  m_presetBar->select(0);
  m_settings->restoreFields(p, restored, notRestored);
  if (p.device) {
    const QString device = QString::fromStdString(*p.device);
    // The job ran on that device alone (a strategy's other GPUs follow it: enable them to use them).
    if (m_devicesPanel->useOnly(device)) {
      restored << tr("device");
    } else {
      notRestored << tr("device: %1 (not on this machine)").arg(device);
    }
  }
  m_settings->restoreStrategy(p, restored, notRestored);
  m_inputPanel->restore(p, QFileInfo(file).dir(), restored, notRestored);
  const QString prompt = m_loraPanel->restore(p, restored, notRestored);
  m_controlNetPanel->restore(p, QFileInfo(file).dir(), restored, notRestored);
  if (p.prompt && prompt != m_prompt->toPlainText()) m_prompt->setPlainText(prompt);
  if (p.prompt_syntax && *p.prompt_syntax == "plain") notRestored << tr("prompt syntax: plain (the window reads A1111's)");

  const QString source = p.source == "diffract" ? QStringLiteral("Diffract")
                         : p.source == "a1111"  ? QStringLiteral("AUTOMATIC1111")
                                                : QStringLiteral("ComfyUI");
  QString message = tr("Restored from %1 (%2): %3.").arg(QFileInfo(file).fileName(), source,
                                                         restored.isEmpty() ? tr("nothing") : restored.join(QStringLiteral(", ")));
  if (!notRestored.isEmpty()) message += QLatin1Char('\n') + tr("Not restored: %1").arg(notRestored.join(QStringLiteral("; ")));
  m_restored->setText(message);
  m_restored->show();
  m_status->setText(tr("Parameters restored from %1").arg(QFileInfo(file).fileName()));
}

MaskEditor* MainWindow::maskEditor() const { return m_maskPane->editor(); }

CompareView* MainWindow::compareResults(int a, int b) {
  if (a < 0 || b < 0 || a >= m_results.size() || b >= m_results.size()) return nullptr;
  QList<CompareView::Item> items;
  for (int i = 0; i < m_results.size(); ++i) {
    const RenderedImage& r = m_results[i];
    const QString file = r.savedPath.isEmpty()          ? tr("(not saved)")
                         : QFileInfo::exists(r.savedPath) ? QFileInfo(r.savedPath).fileName()
                                                          : tr("%1 (file deleted)").arg(QFileInfo(r.savedPath).fileName());
    items.append({tr("#%1 %2").arg(i + 1).arg(file), r.image, r.metadataJson});
  }
  auto* view = CompareView::openWindow(items, a, b, this);
  emit compareOpened(view);
  return view;
}

void MainWindow::compareFiles(const QString& a, const QString& b) {
  using Loaded = QPair<QList<CompareView::Item>, QString>;
  auto* watcher = new QFutureWatcher<Loaded>(this);
  connect(watcher, &QFutureWatcher<Loaded>::finished, this, [this, watcher] {
    watcher->deleteLater();
    const Loaded loaded = watcher->result();
    if (!loaded.second.isEmpty()) {
      showError(tr("Cannot compare: %1").arg(loaded.second));
      return;
    }
    emit compareOpened(CompareView::openWindow(loaded.first, 0, 1, this));
  });
  watcher->setFuture(QtConcurrent::run([a, b] { return CompareView::readFiles({a, b}); }));
}

void MainWindow::setDevices(const std::vector<engine::DeviceInfo>& devices) { m_devicesPanel->setDevices(devices); }

std::vector<int> MainWindow::enabledGpus() const { return m_devicesPanel->enabledGpus(); }

engine::DeviceChoice MainWindow::deviceChoice() const {
  return engine::choose_devices(enabledGpus(), m_strategy->currentData().toString().toStdString(), m_devices->value());
}

const parallel::StrategyInfo& MainWindow::currentStrategy() const {
  return m_settings ? m_settings->strategyInfo() : parallel::strategy_info(std::string());
}

void MainWindow::schedulePrepare() {
  if (m_prepareTimer) m_prepareTimer->start();
}

void MainWindow::updateDeviceSummary() {
  if (!m_devicesPanel || !m_strategy || !m_devices) return;
  schedulePrepare();
  const auto choice = deviceChoice();
  m_devicesPanel->showChoice(choice, currentStrategy());
  // The size warning's memory estimate is for the GPU holding the model.
  std::optional<engine::DeviceInfo> gpu;
  if (choice.device.rfind("cuda:", 0) == 0) gpu = m_devicesPanel->gpu(std::atoi(choice.device.c_str() + 5));
  if (gpu)
    m_settings->setJobDevice(QStringLiteral("cuda:%1 (%2)").arg(gpu->index).arg(QString::fromStdString(gpu->name)),
                             gpu->total_bytes > gpu->used_bytes ? gpu->total_bytes - gpu->used_bytes : 0);
  else
    m_settings->setJobDevice({}, 0);
}

void MainWindow::closeEvent(QCloseEvent* event) {
  saveSettings();
  m_bridge->cancel();
  QMainWindow::closeEvent(event);
}

}  // namespace diffract::ui
