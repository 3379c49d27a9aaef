#include "ui/preset_bar.h"

#include <QComboBox>
#include <QDir>
#include <QFile>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QInputDialog>
#include <QLabel>
#include <QLineEdit>
#include <QSignalBlocker>
#include <QStandardPaths>
#include <QToolButton>
#include <QVBoxLayout>
#include <algorithm>
#include <exception>

#include "core/util/error.h"

namespace diffract::ui {

PresetBar::PresetBar(QWidget* parent) : QWidget(parent) {
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  auto* row = new QHBoxLayout;
  row->addWidget(new QLabel(tr("Preset")));
  m_combo = new QComboBox;
  m_combo->setObjectName(QStringLiteral("presetCombo"));
  m_combo->setToolTip(tr("Fills the settings and wraps your prompt in the preset's template"));
  row->addWidget(m_combo, 1);
  auto* saveButton = new QToolButton;
  saveButton->setObjectName(QStringLiteral("savePresetButton"));
  saveButton->setText(tr("Save as preset…"));
  row->addWidget(saveButton);
  layout->addLayout(row);
  m_templateLabel = new QLabel;
  m_templateLabel->setObjectName(QStringLiteral("promptTemplateLabel"));
  m_templateLabel->setWordWrap(true);
  m_templateLabel->setTextFormat(Qt::PlainText);
  m_templateLabel->hide();
  layout->addWidget(m_templateLabel);

  connect(m_combo, &QComboBox::activated, this, [this](int index) {
    select(index);
    if (index > 0 && index <= static_cast<int>(m_presets.size())) emit applied(m_presets[index - 1]);
  });
  connect(saveButton, &QToolButton::clicked, this, [this] {
    bool ok = false;
    const QString name = QInputDialog::getText(this, tr("Save as preset"),
                                               tr("Preset name (a prompt containing {subject} becomes its template):"),
                                               QLineEdit::Normal, currentName(), &ok);
    if (ok && !name.trimmed().isEmpty()) emit saveRequested(name.trimmed());
  });
}

QString PresetBar::userPresetDir() {
  return QDir(QStandardPaths::writableLocation(QStandardPaths::AppConfigLocation)).filePath(QStringLiteral("presets"));
}

QStringList PresetBar::reload(const QString& selectName) {
  m_presets.clear();
  QStringList problems;
  // Shipped presets are compiled in (ui/CMakeLists.txt); a broken one is a build bug, still reported.
  const QDir shipped(QStringLiteral(":/presets"));
  for (const QString& name : shipped.entryList({QStringLiteral("*.json")}, QDir::Files, QDir::Name)) {
    QFile f(shipped.filePath(name));
    try {
      if (!f.open(QIODevice::ReadOnly)) throw Error(f.fileName().toStdString() + ": cannot open");
      m_presets.push_back(engine::parse_preset(f.readAll().toStdString(), f.fileName().toStdString()));
    } catch (const std::exception& e) {
      problems << QString::fromUtf8(e.what());
    }
  }
  const QDir user(userPresetDir());
  for (const QFileInfo& fi : user.entryInfoList({QStringLiteral("*.json")}, QDir::Files, QDir::Name)) {
    try {
      m_presets.push_back(engine::load_preset(fi.filePath().toStdString()));
    } catch (const std::exception& e) {
      problems << QString::fromUtf8(e.what());
    }
  }
  const QSignalBlocker block(m_combo);
  m_combo->clear();
  m_combo->addItem(tr("No preset"));
  for (const auto& p : m_presets) {
    m_combo->addItem(QString::fromStdString(p.name), QString::fromStdString(p.name));
    m_combo->setItemData(m_combo->count() - 1, QString::fromStdString(p.description), Qt::ToolTipRole);
  }
  select(selectName.isEmpty() ? 0 : std::max(0, m_combo->findData(selectName)));
  return problems;
}

void PresetBar::select(int index) {
  setModified(false);
  m_combo->setCurrentIndex(index);
  const bool active = index > 0 && index <= static_cast<int>(m_presets.size());
  m_template = active ? QString::fromStdString(m_presets[index - 1].prompt_template)
                      : QString::fromLatin1(engine::kSubjectPlaceholder);
  m_templateLabel->setText(tr("Prompt template: %1").arg(m_template));
  m_templateLabel->setVisible(active);
  emit templateChanged(m_template, active);
}

QString PresetBar::currentName() const {
  return m_combo->currentIndex() > 0 ? m_combo->currentData().toString() : QString();
}

const engine::Preset* PresetBar::current() const {
  const int i = m_combo->currentIndex();
  return i > 0 && i <= static_cast<int>(m_presets.size()) ? &m_presets[i - 1] : nullptr;
}

void PresetBar::setModified(bool modified) {
  m_modified = modified && current();
  const int i = m_combo->currentIndex();
  if (i <= 0) return;
  const QString name = m_combo->itemData(i).toString();
  m_combo->setItemText(i, m_modified ? tr("%1 (changed)").arg(name) : name);
}

QString PresetBar::save(const engine::Preset& p) {
  const QString file = QDir(userPresetDir()).filePath(QString::fromStdString(engine::preset_file_name(p.name)));
  engine::save_preset(p, file.toStdString());
  return file;
}

}  // namespace diffract::ui
