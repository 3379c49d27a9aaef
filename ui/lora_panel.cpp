#include "ui/lora_panel.h"

#include <QCheckBox>
#include <QDateTime>
#include <QFileDialog>
#include <QFileInfo>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QLabel>
#include <QPushButton>
#include <QSlider>
#include <QVBoxLayout>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>

#include "core/engine/lora_library.h"
#include "core/text/prompt_syntax.h"
#include "core/util/embedded_model.h"

namespace diffract::ui {

struct LoraPanel::Row {
  QWidget* widget = nullptr;
  QCheckBox* enabled = nullptr;
  QSlider* weight = nullptr;  // hundredths
  QLabel* value = nullptr;
  QString name, path;
  QStringList triggers;
};

LoraPanel::LoraPanel(QWidget* parent) : QWidget(parent) {
  auto* outer = new QVBoxLayout(this);
  outer->setContentsMargins(0, 0, 0, 0);
  auto* group = new QGroupBox(tr("LoRAs"));
  group->setObjectName(QStringLiteral("loraGroup"));
  outer->addWidget(group);
  auto* layout = new QVBoxLayout(group);
  auto* top = new QHBoxLayout;
  m_summary = new QLabel;
  m_summary->setObjectName(QStringLiteral("loraSummary"));
  m_summary->setWordWrap(true);
  m_summary->setTextFormat(Qt::PlainText);
  top->addWidget(m_summary, 1);
  auto* add = new QPushButton(tr("Folder…"));
  add->setObjectName(QStringLiteral("loraAddFolder"));
  add->setToolTip(tr("Add a folder of LoRA files (.safetensors)"));
  auto* rescan = new QPushButton(tr("Rescan"));
  rescan->setObjectName(QStringLiteral("loraRescan"));
  top->addWidget(add);
  top->addWidget(rescan);
  layout->addLayout(top);
  m_list = new QVBoxLayout;
  m_list->setSpacing(2);
  layout->addLayout(m_list);
  connect(add, &QPushButton::clicked, this, &LoraPanel::chooseFolder);
  connect(rescan, &QPushButton::clicked, this, &LoraPanel::refresh);
  refresh();
}

void LoraPanel::chooseFolder() {
  const QString dir = QFileDialog::getExistingDirectory(this, tr("A folder of LoRAs"));
  if (dir.isEmpty() || m_folders.contains(dir)) return;
  setFolders(m_folders + QStringList{dir});
}

void LoraPanel::setFolders(const QStringList& folders) {
  m_folders = folders;
  refresh();
  emit foldersChanged(m_folders);
}

void LoraPanel::refresh() {
  // Keep what the user set on the rows that stay.
  struct Kept {
    bool on;
    int weight;
  };
  std::map<QString, Kept> kept;
  for (auto* r : m_rows) {
    kept[r->path] = {r->enabled->isChecked(), r->weight->value()};
    delete r->widget;
    delete r;
  }
  m_rows.clear();
  std::vector<std::string> dirs;
  for (const auto& f : m_folders) dirs.push_back(f.toStdString());
  // The LoRAs shipped with the embedded model are listed whatever the folders.
  const auto shipped = embedded_lora_dir();
  const bool listShipped = !shipped.empty() && !m_folders.contains(QString::fromStdString(shipped.string()));
  if (listShipped) dirs.push_back(shipped.string());
  // Only the folders here: the Hugging Face cache holds whole models' .safetensors too.
  for (const auto& file : engine::find_lora_files(dirs, {})) {
    const auto info = engine::read_lora_info(file);
    auto* r = new Row;
    r->name = QString::fromStdString(info.name);
    r->path = QString::fromStdString(file.string());
    for (const auto& t : info.trigger_words) r->triggers << QString::fromStdString(t);
    r->widget = new QWidget;
    r->widget->setObjectName(QStringLiteral("loraRow_") + r->name);
    auto* v = new QVBoxLayout(r->widget);
    v->setContentsMargins(0, 0, 0, 0);
    v->setSpacing(0);
    auto* h = new QHBoxLayout;
    r->enabled = new QCheckBox(r->name);
    r->enabled->setToolTip(r->path + (info.base_model.empty() ? QString() : QStringLiteral("\n") + tr("trained on %1").arg(QString::fromStdString(info.base_model))) +
                           (info.error.empty() ? QString() : QStringLiteral("\n") + QString::fromStdString(info.error)));
    r->weight = new QSlider(Qt::Horizontal);
    r->weight->setRange(-200, 200);
    r->weight->setValue(100);
    r->weight->setToolTip(tr("Weight (-2 to 2)"));
    r->value = new QLabel(QStringLiteral("1.00"));
    r->value->setMinimumWidth(36);
    h->addWidget(r->enabled, 2);
    h->addWidget(r->weight, 2);
    h->addWidget(r->value);
    v->addLayout(h);
    if (!r->triggers.isEmpty()) {
      auto* t = new QHBoxLayout;
      auto* words = new QLabel(r->triggers.join(QStringLiteral(", ")));
      words->setObjectName(QStringLiteral("loraTriggers"));
      words->setWordWrap(true);
      words->setTextFormat(Qt::PlainText);
      words->setStyleSheet(QStringLiteral("color: palette(mid);"));
      auto* insert = new QPushButton(tr("+ prompt"));
      insert->setObjectName(QStringLiteral("loraInsertTriggers"));
      insert->setToolTip(tr("Add the most frequent trigger word, %1, to the prompt").arg(r->triggers.first()));
      t->addWidget(words, 1);
      t->addWidget(insert);
      v->addLayout(t);
      connect(insert, &QPushButton::clicked, this, [this, triggers = r->triggers] { emit insertText(triggers.first()); });
    }
    connect(r->weight, &QSlider::valueChanged, r->value, [label = r->value](int w) {
      label->setText(QString::number(w / 100.0, 'f', 2));
    });
    if (const auto it = kept.find(r->path); it != kept.end()) {
      r->enabled->setChecked(it->second.on);
      r->weight->setValue(it->second.weight);
    }
    m_list->addWidget(r->widget);
    m_rows.push_back(r);
  }
  if (m_folders.isEmpty() && !m_rows.empty())
    m_summary->setText(tr("%n LoRA(s) shipped with Diffract; add a folder to list yours (the prompt's <lora:NAME:W> tags are looked up there too).",
                          nullptr, static_cast<int>(m_rows.size())));
  else if (m_folders.isEmpty())
    m_summary->setText(tr("No LoRA folder yet: add one to list its LoRAs (the prompt's <lora:NAME:W> tags are looked up there too)."));
  else if (m_rows.empty())
    m_summary->setText(tr("No .safetensors files in %1").arg(m_folders.join(QStringLiteral(", "))));
  else
    m_summary->setText(tr("%n LoRA(s) in %1", nullptr, static_cast<int>(m_rows.size())).arg(m_folders.join(QStringLiteral(", "))));
}

LoraPanel::Row* LoraPanel::row(const QString& name) const {
  for (auto* r : m_rows)
    if (r->name.compare(name, Qt::CaseInsensitive) == 0) return r;
  return nullptr;
}

QStringList LoraPanel::names() const {
  QStringList out;
  for (const auto* r : m_rows) out << r->name;
  return out;
}

bool LoraPanel::enable(const QString& name, bool on, double weight) {
  auto* r = row(name);
  if (!r) return false;
  r->enabled->setChecked(on);
  r->weight->setValue(static_cast<int>(std::lround(std::clamp(weight, -2.0, 2.0) * 100)));
  return true;
}

bool LoraPanel::isEnabled(const QString& name) const {
  const auto* r = row(name);
  return r && r->enabled->isChecked();
}

double LoraPanel::weight(const QString& name) const {
  const auto* r = row(name);
  return r ? r->weight->value() / 100.0 : 0.0;
}

QStringList LoraPanel::triggerWords(const QString& name) const {
  const auto* r = row(name);
  return r ? r->triggers : QStringList();
}

void LoraPanel::fillRequest(job::GenerationRequest& req) const {
  for (const auto& f : m_folders) req.lora_dirs.push_back(f.toStdString());
  // A LoRA the prompt names with a tag is the tag's (its weight wins).
  std::vector<std::string> tagged;
  try {
    for (const auto& t : text::extract_extra_networks(req.prompt).tags) tagged.push_back(t.name);
  } catch (const std::exception&) {
    // The job reports the bad tag.
  }
  for (const auto* r : m_rows) {
    if (!r->enabled->isChecked()) continue;
    const auto name = r->name.toStdString();
    if (std::any_of(tagged.begin(), tagged.end(), [&](const std::string& t) {
          return QString::fromStdString(t).compare(r->name, Qt::CaseInsensitive) == 0;
        }))
      continue;
    const double w = r->weight->value() / 100.0;
    req.loras.push_back({r->path.toStdString(), w, w, name});
  }
}

void LoraPanel::applyPreset(const std::vector<engine::Preset::Lora>& loras, QStringList& missing) {
  for (auto* r : m_rows) r->enabled->setChecked(false);
  for (const auto& l : loras)
    if (!enable(QString::fromStdString(l.name), true, l.weight)) missing << tr("LoRA %1").arg(QString::fromStdString(l.name));
}

QString LoraPanel::restore(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored) {
  for (auto* r : m_rows) r->enabled->setChecked(false);
  QString prompt = p.prompt ? QString::fromStdString(*p.prompt) : QString();
  std::vector<text::ExtraNetworkTag> tags;
  try {
    tags = text::extract_extra_networks(prompt.toStdString()).tags;
  } catch (const std::exception&) {
  }
  const auto tagged = [&](const QString& name) {
    return std::any_of(tags.begin(), tags.end(), [&](const text::ExtraNetworkTag& t) {
      return QString::fromStdString(t.name).compare(name, Qt::CaseInsensitive) == 0;
    });
  };
  for (const auto& l : p.loras) {
    const auto name = QString::fromStdString(l.name.empty() ? std::filesystem::path(l.path).stem().string() : l.name);
    if (tagged(name)) continue;  // the prompt's tag brings it back
    if (enable(name, true, l.weight))
      restored << tr("LoRA %1").arg(name);
    else
      notRestored << tr("LoRA %1 (not in the LoRA folders)").arg(name);
  }
  for (const auto& t : tags) {
    const auto name = QString::fromStdString(t.name);
    if (row(name)) continue;
    QString hash;
    for (const auto& [n, h] : p.lora_hashes)
      if (QString::fromStdString(n).compare(name, Qt::CaseInsensitive) == 0) hash = QString::fromStdString(h).toLower();
    const Row* found = nullptr;
    if (!hash.isEmpty()) {
      for (const auto* r : m_rows) {
        const QFileInfo fi(r->path);
        const QString key = r->path + QLatin1Char('|') + QString::number(fi.size()) + QLatin1Char('|') +
                            QString::number(fi.lastModified().toMSecsSinceEpoch());
        auto it = m_hashes.find(key);
        if (it == m_hashes.end()) {
          QString h;
          try {
            h = QString::fromStdString(engine::lora_short_hash(r->path.toStdString()));
          } catch (const std::exception&) {
          }
          it = m_hashes.emplace(key, h).first;
        }
        if (!it->second.isEmpty() && it->second == hash.left(12)) {
          found = r;
          break;
        }
      }
    }
    if (found) {
      QString rewritten = QString::fromStdString(t.text);
      rewritten.replace(QStringLiteral("<lora:") + name, QStringLiteral("<lora:") + found->name);
      prompt.replace(QString::fromStdString(t.text), rewritten);
      restored << tr("LoRA %1 (found by its hash as %2)").arg(name, found->name);
    } else {
      notRestored << tr("LoRA %1 (not in the LoRA folders%2)").arg(name, hash.isEmpty() ? QString() : tr(", hash %1").arg(hash));
    }
  }
  return prompt;
}

}  // namespace diffract::ui
