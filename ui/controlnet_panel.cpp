#include "ui/controlnet_panel.h"

#include <QCheckBox>
#include <QComboBox>
#include <QDoubleSpinBox>
#include <QDragEnterEvent>
#include <QDropEvent>
#include <QFileDialog>
#include <QFileInfo>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QLabel>
#include <QMimeData>
#include <QPushButton>
#include <QSlider>
#include <QSpinBox>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/engine/controlnet_library.h"
#include "core/engine/model_discovery.h"
#include "ui/engine_bridge.h"

namespace diffract::ui {

namespace {
constexpr int kPreviewSide = 128;

bool isControlNet(const std::string& path) {
  return !engine::read_controlnet_info(path).path.empty() || !engine::read_controlnet_file_info(path).path.empty();
}
}  // namespace

struct ControlNetPanel::Row {
  QWidget* widget = nullptr;
  QCheckBox* enabled = nullptr;
  QComboBox* model = nullptr;
  QLabel* preview = nullptr;
  QLabel* source = nullptr;
  QComboBox* preprocessor = nullptr;
  QSpinBox* low = nullptr;
  QSpinBox* high = nullptr;
  QSlider* scale = nullptr;  // hundredths
  QLabel* scaleValue = nullptr;
  QDoubleSpinBox* start = nullptr;
  QDoubleSpinBox* end = nullptr;
  QImage image;  // the user's image, before the preprocessor
  QString sourceName;
};

ControlNetPanel::ControlNetPanel(QWidget* parent) : QWidget(parent) {
  auto* outer = new QVBoxLayout(this);
  outer->setContentsMargins(0, 0, 0, 0);
  auto* group = new QGroupBox(tr("ControlNet"));
  group->setObjectName(QStringLiteral("controlNetGroup"));
  outer->addWidget(group);
  auto* layout = new QVBoxLayout(group);
  auto* top = new QHBoxLayout;
  m_summary = new QLabel;
  m_summary->setObjectName(QStringLiteral("controlNetSummary"));
  m_summary->setWordWrap(true);
  m_summary->setTextFormat(Qt::PlainText);
  top->addWidget(m_summary, 1);
  auto* folder = new QPushButton(tr("Folder…"));
  folder->setObjectName(QStringLiteral("controlNetAddFolder"));
  folder->setToolTip(tr("Add a folder holding ControlNet models (diffusers folders with config.json)"));
  m_add = new QPushButton(tr("Add unit"));
  m_add->setObjectName(QStringLiteral("controlNetAddUnit"));
  top->addWidget(folder);
  top->addWidget(m_add);
  layout->addLayout(top);
  m_list = new QVBoxLayout;
  layout->addLayout(m_list);
  connect(folder, &QPushButton::clicked, this, &ControlNetPanel::chooseFolder);
  connect(m_add, &QPushButton::clicked, this, [this] { addUnit(); });
  refresh();
}

void ControlNetPanel::chooseFolder() {
  const QString dir = QFileDialog::getExistingDirectory(this, tr("A folder of ControlNets"));
  if (dir.isEmpty() || m_folders.contains(dir)) return;
  setFolders(m_folders + QStringList{dir});
}

void ControlNetPanel::setFolders(const QStringList& folders) {
  m_folders = folders;
  refresh();
  emit foldersChanged(m_folders);
}

void ControlNetPanel::refresh() {
  std::vector<std::string> dirs;
  for (const auto& f : m_folders) dirs.push_back(f.toStdString());
  m_models.clear();
  for (const auto& info : engine::find_controlnets(dirs, engine::hugging_face_hub())) {
    QString label = QString::fromStdString(info.name);
    if (!info.base.empty()) label += QStringLiteral(" (%1)").arg(QString::fromStdString(info.base));
    m_models.emplace_back(label, QString::fromStdString(info.path.string()));
  }
  for (auto* r : m_units) fillModels(r, r->model->currentData().toString());
  updateSummary();
}

QStringList ControlNetPanel::models() const {
  QStringList out;
  for (const auto& [label, path] : m_models) out << path;
  return out;
}

void ControlNetPanel::fillModels(Row* r, const QString& keep) {
  const QSignalBlocker block(r->model);
  r->model->clear();
  for (const auto& [label, path] : m_models) r->model->addItem(label, path);
  if (!keep.isEmpty() && r->model->findData(keep) < 0) r->model->addItem(QFileInfo(keep).fileName(), keep);
  r->model->setCurrentIndex(keep.isEmpty() ? (r->model->count() ? 0 : -1) : r->model->findData(keep));
  r->model->setToolTip(r->model->currentData().toString());
}

void ControlNetPanel::updateSummary() {
  QString text;
  if (m_models.empty())
    text = m_folders.isEmpty() ? tr("No ControlNet folder yet: add one holding ControlNet models (diffusers folders).")
                               : tr("No ControlNet models in %1").arg(m_folders.join(QStringLiteral(", ")));
  else
    text = tr("%n ControlNet model(s)", nullptr, static_cast<int>(m_models.size()));
  int on = 0;
  for (const auto* r : m_units) on += r->enabled->isChecked() ? 1 : 0;
  if (!m_units.empty()) text += tr("; %1 of %n unit(s) on", nullptr, unitCount()).arg(on);
  m_summary->setText(text);
  m_add->setEnabled(unitCount() < kMaxUnits);
}

int ControlNetPanel::indexOf(const Row* row) const {
  const auto it = std::find(m_units.begin(), m_units.end(), row);
  return it == m_units.end() ? -1 : static_cast<int>(it - m_units.begin());
}

int ControlNetPanel::addUnit() {
  if (unitCount() >= kMaxUnits) return -1;
  auto* r = new Row;
  r->widget = new QFrame;
  static_cast<QFrame*>(r->widget)->setFrameShape(QFrame::StyledPanel);
  r->widget->setObjectName(QStringLiteral("controlNetUnit%1").arg(unitCount() + 1));
  r->widget->setAcceptDrops(true);
  r->widget->installEventFilter(this);
  auto* v = new QVBoxLayout(r->widget);
  v->setContentsMargins(4, 4, 4, 4);
  v->setSpacing(2);

  auto* head = new QHBoxLayout;
  r->enabled = new QCheckBox(tr("Unit %1").arg(unitCount() + 1));
  r->enabled->setChecked(true);
  r->model = new QComboBox;
  r->model->setObjectName(QStringLiteral("controlNetModel"));
  r->model->setSizeAdjustPolicy(QComboBox::AdjustToMinimumContentsLengthWithIcon);
  r->model->setMinimumContentsLength(14);
  auto* pick = new QPushButton(QStringLiteral("…"));
  pick->setToolTip(tr("Choose a ControlNet folder"));
  pick->setMaximumWidth(28);
  auto* remove = new QPushButton(QStringLiteral("✕"));
  remove->setObjectName(QStringLiteral("controlNetRemove"));
  remove->setToolTip(tr("Remove this unit"));
  remove->setMaximumWidth(28);
  head->addWidget(r->enabled);
  head->addWidget(r->model, 1);
  head->addWidget(pick);
  head->addWidget(remove);
  v->addLayout(head);

  auto* body = new QHBoxLayout;
  r->preview = new QLabel(tr("drop an\nimage here"));
  r->preview->setObjectName(QStringLiteral("controlNetPreview"));
  r->preview->setFixedSize(kPreviewSide, kPreviewSide);
  r->preview->setAlignment(Qt::AlignCenter);
  r->preview->setFrameShape(QFrame::Box);
  body->addWidget(r->preview);
  auto* controls = new QVBoxLayout;
  auto* imageButtons = new QHBoxLayout;
  auto* open = new QPushButton(tr("Image…"));
  open->setObjectName(QStringLiteral("controlNetOpen"));
  auto* useInput = new QPushButton(tr("Use input"));
  useInput->setObjectName(QStringLiteral("controlNetUseInput"));
  useInput->setToolTip(tr("The input image of the form (image-to-image)"));
  imageButtons->addWidget(open);
  imageButtons->addWidget(useInput);
  controls->addLayout(imageButtons);
  r->source = new QLabel;
  r->source->setTextFormat(Qt::PlainText);
  r->source->setWordWrap(true);
  controls->addWidget(r->source);
  auto* pre = new QHBoxLayout;
  r->preprocessor = new QComboBox;
  r->preprocessor->setObjectName(QStringLiteral("controlNetPreprocessor"));
  r->preprocessor->addItem(tr("None (depth, normal, pose… as given)"), QStringLiteral("none"));
  r->preprocessor->addItem(tr("Canny edges"), QStringLiteral("canny"));
  r->low = new QSpinBox;
  r->low->setObjectName(QStringLiteral("controlNetLow"));
  r->low->setRange(0, 1000);
  r->low->setValue(100);
  r->low->setToolTip(tr("Canny: the low threshold (edges touching a strong edge above it are kept)"));
  r->high = new QSpinBox;
  r->high->setObjectName(QStringLiteral("controlNetHigh"));
  r->high->setRange(0, 1000);
  r->high->setValue(200);
  r->high->setToolTip(tr("Canny: the high threshold (gradients above it start an edge)"));
  pre->addWidget(r->preprocessor, 1);
  pre->addWidget(r->low);
  pre->addWidget(r->high);
  controls->addLayout(pre);
  auto* strength = new QHBoxLayout;
  r->scale = new QSlider(Qt::Horizontal);
  r->scale->setObjectName(QStringLiteral("controlNetScale"));
  r->scale->setRange(0, 200);
  r->scale->setValue(100);
  r->scale->setToolTip(tr("Conditioning scale (0 to 2)"));
  r->scaleValue = new QLabel(QStringLiteral("1.00"));
  r->scaleValue->setMinimumWidth(32);
  r->start = new QDoubleSpinBox;
  r->start->setObjectName(QStringLiteral("controlNetStart"));
  r->start->setRange(0, 0.99);
  r->start->setSingleStep(0.05);
  r->start->setToolTip(tr("Acts from this fraction of the steps"));
  r->end = new QDoubleSpinBox;
  r->end->setObjectName(QStringLiteral("controlNetEnd"));
  r->end->setRange(0.01, 1);
  r->end->setSingleStep(0.05);
  r->end->setValue(1);
  r->end->setToolTip(tr("Acts until this fraction of the steps"));
  strength->addWidget(new QLabel(tr("Scale")));
  strength->addWidget(r->scale, 1);
  strength->addWidget(r->scaleValue);
  strength->addWidget(r->start);
  strength->addWidget(r->end);
  controls->addLayout(strength);
  body->addLayout(controls, 1);
  v->addLayout(body);

  fillModels(r, {});
  m_list->addWidget(r->widget);
  m_units.push_back(r);

  const auto canny = [r] {
    const bool on = r->preprocessor->currentData().toString() == QLatin1String("canny");
    r->low->setVisible(on);
    r->high->setVisible(on);
  };
  canny();
  connect(r->preprocessor, &QComboBox::currentIndexChanged, this, [this, r, canny] {
    canny();
    updatePreview(r);
  });
  for (QSpinBox* s : {r->low, r->high}) connect(s, &QSpinBox::valueChanged, this, [this, r] { updatePreview(r); });
  connect(r->scale, &QSlider::valueChanged, r->scaleValue, [label = r->scaleValue](int s) {
    label->setText(QString::number(s / 100.0, 'f', 2));
  });
  connect(r->start, &QDoubleSpinBox::valueChanged, this, [r](double s) {
    if (r->end->value() <= s) r->end->setValue(std::min(1.0, s + 0.05));
  });
  connect(r->end, &QDoubleSpinBox::valueChanged, this, [r](double e) {
    if (r->start->value() >= e) r->start->setValue(std::max(0.0, e - 0.05));
  });
  connect(r->enabled, &QCheckBox::toggled, this, [this] { updateSummary(); });
  connect(r->model, &QComboBox::currentIndexChanged, this, [r] { r->model->setToolTip(r->model->currentData().toString()); });
  connect(pick, &QPushButton::clicked, this, [this, r] {
    const QString dir = QFileDialog::getExistingDirectory(this, tr("A ControlNet model folder"));
    if (dir.isEmpty()) return;
    if (engine::read_controlnet_info(dir.toStdString()).path.empty()) {
      emit notice(tr("%1 is not a ControlNet folder (no config.json of a ControlNetModel)").arg(dir));
      return;
    }
    fillModels(r, dir);
  });
  connect(open, &QPushButton::clicked, this, [this, r] {
    const QString file = QFileDialog::getOpenFileName(this, tr("Control image"), {},
                                                      tr("Images (*.png *.jpg *.jpeg *.webp *.bmp *.tif *.tiff)"));
    if (file.isEmpty()) return;
    QString error;
    if (!loadImage(indexOf(r), file, &error)) emit notice(error);
  });
  connect(useInput, &QPushButton::clicked, this, [this, r] { emit inputImageWanted(indexOf(r)); });
  connect(remove, &QPushButton::clicked, this, [this, r] { removeUnit(indexOf(r)); });
  updatePreview(r);
  updateSummary();
  return unitCount() - 1;
}

void ControlNetPanel::removeUnit(int index) {
  if (index < 0 || index >= unitCount()) return;
  Row* r = m_units[static_cast<std::size_t>(index)];
  m_units.erase(m_units.begin() + index);
  r->widget->deleteLater();
  delete r;
  for (int i = 0; i < unitCount(); ++i) {
    m_units[static_cast<std::size_t>(i)]->enabled->setText(tr("Unit %1").arg(i + 1));
    m_units[static_cast<std::size_t>(i)]->widget->setObjectName(QStringLiteral("controlNetUnit%1").arg(i + 1));
  }
  updateSummary();
}

void ControlNetPanel::clear() {
  while (unitCount() > 0) removeUnit(unitCount() - 1);
}

ControlNetPanel::Unit ControlNetPanel::unit(int index) const {
  const Row* r = m_units.at(static_cast<std::size_t>(index));
  Unit u;
  u.enabled = r->enabled->isChecked();
  u.model = r->model->currentData().toString();
  u.preprocess.name = r->preprocessor->currentData().toString();
  u.preprocess.low = r->low->value();
  u.preprocess.high = r->high->value();
  u.scale = r->scale->value() / 100.0;
  u.start = r->start->value();
  u.end = r->end->value();
  return u;
}

void ControlNetPanel::setUnit(int index, const Unit& u) {
  Row* r = m_units.at(static_cast<std::size_t>(index));
  r->enabled->setChecked(u.enabled);
  fillModels(r, u.model);
  const int pre = r->preprocessor->findData(u.preprocess.name);
  r->preprocessor->setCurrentIndex(pre < 0 ? 0 : pre);
  r->low->setValue(u.preprocess.low);
  r->high->setValue(u.preprocess.high);
  r->scale->setValue(static_cast<int>(std::lround(std::clamp(u.scale, 0.0, 2.0) * 100)));
  r->end->setValue(1);  // so that any start below 1 is taken, then the end
  r->start->setValue(u.start);
  r->end->setValue(u.end);
  r->start->setValue(u.start);
  updatePreview(r);
}

void ControlNetPanel::setImage(int index, const QImage& image, const QString& source) {
  if (index < 0 || index >= unitCount()) return;
  Row* r = m_units[static_cast<std::size_t>(index)];
  r->image = image;
  r->sourceName = image.isNull() ? QString() : source;
  updatePreview(r);
}

bool ControlNetPanel::loadImage(int index, const QString& path, QString* error) {
  const QImage image = readImageFile(path, error);
  if (image.isNull()) {
    *error = tr("ControlNet unit %1: %2").arg(index + 1).arg(*error);
    return false;
  }
  setImage(index, image, QFileInfo(path).fileName());
  return true;
}

QImage ControlNetPanel::sourceImage(int index) const { return m_units.at(static_cast<std::size_t>(index))->image; }

QImage ControlNetPanel::controlImage(int index, const QSize& size) const {
  const Row* r = m_units.at(static_cast<std::size_t>(index));
  return ui::controlImage(r->image, unit(index).preprocess, size);
}

void ControlNetPanel::updatePreview(Row* r) {
  const int index = indexOf(r);
  if (r->image.isNull()) {
    r->preview->setPixmap({});
    r->preview->setText(tr("drop an\nimage here"));
    r->source->setText(tr("No control image"));
    return;
  }
  // The preview runs the preprocessor at a size near the thumbnail's, not the job's: cheap on
  // every threshold change, and the edges it finds are the ones the job's size gives, scaled.
  const QSize side = r->image.size().scaled(kPreviewSide * 2, kPreviewSide * 2, Qt::KeepAspectRatio);
  const QImage shown = ui::controlImage(r->image, unit(index).preprocess, side.boundedTo(r->image.size()));
  r->preview->setPixmap(QPixmap::fromImage(shown.scaled(r->preview->size(), Qt::KeepAspectRatio, Qt::SmoothTransformation)));
  r->source->setText(tr("%1, %2×%3").arg(r->sourceName).arg(r->image.width()).arg(r->image.height()));
}

QString ControlNetPanel::fillRequest(job::GenerationRequest& r) const {
  std::vector<job::ControlNetRef> refs;
  for (int i = 0; i < unitCount(); ++i) {
    const Unit u = unit(i);
    if (!u.enabled) continue;
    if (u.model.isEmpty()) return tr("ControlNet unit %1 has no model: add a ControlNet folder or turn the unit off").arg(i + 1);
    if (sourceImage(i).isNull()) return tr("ControlNet unit %1 has no control image: open one or turn the unit off").arg(i + 1);
    job::ControlNetRef c;
    c.path = u.model.toStdString();
    c.image = toCoreImage(controlImage(i, QSize(r.width, r.height)));
    c.scale = u.scale;
    c.start = u.start;
    c.end = u.end;
    refs.push_back(std::move(c));
  }
  r.controlnets = std::move(refs);
  return {};
}

std::vector<ControlNetPanel::Unit> ControlNetPanel::requestUnits() const {
  std::vector<Unit> out;
  for (int i = 0; i < unitCount(); ++i) {
    const Unit u = unit(i);
    if (u.enabled && !u.model.isEmpty() && !sourceImage(i).isNull()) out.push_back(u);
  }
  return out;
}

std::string ControlNetPanel::addPreprocessors(const std::string& metadata_json, const std::vector<Unit>& units) {
  auto meta = nlohmann::json::parse(metadata_json, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || !meta.contains("controlnets") || !meta["controlnets"].is_array()) return metadata_json;
  auto& list = meta["controlnets"];
  for (std::size_t i = 0; i < list.size() && i < units.size(); ++i) {
    const auto& p = units[i].preprocess;
    list[i]["preprocessor"] = p.name.toStdString();
    if (p.name == QLatin1String("canny")) {
      list[i]["low"] = p.low;
      list[i]["high"] = p.high;
    }
  }
  return meta.dump();
}

void ControlNetPanel::applyPreset(const std::vector<engine::Preset::ControlNet>& controlnets, QStringList& missing) {
  while (unitCount() > static_cast<int>(controlnets.size())) removeUnit(unitCount() - 1);
  for (std::size_t i = 0; i < controlnets.size() && static_cast<int>(i) < kMaxUnits; ++i) {
    const auto& c = controlnets[i];
    if (static_cast<int>(i) >= unitCount()) addUnit();
    Unit u;
    u.model = QString::fromStdString(c.model);
    u.preprocess.name = QString::fromStdString(c.preprocessor);
    u.preprocess.low = c.low;
    u.preprocess.high = c.high;
    u.scale = c.scale;
    u.start = c.start;
    u.end = c.end;
    setUnit(static_cast<int>(i), u);
    if (!isControlNet(c.model)) missing << tr("ControlNet %1 (not found)").arg(u.model);
  }
}

std::vector<engine::Preset::ControlNet> ControlNetPanel::presetControlNets() const {
  std::vector<engine::Preset::ControlNet> out;
  for (int i = 0; i < unitCount(); ++i) {
    const Unit u = unit(i);
    if (!u.enabled || u.model.isEmpty()) continue;
    engine::Preset::ControlNet c;
    c.model = u.model.toStdString();
    c.preprocessor = u.preprocess.name.toStdString();
    c.low = u.preprocess.low;
    c.high = u.preprocess.high;
    c.scale = u.scale;
    c.start = u.start;
    c.end = u.end;
    out.push_back(c);
  }
  return out;
}

void ControlNetPanel::restore(const engine::PngParameters& p, const QDir& folder, QStringList& restored,
                              QStringList& notRestored) {
  clear();
  for (const auto& c : p.controlnets) {
    const QString model = QString::fromStdString(c.path);
    const int i = addUnit();
    if (i < 0) {
      notRestored << tr("ControlNet %1 (more than %2 units)").arg(model).arg(kMaxUnits);
      continue;
    }
    Unit u;
    u.model = model;
    u.scale = c.scale;
    u.start = c.start;
    u.end = c.end;
    setUnit(i, u);  // the saved image is what the model saw: no preprocessor again
    const QString made = c.preprocessor == "canny" ? tr(", canny edges %1 / %2").arg(c.low).arg(c.high) : QString();
    if (!isControlNet(c.path)) notRestored << tr("ControlNet %1 (not found)").arg(model);
    QImage image;
    if (!c.image_file.empty()) image = QImage(folder.filePath(QString::fromStdString(c.image_file)));
    if (image.isNull()) {
      notRestored << tr("ControlNet unit %1's control image (%2)")
                         .arg(i + 1)
                         .arg(c.image_file.empty() ? tr("not saved with the PNG")
                                                   : tr("%1 is missing").arg(QString::fromStdString(c.image_file)));
      m_units[static_cast<std::size_t>(i)]->enabled->setChecked(false);
      continue;
    }
    setImage(i, image, tr("saved control image%1").arg(made));
    restored << tr("ControlNet unit %1").arg(i + 1);
  }
}

bool ControlNetPanel::eventFilter(QObject* watched, QEvent* event) {
  const auto it = std::find_if(m_units.begin(), m_units.end(), [&](const Row* r) { return r->widget == watched; });
  if (it == m_units.end()) return QWidget::eventFilter(watched, event);
  if (event->type() == QEvent::DragEnter) {
    auto* e = static_cast<QDragEnterEvent*>(event);
    if (e->mimeData()->hasUrls() || e->mimeData()->hasImage()) e->acceptProposedAction();
    return true;
  }
  if (event->type() == QEvent::Drop) {
    auto* e = static_cast<QDropEvent*>(event);
    const int index = static_cast<int>(it - m_units.begin());
    if (e->mimeData()->hasImage()) {
      setImage(index, qvariant_cast<QImage>(e->mimeData()->imageData()), tr("a dropped image"));
    } else if (!e->mimeData()->urls().isEmpty()) {
      QString error;
      if (!loadImage(index, e->mimeData()->urls().first().toLocalFile(), &error)) emit notice(error);
    }
    e->acceptProposedAction();
    return true;
  }
  return QWidget::eventFilter(watched, event);
}

}  // namespace diffract::ui
