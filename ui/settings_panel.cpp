#include "ui/settings_panel.h"

#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QLineEdit>
#include <QPlainTextEdit>
#include <QRegularExpressionValidator>
#include <QSettings>
#include <QSignalBlocker>
#include <QSpinBox>
#include <QToolButton>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "core/engine/model_discovery.h"
#include "core/job/request.h"
#include "core/text/clip_tokenizer.h"
#include "core/util/embedded_model.h"
#include "core/util/memory.h"
#include "ui/prompt_highlighter.h"
#include "core/job/sizes.h"
#include "core/schedulers/sampler.h"
#include "core/util/embedded_model.h"

namespace diffract::ui {

namespace {

// The entry after job::size_presets(): the spin boxes as the user set them.
int customPreset() { return static_cast<int>(job::size_presets().size()); }

}  // namespace

SettingsPanel::SettingsPanel(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  layout->addWidget(new QLabel(tr("Prompt")));
  m_prompt = new QPlainTextEdit;
  m_prompt->setObjectName(QStringLiteral("promptEdit"));
  m_prompt->setPlaceholderText(tr("What to draw (Ctrl+Enter generates)"));
  m_prompt->setTabChangesFocus(true);
  layout->addWidget(m_prompt, 2);
  m_promptTokens = new QLabel;
  m_promptTokens->setObjectName(QStringLiteral("promptTokens"));
  m_promptTokens->setTextFormat(Qt::PlainText);
  m_promptTokens->setWordWrap(true);
  m_promptTokens->setStyleSheet(QStringLiteral("color: palette(mid);"));
  layout->addWidget(m_promptTokens);
  m_highlighter = new PromptHighlighter(m_prompt->document());
  layout->addWidget(new QLabel(tr("Negative prompt")));
  m_negative = new QPlainTextEdit;
  m_negative->setObjectName(QStringLiteral("negativeEdit"));
  m_negative->setPlaceholderText(tr("What to avoid"));
  m_negative->setTabChangesFocus(true);
  layout->addWidget(m_negative, 1);
  m_negativeHighlighter = new PromptHighlighter(m_negative->document());
  connect(m_prompt, &QPlainTextEdit::textChanged, this, &SettingsPanel::updatePromptTokens);

  auto* fields = new QFormLayout;
  layout->addLayout(fields);

  // Model: a path (folder or checkpoint) with browse buttons and the Hugging Face cache's models.
  auto* modelRow = new QHBoxLayout;
  m_model = new QLineEdit;
  connect(m_model, &QLineEdit::textChanged, this, &SettingsPanel::updatePromptTokens);
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

  m_discovered = new QComboBox;
  m_discovered->setObjectName(QStringLiteral("discoveredModelsCombo"));
  QStringList found;
  for (const auto& path : engine::discover_hugging_face_models()) found << QString::fromStdString(path.string());
  m_discovered->addItem(found.isEmpty() ? tr("No models in the Hugging Face cache")
                                        : tr("%n model(s) in the Hugging Face cache", nullptr, static_cast<int>(found.size())));
  for (const QString& path : found)
    m_discovered->addItem(QString::fromStdString(engine::hugging_face_repo_name(path.toStdString())), path);
  // The way back to the model this build ships, once another was chosen.
  const QString embedded = QString::fromStdString(embedded_model_dir().string());
  if (!embedded.isEmpty()) m_discovered->addItem(tr("diffract-emoji (embedded)"), embedded);
  m_discovered->setEnabled(m_discovered->count() > 1);
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
  for (const auto& p : job::size_presets()) m_sizePreset->addItem(QString::fromUtf8(p.label));
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
  m_sizeWarning = new QLabel;
  m_sizeWarning->setObjectName(QStringLiteral("sizeWarningLabel"));
  m_sizeWarning->setWordWrap(true);
  m_sizeWarning->setStyleSheet(QStringLiteral("color: #b26a00;"));
  m_sizeWarning->hide();
  fields->addRow(QString(), m_sizeWarning);
  connect(m_sizePreset, &QComboBox::activated, this, &SettingsPanel::applySizePreset);
  for (QSpinBox* s : {m_width, m_height}) connect(s, &QSpinBox::valueChanged, this, &SettingsPanel::updateSizeWarning);
  for (QSpinBox* s : {m_width, m_height})
    connect(s, &QSpinBox::valueChanged, this, [this] {
      // Typing a size that no preset has switches to Custom.
      for (int i = 0; i < customPreset(); ++i)
        if (job::size_presets()[i].width == m_width->value() && job::size_presets()[i].height == m_height->value()) {
          m_sizePreset->setCurrentIndex(i);
          return;
        }
      m_sizePreset->setCurrentIndex(customPreset());
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

  // Flux.1-dev embeds its guidance in the transformer; CFG above 1 with a negative prompt is true
  // CFG there (two evaluations a step).
  m_guidance = new QDoubleSpinBox;
  m_guidance->setObjectName(QStringLiteral("guidanceSpin"));
  m_guidance->setRange(0, 100);
  m_guidance->setSingleStep(0.5);
  m_guidance->setDecimals(1);
  m_guidance->setValue(3.5);
  fields->addRow(tr("Guidance"), m_guidance);
  m_t5 = new QComboBox;
  m_t5->setObjectName(QStringLiteral("t5PlacementCombo"));
  m_t5->addItem(tr("with the model"), QString());
  m_t5->addItem(tr("CPU (slower prompts, no GPU memory)"), QStringLiteral("cpu"));
  m_t5->addItem(tr("offload (on the GPU only to encode a new prompt)"), QStringLiteral("offload"));
  fields->addRow(tr("T5"), m_t5);

  m_precision = new QComboBox;
  m_precision->setObjectName(QStringLiteral("precisionCombo"));
  m_precision->addItem(tr("bf16"), QString());
  m_precision->addItem(tr("fp8 (e4m3)"), QStringLiteral("fp8"));
  m_precision->setToolTip(tr("The denoiser's linear layers in fp8 where that is faster (GPUs from Ada / Hopper on; "
                             "on the CPU emulated, which shows its rounding, not its speed). Text encoders and the "
                             "VAE stay in the model's dtype."));
  fields->addRow(tr("Precision"), m_precision);
  // The model's files are read once per edit: its family sets the Flux fields and the native size.
  connect(m_model, &QLineEdit::textChanged, this, &SettingsPanel::modelChanged);
  updateGuidanceField(false);  // no model yet

  // The hires fix: off at ×1.
  auto* hiresRow = new QHBoxLayout;
  m_hiresScale = new QDoubleSpinBox;
  m_hiresScale->setObjectName(QStringLiteral("hiresScale"));
  m_hiresScale->setRange(1.0, 4.0);
  m_hiresScale->setSingleStep(0.25);
  m_hiresScale->setPrefix(QStringLiteral("×"));
  m_hiresScale->setSpecialValueText(tr("off"));
  m_hiresScale->setToolTip(tr("Hires fix: generate, upscale by this much, then denoise again at the strength beside it"));
  m_hiresStrength = new QDoubleSpinBox;
  m_hiresStrength->setObjectName(QStringLiteral("hiresStrength"));
  m_hiresStrength->setRange(0.0, 1.0);
  m_hiresStrength->setSingleStep(0.05);
  m_hiresStrength->setValue(0.5);
  m_hiresUpscaler = new QComboBox;
  m_hiresUpscaler->setObjectName(QStringLiteral("hiresUpscaler"));
  m_hiresUpscaler->addItem(tr("latent"), QStringLiteral("latent"));
  m_hiresUpscaler->addItem(tr("Lanczos"), QStringLiteral("lanczos"));
  hiresRow->addWidget(m_hiresScale, 1);
  hiresRow->addWidget(m_hiresStrength, 1);
  hiresRow->addWidget(m_hiresUpscaler, 1);
  fields->addRow(tr("Hires fix"), hiresRow);

  auto* seedRow = new QHBoxLayout;
  // 64 bits, as the core takes: A1111 seeds reach 2^32 and ComfyUI's 2^64, past a QSpinBox's int.
  m_seed = new QLineEdit(QStringLiteral("0"));
  m_seed->setObjectName(QStringLiteral("seedEdit"));
  m_seed->setValidator(new QRegularExpressionValidator(QRegularExpression(QStringLiteral("\\d{1,20}")), m_seed));
  m_randomSeed = new QCheckBox(tr("Randomise"));
  m_randomSeed->setObjectName(QStringLiteral("randomSeedCheck"));
  m_randomSeed->setToolTip(tr("A new seed for every job; untick to lock the seed"));
  seedRow->addWidget(m_seed, 1);
  seedRow->addWidget(m_randomSeed);
  fields->addRow(tr("Seed"), seedRow);

  m_sampler = new QComboBox;
  m_sampler->setObjectName(QStringLiteral("samplerCombo"));
  m_sampler->addItem(tr("model default"), QString());
  // The core's samplers but its flow-matching ones, which the SD3 models run by default.
  for (const std::string& name : schedulers::sampler_names())
    if (const auto kind = schedulers::parse_sampler(name); kind && !schedulers::is_flow_matching(*kind))
      m_sampler->addItem(QString::fromStdString(name), QString::fromStdString(name));
  fields->addRow(tr("Sampler"), m_sampler);

  m_batch = new QSpinBox;
  m_batch->setObjectName(QStringLiteral("batchSpin"));
  connect(m_batch, &QSpinBox::valueChanged, this, &SettingsPanel::updateSizeWarning);
  m_batch->setRange(1, 16);
  fields->addRow(tr("Batch"), m_batch);

  m_previewSize = new QComboBox;
  m_previewSize->setObjectName(QStringLiteral("previewSizeCombo"));
  m_previewSize->addItem(tr("auto (half size, at most 512 px)"), job::GenerationRequest::kPreviewAuto);
  m_previewSize->addItem(tr("512 px"), 512);
  m_previewSize->addItem(tr("256 px (cheapest)"), 256);
  m_previewSize->addItem(tr("full size"), 0);
  m_previewSize->setToolTip(tr("Largest side of the step previews: larger images preview from latents averaged "
                               "down. Auto takes half the image's side, at most 512 px, which keeps previews a "
                               "small part of the denoising time."));
  fields->addRow(tr("Preview size"), m_previewSize);

  auto* strategyRow = new QHBoxLayout;
  m_strategy = new QComboBox;
  m_strategy->setObjectName(QStringLiteral("strategyCombo"));
  for (const auto& st : parallel::strategies()) {
    const QString name = QString::fromUtf8(st.name.data(), static_cast<int>(st.name.size()));
    m_strategy->addItem(name, name);
    m_strategy->setItemData(m_strategy->count() - 1, QString::fromUtf8(st.hint.data(), static_cast<int>(st.hint.size())),
                            Qt::ToolTipRole);
  }
  m_strategy->setToolTip(tr("Multi-device strategy; single runs the plain loop. A strategy run before shows "
                            "its last measured speed-up"));
  m_devices = new QSpinBox;
  m_devices->setObjectName(QStringLiteral("devicesSpin"));
  m_devices->setRange(1, 64);
  m_devices->setToolTip(tr("CPU virtual devices when no GPU is enabled (drafts per round for DRiffusion); "
                           "the skip factor for step skipping. With GPUs the enabled ones count."));
  m_patches = new QSpinBox;
  m_patches->setObjectName(QStringLiteral("patchesSpin"));
  m_patches->setRange(0, 64);
  m_patches->setSpecialValueText(tr("auto"));
  m_patches->setPrefix(tr("patches "));
  m_patches->setToolTip(tr("PipeFusion: the latent's row patches streaming through the stages, at least one per "
                           "stage; auto: one per stage"));
  m_cacheThreshold = new QDoubleSpinBox;
  m_cacheThreshold->setObjectName(QStringLiteral("cacheThresholdSpin"));
  m_cacheThreshold->setRange(0, 10);
  m_cacheThreshold->setSingleStep(0.02);
  m_cacheThreshold->setDecimals(2);
  m_cacheThreshold->setPrefix(tr("threshold "));
  strategyRow->addWidget(m_strategy, 1);
  strategyRow->addWidget(m_devices);
  strategyRow->addWidget(m_patches);
  strategyRow->addWidget(m_cacheThreshold);
  fields->addRow(tr("Strategy"), strategyRow);
  const auto patchesApply = [this] {
    const auto& info = strategyInfo();
    m_patches->setEnabled(info.takes(parallel::Param::Patches));
    m_cacheThreshold->setVisible(info.takes(parallel::Param::CacheThreshold));
    if (info.takes(parallel::Param::CacheThreshold) &&
        (m_thresholdDefault == -1 || m_cacheThreshold->value() == m_thresholdDefault))
      setCacheThreshold(-1);
    m_cacheThreshold->setToolTip(
        QString::fromUtf8(info.threshold_hint.data(), static_cast<int>(info.threshold_hint.size())));
  };
  connect(m_strategy, &QComboBox::currentIndexChanged, this, patchesApply);
  patchesApply();

}

void SettingsPanel::applySizePreset(int index) {
  if (index < 0 || index >= customPreset()) return;  // Custom: keep the spin boxes as they are
  const QSignalBlocker bw(m_width), bh(m_height);
  m_width->setValue(job::size_presets()[index].width);
  m_height->setValue(job::size_presets()[index].height);
}

void SettingsPanel::setCacheThreshold(double value) {
  const double fallback = strategyInfo().default_cache_threshold;
  if (value < 0) value = fallback;
  m_thresholdDefault = value == fallback ? value : std::nan("");
  m_cacheThreshold->setValue(value);
}

const parallel::StrategyInfo& SettingsPanel::strategyInfo() const {
  return parallel::strategy_info(m_strategy ? m_strategy->currentData().toString().toStdString() : std::string());
}

void SettingsPanel::noteStrategySpeedup(const QString& strategy, double speedup) {
  const int i = m_strategy->findData(strategy);
  if (i < 0) return;
  const auto* info = parallel::find_strategy(strategy.toStdString());
  const QString hint = info ? QString::fromUtf8(info->hint.data(), static_cast<int>(info->hint.size())) : QString();
  if (speedup <= 0) {
    m_strategy->setItemText(i, strategy);
    m_strategy->setItemData(i, hint, Qt::ToolTipRole);
    return;
  }
  m_strategy->setItemText(i, tr("%1 · %2× last run").arg(strategy).arg(speedup, 0, 'f', 2));
  m_strategy->setItemData(i, hint + QStringLiteral("\n") +
                                 tr("Its last job here ran %1× less sequential model work than the plain loop's steps.")
                                     .arg(speedup, 0, 'f', 2),
                          Qt::ToolTipRole);
}

void SettingsPanel::fitSizeTo(const QSize& canvas) {
  if (canvas.isEmpty()) return;
  const double area = m_width->value() > 0 && m_height->value() > 0 ? double(m_width->value()) * m_height->value()
                                                                    : 1024.0 * 1024.0;
  const double scale = std::min(1.0, std::sqrt(area / (double(canvas.width()) * canvas.height())));
  const auto round64 = [](double v) { return std::max(64, static_cast<int>(std::lround(v / 64)) * 64); };
  m_width->setValue(round64(canvas.width() * scale));
  m_height->setValue(round64(canvas.height() * scale));
}

void SettingsPanel::updateSizeWarning() {
  const int w = m_width->value(), h = m_height->value(), n = m_nativeSize;
  // Beyond twice the side (four times the area) a model trained at n pixels makes repeats and
  // broken shapes, and the job costs that many times more.
  const bool far = n > 0 && w > 0 && h > 0 && (std::max(w, h) > 2 * n || double(w) * h > 4.0 * n * n);
  QStringList text;
  if (far)
    text << tr("%1×%2 is %3× the pixels of this model's native %4×%4: expect a slow job and a "
               "broken picture (Model default is %4×%4)")
                .arg(w)
                .arg(h)
                .arg(double(w) * h / (double(n) * n), 0, 'f', 0)
                .arg(n);
  // The memory the job needs where it runs, before a job that would fail after its whole
  // denoising: on a GPU the weights and the decode in bf16 against its free memory; on the CPU
  // the decode in fp32 against this machine's.
  const int batch = m_batch ? m_batch->value() : 1;
  const double cpu = decode_peak_bytes(w, h, batch, 4);
  const double have = static_cast<double>(physical_memory_bytes());
  if (!m_gpuName.isEmpty()) {
    // The model's files are walked once per model, and only when a GPU job needs the estimate.
    const QString model = m_model->text().trimmed();
    if (model != m_weightBytesOf) {
      m_weightBytesOf = model;
      m_weightBytes = model.isEmpty() ? 0 : engine::model_weight_bytes(model.toStdString());
    }
    const double decode = decode_peak_bytes(w, h, batch, 2), weights = static_cast<double>(m_weightBytes);
    if (w > 0 && h > 0 && m_gpuFreeBytes > 0 && decode + weights > static_cast<double>(m_gpuFreeBytes))
      text << tr("This job needs about %1 GB on %2 (the model's weights %3 GB, decoding %4%5×%6 %7 GB), more than "
                 "its %8 GB free")
                  .arg((decode + weights) / 1e9, 0, 'f', 0)
                  .arg(m_gpuName)
                  .arg(weights / 1e9, 0, 'f', 1)
                  .arg(batch > 1 ? tr("a batch of %1 at ").arg(batch) : QString())
                  .arg(w)
                  .arg(h)
                  .arg(decode / 1e9, 0, 'f', 0)
                  .arg(m_gpuFreeBytes / 1e9, 0, 'f', 0);
  } else if (w > 0 && h > 0 && have > 0 && cpu > have)
    text << tr("Decoding %1%2×%3 needs about %4 GB on the CPU (half on a GPU in bf16), more than this machine's %5 GB")
                .arg(batch > 1 ? tr("a batch of %1 at ").arg(batch) : QString())
                .arg(w)
                .arg(h)
                .arg(cpu / 1e9, 0, 'f', 0)
                .arg(have / 1e9, 0, 'f', 0);
  m_sizeWarning->setVisible(!text.isEmpty());
  m_sizeWarning->setText(text.join(QStringLiteral(". ")));
}

void SettingsPanel::setJobDevice(const QString& gpuName, std::uint64_t freeBytes) {
  m_gpuName = gpuName;
  m_gpuFreeBytes = freeBytes;
  updateSizeWarning();
}

void SettingsPanel::modelChanged() {
  const std::string path = m_model->text().trimmed().toStdString();
  const std::string family = path.empty() ? std::string() : engine::guess_model_family(path);
  m_nativeSize = path.empty() ? 0 : engine::guess_native_size(path, family).value_or(0);
  updateGuidanceField(family == "Flux");
  updateSizeWarning();
}

void SettingsPanel::updateGuidanceField(bool flux) {
  m_guidance->setEnabled(flux);
  m_t5->setEnabled(flux);
  m_t5->setToolTip(flux ? tr("Where Flux's T5-XXL text encoder (9.5 GB in bf16) lives; prompt encodings are cached, "
                             "so it only runs for a new prompt")
                        : tr("T5 placement: for Flux models only"));
  m_guidance->setToolTip(flux ? tr("Flux.1-dev's distilled guidance, embedded in the model (3.5 is its default; "
                                   "schnell has none). CFG above 1 with a negative prompt adds true CFG at twice "
                                   "the cost per step")
                              : tr("Distilled guidance: for Flux.1-dev models only"));
}

job::GenerationRequest SettingsPanel::request() const {
  job::GenerationRequest r;
  r.model = m_model->text().trimmed().toStdString();
  r.taesd = m_taesd->text().trimmed().toStdString();
  r.prompt = m_prompt->toPlainText().toStdString();
  r.negative_prompt = m_negative->toPlainText().toStdString();
  r.width = m_width->value();
  r.height = m_height->value();
  r.steps = m_steps->value();
  r.cfg = m_cfg->value();
  r.guidance = m_guidance->value();
  r.t5_placement = m_t5->currentData().toString().toStdString();
  r.precision = m_precision->currentData().toString().toStdString();
  r.seed = seedValue().value_or(0);
  r.sampler = m_sampler->currentData().toString().toStdString();
  r.batch = m_batch->value();
  r.preview_every = 1;
  r.preview_max_side = m_previewSize->currentData().toInt();
  r.strategy.name = m_strategy->currentData().toString().toStdString();
  r.strategy.patches = m_patches->isEnabled() ? m_patches->value() : 0;
  r.strategy.cache_threshold = m_cacheThreshold->value();
  if (m_hiresScale->value() > 1.0) {
    r.hires.scale = m_hiresScale->value();
    r.hires.strength = m_hiresStrength->value();
    r.hires.upscaler = m_hiresUpscaler->currentData().toString().toStdString();
  }
  return r;
}

std::optional<std::uint64_t> SettingsPanel::seedValue() const {
  bool ok = false;
  const qulonglong v = m_seed->text().toULongLong(&ok);
  if (!ok) return std::nullopt;
  return static_cast<std::uint64_t>(v);
}

void SettingsPanel::updatePromptTokens() {
  // The model's tokenizer folder (a diffusers folder), else the embedded model's: every SD CLIP
  // tokenizer shares the BPE, so the count holds for single files too.
  QString dir = m_model->text().trimmed() + QStringLiteral("/tokenizer");
  if (!QFileInfo(dir + QStringLiteral("/vocab.json")).exists())
    dir = QString::fromStdString((embedded_model_dir() / "tokenizer").string());
  if (dir != m_tokenizerDir) {
    m_tokenizerDir = dir;
    m_tokenizer.reset();
    try {
      if (QFileInfo(dir).isDir()) m_tokenizer = std::make_shared<text::CLIPTokenizer>(text::CLIPTokenizer::from_folder(dir.toStdString()));
    } catch (const std::exception&) {
      m_tokenizer.reset();
    }
  }
  m_promptTokens->setText(m_tokenizer ? promptTokenSummary(*m_tokenizer, m_prompt->toPlainText()) : QString());
}

void SettingsPanel::loadSettings(const QSettings& s) {
  m_prompt->setPlainText(s.value(QStringLiteral("prompt")).toString());
  m_negative->setPlainText(s.value(QStringLiteral("negativePrompt")).toString());
  // First start: the embedded emoji model, when this build or installation has it.
  m_model->setText(s.value(QStringLiteral("model"), QString::fromStdString(embedded_model_dir().string())).toString());
  m_width->setValue(s.value(QStringLiteral("width"), 0).toInt());
  m_height->setValue(s.value(QStringLiteral("height"), 0).toInt());
  m_steps->setValue(s.value(QStringLiteral("steps"), 30).toInt());
  m_cfg->setValue(s.value(QStringLiteral("cfg"), 7.0).toDouble());
  m_guidance->setValue(s.value(QStringLiteral("guidance"), 3.5).toDouble());
  m_t5->setCurrentIndex(std::max(0, m_t5->findData(s.value(QStringLiteral("t5Placement")).toString())));
  m_precision->setCurrentIndex(std::max(0, m_precision->findData(s.value(QStringLiteral("precision")).toString())));
  m_seed->setText(QString::number(s.value(QStringLiteral("seed"), 0).toULongLong()));
  m_randomSeed->setChecked(s.value(QStringLiteral("randomSeed"), true).toBool());
  m_sampler->setCurrentIndex(std::max(0, m_sampler->findData(s.value(QStringLiteral("sampler")).toString())));
  m_batch->setValue(s.value(QStringLiteral("batch"), 1).toInt());
  const int previewSize = s.value(QStringLiteral("previewSize"), job::GenerationRequest::kPreviewAuto).toInt();
  m_previewSize->setCurrentIndex(std::max(0, m_previewSize->findData(previewSize)));
  m_strategy->setCurrentIndex(std::max(0, m_strategy->findData(s.value(QStringLiteral("strategy")).toString())));
  m_devices->setValue(s.value(QStringLiteral("devices"), 1).toInt());
  m_patches->setValue(s.value(QStringLiteral("patches"), 0).toInt());
  setCacheThreshold(s.value(QStringLiteral("cacheThreshold"), -1.0).toDouble());
}

void SettingsPanel::saveSettings(QSettings& s) const {
  s.setValue(QStringLiteral("prompt"), m_prompt->toPlainText());
  s.setValue(QStringLiteral("negativePrompt"), m_negative->toPlainText());
  s.setValue(QStringLiteral("model"), m_model->text());
  s.setValue(QStringLiteral("width"), m_width->value());
  s.setValue(QStringLiteral("height"), m_height->value());
  s.setValue(QStringLiteral("steps"), m_steps->value());
  s.setValue(QStringLiteral("cfg"), m_cfg->value());
  s.setValue(QStringLiteral("guidance"), m_guidance->value());
  s.setValue(QStringLiteral("t5Placement"), m_t5->currentData().toString());
  s.setValue(QStringLiteral("precision"), m_precision->currentData().toString());
  s.setValue(QStringLiteral("seed"), QVariant::fromValue<qulonglong>(seedValue().value_or(0)));
  s.setValue(QStringLiteral("randomSeed"), m_randomSeed->isChecked());
  s.setValue(QStringLiteral("sampler"), m_sampler->currentData().toString());
  s.setValue(QStringLiteral("batch"), m_batch->value());
  s.setValue(QStringLiteral("previewSize"), m_previewSize->currentData().toInt());
  s.setValue(QStringLiteral("strategy"), m_strategy->currentData().toString());
  s.setValue(QStringLiteral("devices"), m_devices->value());
  s.setValue(QStringLiteral("patches"), m_patches->value());
  s.setValue(QStringLiteral("cacheThreshold"), m_cacheThreshold->value());
}

void SettingsPanel::applyPreset(const engine::Preset& p) {
  m_negative->setPlainText(QString::fromStdString(p.negative_prompt));
  m_width->setValue(p.width);
  m_height->setValue(p.height);
  m_steps->setValue(p.steps);
  m_cfg->setValue(p.cfg);
  m_guidance->setValue(p.guidance);
  m_sampler->setCurrentIndex(std::max(0, m_sampler->findData(QString::fromStdString(p.sampler))));
  m_strategy->setCurrentIndex(std::max(0, m_strategy->findData(QString::fromStdString(p.strategy))));
  m_devices->setValue(strategyInfo().takes(parallel::Param::Skip) ? p.skip : p.devices);
  setCacheThreshold(p.cache_threshold);
  m_precision->setCurrentIndex(std::max(0, m_precision->findData(QString::fromStdString(p.precision))));
}

namespace {

QString text(const std::optional<std::string>& v) { return QString::fromStdString(*v); }

}  // namespace

void SettingsPanel::restoreFields(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored) {
  if (p.prompt) {
    m_prompt->setPlainText(text(p.prompt));
    restored << tr("prompt");
  }
  if (p.negative_prompt) {
    m_negative->setPlainText(text(p.negative_prompt));
    restored << tr("negative prompt");
  }
  if (p.width && p.height) {
    m_width->setValue(*p.width);
    m_height->setValue(*p.height);
    restored << tr("size");
  }
  if (p.steps) {
    m_steps->setValue(*p.steps);
    restored << tr("steps");
  }
  if (p.cfg) {
    m_cfg->setValue(*p.cfg);
    restored << tr("CFG");
  }
  if (p.guidance) {
    m_guidance->setValue(*p.guidance);
    restored << tr("guidance");
  }
  if (p.seed) {
    m_seed->setText(QString::number(*p.seed));
    m_randomSeed->setChecked(false);
    restored << tr("seed");
  }
  if (p.sampler) {
    const int i = m_sampler->findData(text(p.sampler));
    if (i >= 0) {
      m_sampler->setCurrentIndex(i);
      restored << tr("sampler");
    } else {
      notRestored << tr("sampler: %1").arg(text(p.sampler));
    }
  }
  if (p.batch) {
    if (*p.batch >= m_batch->minimum() && *p.batch <= m_batch->maximum()) {
      m_batch->setValue(*p.batch);
      // A batch shares one seed: the image is remade by generating its whole batch again.
      if (p.batch_index && *p.batch > 1)
        restored << tr("batch of %1 (this image is number %2 in it)").arg(*p.batch).arg(*p.batch_index + 1);
      else
        restored << tr("batch");
    } else {
      notRestored << tr("batch: %1").arg(*p.batch);
    }
  }
  if (p.model && !p.model->empty()) {
    m_model->setText(text(p.model));
    restored << tr("model");
  } else if (p.model_name) {
    notRestored << tr("Model: %1 (a checkpoint name, not a path: choose it under Model)").arg(text(p.model_name));
  }
  if (p.taesd) {
    m_taesd->setText(text(p.taesd));
    restored << tr("TAESD");
  }
}

void SettingsPanel::restoreStrategy(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored) {
  if (p.strategy) {
    const int i = m_strategy->findData(text(p.strategy));
    if (i >= 0) {
      m_strategy->setCurrentIndex(i);
      restored << tr("strategy");
    } else {
      notRestored << tr("strategy: %1").arg(text(p.strategy));
    }
  }
  if (strategyInfo().takes(parallel::Param::Skip) && p.skip) m_devices->setValue(*p.skip);
  else if (p.devices) m_devices->setValue(*p.devices);
  if (p.cache_threshold) setCacheThreshold(*p.cache_threshold);
  if (p.precision) {
    const int i = m_precision->findData(*p.precision == "fp8" ? QStringLiteral("fp8") : QString());
    m_precision->setCurrentIndex(std::max(0, i));
    restored << tr("precision");
  }
}

}  // namespace diffract::ui
