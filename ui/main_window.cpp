#include "ui/main_window.h"

#include <QApplication>
#include <QCheckBox>
#include <QCloseEvent>
#include <QComboBox>
#include <QDateTime>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QKeySequence>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QRandomGenerator>
#include <QScrollArea>
#include <QSettings>
#include <QShortcut>
#include <QSpinBox>
#include <QSplitter>
#include <QStandardPaths>
#include <QStatusBar>
#include <QToolButton>
#include <QVBoxLayout>
#include <exception>
#include <iterator>
#include <limits>

#include "core/io/image.h"
#include "core/util/build_info.h"
#include "core/util/embedded_model.h"
#include "ui/image_view.h"
#include "ui/timings_chart.h"

namespace diffract::ui {

namespace {

struct SizePreset {
  const char* label;
  int width;
  int height;
};

// 0x0: the model's native size. The SDXL entries are its training buckets (about 1 megapixel).
constexpr SizePreset kSizePresets[] = {
    {"Model default", 0, 0},
    {"512 × 512 (1:1)", 512, 512},
    {"768 × 768 (1:1)", 768, 768},
    {"1024 × 1024 (1:1, SDXL)", 1024, 1024},
    {"640 × 480 (4:3)", 640, 480},
    {"768 × 576 (4:3)", 768, 576},
    {"1152 × 864 (4:3)", 1152, 864},
    {"768 × 432 (16:9)", 768, 432},
    {"1024 × 576 (16:9)", 1024, 576},
    {"1344 × 768 (SDXL 16:9)", 1344, 768},
    {"768 × 1344 (SDXL 9:16)", 768, 1344},
    {"1152 × 896 (SDXL)", 1152, 896},
    {"896 × 1152 (SDXL)", 896, 1152},
    {"1216 × 832 (SDXL)", 1216, 832},
    {"832 × 1216 (SDXL)", 832, 1216},
    {"1536 × 640 (SDXL)", 1536, 640},
    {"640 × 1536 (SDXL)", 640, 1536},
};
constexpr int kCustomPreset = static_cast<int>(std::size(kSizePresets));

const char* const kSamplers[] = {"euler", "euler-ancestral", "ddim", "ddpm", "dpmpp-2m", "dpmpp-2m-karras"};

QString noModelHint() {
  return QObject::tr(
      "No model chosen yet. Pick a Stable Diffusion model under Model: a diffusers folder "
      "(with model_index.json) via Folder…, or a single .safetensors / .ckpt checkpoint via File… "
      "Models found in your Hugging Face cache are listed in the menu below it. "
      "Then write a prompt and press Generate (Ctrl+Enter).");
}

QString formatSeconds(double s) {
  if (s < 60) return QStringLiteral("%1 s").arg(s, 0, 'f', 1);
  return QStringLiteral("%1 min %2 s").arg(static_cast<int>(s) / 60).arg(static_cast<int>(s) % 60);
}

}  // namespace

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent), m_bridge(new EngineBridge(this)) {
  setObjectName(QStringLiteral("mainWindow"));
  setWindowTitle(QStringLiteral("Diffract"));
  buildUi();
  loadSettings();

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
    updateControls();
  });
  connect(m_bridge, &EngineBridge::cancelled, this, [this] {
    m_status->setText(tr("Cancelled after %1 of %2 steps").arg(m_stepsSeen).arg(m_timings->totalSteps()));
    updateControls();
  });
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

  formLayout->addWidget(new QLabel(tr("Prompt")));
  m_prompt = new QPlainTextEdit;
  m_prompt->setObjectName(QStringLiteral("promptEdit"));
  m_prompt->setPlaceholderText(tr("What to draw (Ctrl+Enter generates)"));
  m_prompt->setTabChangesFocus(true);
  formLayout->addWidget(m_prompt, 2);
  formLayout->addWidget(new QLabel(tr("Negative prompt")));
  m_negative = new QPlainTextEdit;
  m_negative->setObjectName(QStringLiteral("negativeEdit"));
  m_negative->setPlaceholderText(tr("What to avoid"));
  m_negative->setTabChangesFocus(true);
  formLayout->addWidget(m_negative, 1);

  auto* fields = new QFormLayout;
  formLayout->addLayout(fields);

  // Model: a path (folder or checkpoint) with browse buttons and the Hugging Face cache's models.
  auto* modelRow = new QHBoxLayout;
  m_model = new QLineEdit;
  m_model->setObjectName(QStringLiteral("modelEdit"));
  m_model->setPlaceholderText(tr("diffusers folder or .safetensors / .ckpt"));
  auto* modelFolder = new QToolButton;
  modelFolder->setObjectName(QStringLiteral("browseModelFolderButton"));
  modelFolder->setText(tr("Folder…"));
  auto* modelFile = new QToolButton;
  modelFile->setObjectName(QStringLiteral("browseModelFileButton"));
  modelFile->setText(tr("File…"));
  modelRow->addWidget(m_model, 1);
  modelRow->addWidget(modelFolder);
  modelRow->addWidget(modelFile);
  fields->addRow(tr("Model"), modelRow);
  connect(modelFolder, &QToolButton::clicked, this, [this] {
    const QString dir = QFileDialog::getExistingDirectory(this, tr("Diffusers model folder"), m_model->text());
    if (!dir.isEmpty()) m_model->setText(dir);
  });
  connect(modelFile, &QToolButton::clicked, this, [this] {
    const QString file = QFileDialog::getOpenFileName(this, tr("Checkpoint"), QFileInfo(m_model->text()).path(),
                                                      tr("Checkpoints (*.safetensors *.ckpt)"));
    if (!file.isEmpty()) m_model->setText(file);
  });
  connect(m_model, &QLineEdit::textChanged, this, [this] { updateControls(); });

  m_discovered = new QComboBox;
  m_discovered->setObjectName(QStringLiteral("discoveredModelsCombo"));
  const QStringList found = discoverHuggingFaceModels();
  m_discovered->addItem(found.isEmpty() ? tr("No models in the Hugging Face cache")
                                        : tr("%n model(s) in the Hugging Face cache", nullptr, static_cast<int>(found.size())));
  for (const QString& path : found) {
    // models--org--name/snapshots/<hash> reads as org/name.
    const QString repo = QDir(path).absolutePath().section(QLatin1Char('/'), -3, -3);
    m_discovered->addItem(repo.mid(8).replace(QStringLiteral("--"), QStringLiteral("/")), path);
  }
  m_discovered->setEnabled(!found.isEmpty());
  connect(m_discovered, &QComboBox::activated, this, [this](int index) {
    if (index > 0) m_model->setText(m_discovered->itemData(index).toString());
  });
  fields->addRow(QString(), m_discovered);

  auto* taesdRow = new QHBoxLayout;
  m_taesd = new QLineEdit;
  m_taesd->setObjectName(QStringLiteral("taesdEdit"));
  m_taesd->setPlaceholderText(tr("optional: full-size previews"));
  auto* taesdBrowse = new QToolButton;
  taesdBrowse->setObjectName(QStringLiteral("browseTaesdButton"));
  taesdBrowse->setText(tr("Folder…"));
  taesdRow->addWidget(m_taesd, 1);
  taesdRow->addWidget(taesdBrowse);
  fields->addRow(tr("TAESD"), taesdRow);
  connect(taesdBrowse, &QToolButton::clicked, this, [this] {
    const QString dir = QFileDialog::getExistingDirectory(this, tr("TAESD folder"), m_taesd->text());
    if (!dir.isEmpty()) m_taesd->setText(dir);
  });

  m_sizePreset = new QComboBox;
  m_sizePreset->setObjectName(QStringLiteral("sizePresetCombo"));
  for (const auto& p : kSizePresets) m_sizePreset->addItem(QString::fromUtf8(p.label));
  m_sizePreset->addItem(tr("Custom"));
  fields->addRow(tr("Size"), m_sizePreset);
  auto* sizeRow = new QHBoxLayout;
  m_width = new QSpinBox;
  m_width->setObjectName(QStringLiteral("widthSpin"));
  m_height = new QSpinBox;
  m_height->setObjectName(QStringLiteral("heightSpin"));
  for (QSpinBox* s : {m_width, m_height}) {
    s->setRange(0, 8192);
    s->setSingleStep(8);
    s->setSpecialValueText(tr("model"));
    sizeRow->addWidget(s, 1);
  }
  sizeRow->insertWidget(1, new QLabel(QStringLiteral("×")));
  fields->addRow(QString(), sizeRow);
  connect(m_sizePreset, &QComboBox::activated, this, &MainWindow::applySizePreset);
  for (QSpinBox* s : {m_width, m_height})
    connect(s, &QSpinBox::valueChanged, this, [this] {
      // Typing a size that no preset has switches to Custom.
      for (int i = 0; i < kCustomPreset; ++i)
        if (kSizePresets[i].width == m_width->value() && kSizePresets[i].height == m_height->value()) {
          m_sizePreset->setCurrentIndex(i);
          return;
        }
      m_sizePreset->setCurrentIndex(kCustomPreset);
    });

  m_steps = new QSpinBox;
  m_steps->setObjectName(QStringLiteral("stepsSpin"));
  m_steps->setRange(1, 1000);
  m_steps->setValue(30);
  fields->addRow(tr("Steps"), m_steps);

  m_cfg = new QDoubleSpinBox;
  m_cfg->setObjectName(QStringLiteral("cfgSpin"));
  m_cfg->setRange(0, 30);
  m_cfg->setSingleStep(0.5);
  m_cfg->setDecimals(1);
  m_cfg->setValue(7.0);
  m_cfg->setToolTip(tr("Classifier-free guidance; 1 or less turns it off"));
  fields->addRow(tr("CFG"), m_cfg);

  auto* seedRow = new QHBoxLayout;
  m_seed = new QSpinBox;
  m_seed->setObjectName(QStringLiteral("seedSpin"));
  m_seed->setRange(0, std::numeric_limits<int>::max());
  m_randomSeed = new QCheckBox(tr("Randomise"));
  m_randomSeed->setObjectName(QStringLiteral("randomSeedCheck"));
  m_randomSeed->setToolTip(tr("A new seed for every job; untick to lock the seed"));
  seedRow->addWidget(m_seed, 1);
  seedRow->addWidget(m_randomSeed);
  fields->addRow(tr("Seed"), seedRow);

  m_sampler = new QComboBox;
  m_sampler->setObjectName(QStringLiteral("samplerCombo"));
  m_sampler->addItem(tr("model default"), QString());
  for (const char* s : kSamplers) m_sampler->addItem(QString::fromLatin1(s), QString::fromLatin1(s));
  fields->addRow(tr("Sampler"), m_sampler);

  m_batch = new QSpinBox;
  m_batch->setObjectName(QStringLiteral("batchSpin"));
  m_batch->setRange(1, 16);
  fields->addRow(tr("Batch"), m_batch);

  // Devices: CPU always; each CUDA device this build can use.
  m_device = new QComboBox;
  m_device->setObjectName(QStringLiteral("deviceCombo"));
  const BuildInfo info = build_info();
  m_device->addItem(tr("CPU"), QStringLiteral("cpu"));
  for (int i = 0; i < info.cuda_devices; ++i)
    m_device->addItem(tr("CUDA %1").arg(i), QStringLiteral("cuda:%1").arg(i));
  if (info.cuda_devices > 0) m_device->setCurrentIndex(1);
  m_device->setToolTip(info.cuda_devices > 0 ? tr("%n CUDA device(s)", nullptr, info.cuda_devices)
                                             : tr("No CUDA device: generating on the CPU"));
  fields->addRow(tr("Device"), m_device);

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
  formLayout->addLayout(buttons);
  connect(m_generate, &QPushButton::clicked, this, &MainWindow::generate);
  connect(m_cancel, &QPushButton::clicked, this, &MainWindow::cancel);

  m_error = new QLabel;
  m_error->setObjectName(QStringLiteral("errorLabel"));
  m_error->setWordWrap(true);
  m_error->setTextInteractionFlags(Qt::TextSelectableByMouse | Qt::TextSelectableByKeyboard);
  m_error->setTextFormat(Qt::PlainText);
  m_error->setStyleSheet(QStringLiteral("color: #c62828;"));
  m_error->hide();
  formLayout->addWidget(m_error);
  formLayout->addStretch(0);

  auto* scroll = new QScrollArea;
  scroll->setWidget(form);
  scroll->setWidgetResizable(true);
  scroll->setMinimumWidth(300);

  // Right: the live view, its status line, the stage timings.
  m_view = new ImageView;
  m_status = new QLabel(tr("Ready"));
  m_status->setObjectName(QStringLiteral("statusLabel"));
  // Its text changes every step: keep that from re-laying-out the window each time.
  m_status->setSizePolicy(QSizePolicy::Ignored, QSizePolicy::Fixed);
  m_status->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_timings = new TimingsChart;
  auto* viewPane = new QWidget;
  auto* viewLayout = new QVBoxLayout(viewPane);
  viewLayout->setContentsMargins(0, 0, 0, 0);
  viewLayout->addWidget(m_view, 1);
  viewLayout->addWidget(m_status);
  m_viewSplitter = new QSplitter(Qt::Vertical);
  m_viewSplitter->setObjectName(QStringLiteral("viewSplitter"));
  m_viewSplitter->addWidget(viewPane);
  m_viewSplitter->addWidget(m_timings);
  m_viewSplitter->setStretchFactor(0, 3);
  m_viewSplitter->setStretchFactor(1, 1);

  m_mainSplitter = new QSplitter(Qt::Horizontal);
  m_mainSplitter->setObjectName(QStringLiteral("mainSplitter"));
  m_mainSplitter->addWidget(scroll);
  m_mainSplitter->addWidget(m_viewSplitter);
  m_mainSplitter->setStretchFactor(1, 1);
  setCentralWidget(m_mainSplitter);

  auto* buildLabel = new QLabel(QString::fromStdString(describe(info)));
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

void MainWindow::applySizePreset(int index) {
  if (index < 0 || index >= kCustomPreset) return;  // Custom: keep the spin boxes as they are
  const QSignalBlocker bw(m_width), bh(m_height);
  m_width->setValue(kSizePresets[index].width);
  m_height->setValue(kSizePresets[index].height);
}

QString MainWindow::outputDir() {
  const QByteArray env = qgetenv("DIFFRACT_OUTPUT_DIR");
  if (!env.isEmpty()) return QString::fromLocal8Bit(env);
  return QDir(QStandardPaths::writableLocation(QStandardPaths::PicturesLocation)).filePath(QStringLiteral("Diffract"));
}

QStringList MainWindow::discoverHuggingFaceModels() {
  QString hub = qEnvironmentVariable("HF_HUB_CACHE");
  if (hub.isEmpty()) {
    const QString home = qEnvironmentVariable("HF_HOME");
    hub = home.isEmpty() ? QDir::home().filePath(QStringLiteral(".cache/huggingface/hub"))
                         : QDir(home).filePath(QStringLiteral("hub"));
  }
  QStringList models;
  const QDir hubDir(hub);
  for (const QString& repo : hubDir.entryList({QStringLiteral("models--*")}, QDir::Dirs | QDir::NoDotAndDotDot, QDir::Name)) {
    const QDir snapshots(hubDir.filePath(repo + QStringLiteral("/snapshots")));
    // The newest snapshot of each repository that is a diffusers pipeline.
    const QFileInfoList snaps = snapshots.entryInfoList(QDir::Dirs | QDir::NoDotAndDotDot, QDir::Time);
    for (const QFileInfo& snap : snaps)
      if (QFileInfo::exists(QDir(snap.filePath()).filePath(QStringLiteral("model_index.json")))) {
        models << snap.filePath();
        break;
      }
  }
  return models;
}

engine::GenerationRequest MainWindow::requestFromFields() {
  engine::GenerationRequest r;
  r.model = m_model->text().trimmed().toStdString();
  r.taesd = m_taesd->text().trimmed().toStdString();
  r.prompt = m_prompt->toPlainText().toStdString();
  r.negative_prompt = m_negative->toPlainText().toStdString();
  r.width = m_width->value();
  r.height = m_height->value();
  r.steps = m_steps->value();
  r.cfg = m_cfg->value();
  r.seed = static_cast<std::uint64_t>(m_seed->value());
  r.sampler = m_sampler->currentData().toString().toStdString();
  r.device = m_device->currentData().toString().toStdString();
  r.batch = m_batch->value();
  r.preview_every = 1;
  return r;
}

void MainWindow::generate() {
  m_error->hide();
  m_error->clear();
  if (m_model->text().trimmed().isEmpty()) {
    showError(tr("Choose a model first: a diffusers folder or a .safetensors / .ckpt checkpoint (Model, above)."));
    return;
  }
  if (m_randomSeed->isChecked())
    m_seed->setValue(static_cast<int>(QRandomGenerator::global()->bounded(std::numeric_limits<int>::max())));
  const auto request = requestFromFields();
  m_timings->reset(request.steps);
  m_stepsSeen = 0;
  m_stepMsSum = 0;
  m_jobClock.start();
  if (request.width > 0 && request.height > 0) m_view->setDisplaySize(QSize(request.width, request.height));
  m_status->setText(tr("Starting (the first job with a model loads it)…"));
  m_bridge->start(request);
  saveSettings();
  updateControls();
}

void MainWindow::cancel() {
  if (!m_bridge->isRunning()) return;
  m_bridge->cancel();
  m_status->setText(tr("Cancelling…"));
}

void MainWindow::onStep(int index, int total, double, double ms) {
  m_timings->setStep(index, total, ms);
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
  if (!images.isEmpty()) m_view->setImage(images.first(), true);

  const QDir dir(outputDir());
  QString saveError;
  QString firstSaved;
  if (!QDir().mkpath(dir.path())) saveError = tr("cannot create the output folder %1").arg(dir.path());
  const QString stamp = QDateTime::currentDateTime().toString(QStringLiteral("yyyyMMdd-HHmmss"));
  for (int i = 0; i < images.size(); ++i) {
    RenderedImage r{images[i], parameters, metadataJson, timings, QString()};
    if (saveError.isEmpty()) {
      QString path;
      for (int n = 0;; ++n) {  // never overwrite an earlier image
        path = dir.filePath(QStringLiteral("%1-%2-%3%4.png")
                                .arg(stamp)
                                .arg(m_seed->value())
                                .arg(i)
                                .arg(n ? QStringLiteral("-%1").arg(n) : QString()));
        if (!QFileInfo::exists(path)) break;
      }
      try {
        io::write_png(path.toStdString(), toCoreImage(images[i]),
                      {{"parameters", parameters.toStdString()}, {"diffract", metadataJson.toStdString()}});
        r.savedPath = path;
        if (firstSaved.isEmpty()) firstSaved = path;
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
  updateControls();
}

void MainWindow::showError(const QString& message) {
  m_error->setText(message);
  m_error->show();
}

void MainWindow::updateControls() {
  const bool running = m_bridge->isRunning();
  const bool haveModel = !m_model->text().trimmed().isEmpty();
  m_cancel->setEnabled(running);
  m_generate->setText(running ? tr("Restart") : tr("Generate"));
  m_hint->setVisible(!haveModel);
  m_view->setPlaceholder(haveModel ? tr("Press Generate (Ctrl+Enter) to see every step here.") : noModelHint());
}

void MainWindow::loadSettings() {
  QSettings s;
  m_prompt->setPlainText(s.value(QStringLiteral("prompt")).toString());
  m_negative->setPlainText(s.value(QStringLiteral("negativePrompt")).toString());
  // First start: the embedded emoji model, when this build or installation has it.
  m_model->setText(s.value(QStringLiteral("model"), QString::fromStdString(embedded_model_dir().string())).toString());
  m_taesd->setText(s.value(QStringLiteral("taesd")).toString());
  m_width->setValue(s.value(QStringLiteral("width"), 0).toInt());
  m_height->setValue(s.value(QStringLiteral("height"), 0).toInt());
  m_steps->setValue(s.value(QStringLiteral("steps"), 30).toInt());
  m_cfg->setValue(s.value(QStringLiteral("cfg"), 7.0).toDouble());
  m_seed->setValue(s.value(QStringLiteral("seed"), 0).toInt());
  m_randomSeed->setChecked(s.value(QStringLiteral("randomSeed"), true).toBool());
  const int sampler = m_sampler->findData(s.value(QStringLiteral("sampler")).toString());
  m_sampler->setCurrentIndex(std::max(0, sampler));
  m_batch->setValue(s.value(QStringLiteral("batch"), 1).toInt());
  const int device = m_device->findData(s.value(QStringLiteral("device")).toString());
  if (device >= 0) m_device->setCurrentIndex(device);
  restoreGeometry(s.value(QStringLiteral("window/geometry")).toByteArray());
  restoreState(s.value(QStringLiteral("window/state")).toByteArray());
  m_mainSplitter->restoreState(s.value(QStringLiteral("window/mainSplitter")).toByteArray());
  m_viewSplitter->restoreState(s.value(QStringLiteral("window/viewSplitter")).toByteArray());
}

void MainWindow::saveSettings() const {
  QSettings s;
  s.setValue(QStringLiteral("prompt"), m_prompt->toPlainText());
  s.setValue(QStringLiteral("negativePrompt"), m_negative->toPlainText());
  s.setValue(QStringLiteral("model"), m_model->text());
  s.setValue(QStringLiteral("taesd"), m_taesd->text());
  s.setValue(QStringLiteral("width"), m_width->value());
  s.setValue(QStringLiteral("height"), m_height->value());
  s.setValue(QStringLiteral("steps"), m_steps->value());
  s.setValue(QStringLiteral("cfg"), m_cfg->value());
  s.setValue(QStringLiteral("seed"), m_seed->value());
  s.setValue(QStringLiteral("randomSeed"), m_randomSeed->isChecked());
  s.setValue(QStringLiteral("sampler"), m_sampler->currentData().toString());
  s.setValue(QStringLiteral("batch"), m_batch->value());
  s.setValue(QStringLiteral("device"), m_device->currentData().toString());
  s.setValue(QStringLiteral("window/geometry"), saveGeometry());
  s.setValue(QStringLiteral("window/state"), saveState());
  s.setValue(QStringLiteral("window/mainSplitter"), m_mainSplitter->saveState());
  s.setValue(QStringLiteral("window/viewSplitter"), m_viewSplitter->saveState());
}

void MainWindow::closeEvent(QCloseEvent* event) {
  saveSettings();
  m_bridge->cancel();
  QMainWindow::closeEvent(event);
}

}  // namespace diffract::ui
