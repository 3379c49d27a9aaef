#include "ui/gallery.h"

#include <QDesktopServices>
#include <QDir>
#include <QFileDialog>
#include <QFileInfo>
#include <QFutureWatcher>
#include <QHBoxLayout>
#include <QImageReader>
#include <QLabel>
#include <QListWidget>
#include <QMessageBox>
#include <QPushButton>
#include <QUrl>
#include <QVBoxLayout>
#include <QtConcurrent/QtConcurrentRun>
#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/engine/lanes.h"
#include "ui/variation_grid.h"

namespace diffract::ui {

namespace {

QString caption(const GalleryView::Entry& e) {
  if (e.lanes > 0) return QObject::tr("lanes · %n lane(s)", nullptr, e.lanes);
  const auto meta = nlohmann::json::parse(e.metadataJson.toStdString(), nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object() || !meta.contains("seed") || !meta.contains("steps")) return QFileInfo(e.path).fileName();
  return QObject::tr("seed %1 · %2 steps").arg(QString::fromStdString(meta["seed"].dump()),
                                               QString::fromStdString(meta["steps"].dump()));
}

}  // namespace

GalleryView::GalleryView(QWidget* parent) : QWidget(parent) {
  setObjectName(QStringLiteral("galleryView"));
  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(4, 4, 4, 4);
  m_list = new QListWidget;
  m_list->setObjectName(QStringLiteral("galleryList"));
  m_list->setViewMode(QListView::IconMode);
  m_list->setIconSize(QSize(kThumbnailSize, kThumbnailSize));
  m_list->setResizeMode(QListView::Adjust);
  m_list->setMovement(QListView::Static);
  m_list->setUniformItemSizes(true);
  m_list->setWordWrap(true);
  m_list->setSelectionMode(QAbstractItemView::ExtendedSelection);
  layout->addWidget(m_list, 1);

  auto* buttons = new QHBoxLayout;
  m_status = new QLabel;
  m_status->setObjectName(QStringLiteral("galleryStatus"));
  auto* refresh = new QPushButton(tr("Refresh"));
  refresh->setObjectName(QStringLiteral("galleryRefresh"));
  auto* openFolder = new QPushButton(tr("Open folder"));
  openFolder->setObjectName(QStringLiteral("galleryOpenFolder"));
  m_saveAs = new QPushButton(tr("Save as…"));
  m_saveAs->setObjectName(QStringLiteral("gallerySaveAs"));
  m_delete = new QPushButton(tr("Delete…"));
  m_delete->setObjectName(QStringLiteral("galleryDelete"));
  m_compare = new QPushButton(tr("Compare"));
  m_compare->setObjectName(QStringLiteral("galleryCompare"));
  m_compare->setToolTip(tr("Select two images"));
  m_useAsInput = new QPushButton(tr("Use as input"));
  m_useAsInput->setObjectName(QStringLiteral("galleryUseAsInput"));
  m_useAsInput->setToolTip(tr("The selected image becomes the input image (vary it, or paint a mask)"));
  buttons->addWidget(m_status, 1);
  for (QPushButton* b : {refresh, openFolder, m_saveAs, m_delete, m_compare, m_useAsInput}) buttons->addWidget(b);
  layout->addLayout(buttons);

  connect(refresh, &QPushButton::clicked, this, &GalleryView::refresh);
  connect(openFolder, &QPushButton::clicked, this, [this] {
    QDir().mkpath(m_folder);
    if (!QDesktopServices::openUrl(QUrl::fromLocalFile(m_folder)))
      m_status->setText(tr("No file manager opened %1: open it yourself").arg(QDir::toNativeSeparators(m_folder)));
  });
  connect(m_saveAs, &QPushButton::clicked, this, &GalleryView::saveSelectedAs);
  connect(m_delete, &QPushButton::clicked, this, &GalleryView::deleteSelected);
  connect(m_compare, &QPushButton::clicked, this, [this] {
    const QStringList paths = selectedPaths();
    if (paths.size() == 2) emit compareRequested(paths[0], paths[1]);
  });
  connect(m_useAsInput, &QPushButton::clicked, this, [this] {
    const QStringList paths = selectedPaths();
    if (paths.size() == 1) emit useAsInputRequested(paths.front());
  });
  connect(m_list, &QListWidget::itemSelectionChanged, this, &GalleryView::updateButtons);
  connect(m_list, &QListWidget::itemDoubleClicked, this, [this](QListWidgetItem* item) {
    const QString path = item->data(Qt::UserRole).toString();
    if (item->data(Qt::UserRole + 1).toInt() > 0) emit lanesRequested(path);
    else emit restoreRequested(path);
  });
  updateButtons();
}

bool GalleryView::readEntry(const QString& path, Entry* entry, QString* error) {
  QImageReader reader(path, "png");
  QImage image = reader.read();
  if (image.isNull()) {
    *error = tr("%1: %2").arg(QFileInfo(path).fileName(), reader.errorString());
    return false;
  }
  entry->path = path;
  entry->size = image.size();
  entry->thumbnail = image.scaled(kThumbnailSize, kThumbnailSize, Qt::KeepAspectRatio, Qt::SmoothTransformation);
  entry->parameters = image.text(QStringLiteral("parameters"));
  entry->metadataJson = image.text(QStringLiteral("diffract"));
  entry->modified = QFileInfo(path).lastModified();
  return true;
}

bool GalleryView::readLanesEntry(const QString& lanesJson, Entry* entry, QString* error) {
  engine::SavedLaneGroup group;
  try {
    group = engine::read_lane_group(lanesJson.toStdString());
  } catch (const std::exception& e) {
    *error = QString::fromUtf8(e.what());
    return false;
  }
  QList<QImage> images;
  for (const auto& lane : group.lanes) {
    QImageReader reader(QString::fromStdString(lane.image), "png");
    reader.setAutoTransform(false);
    const QImage image = lane.image.empty() ? QImage() : reader.read();
    if (!image.isNull()) images << image.scaled(kThumbnailSize, kThumbnailSize, Qt::KeepAspectRatio, Qt::SmoothTransformation);
  }
  if (images.isEmpty()) {
    *error = tr("%1: no lane of it finished").arg(QDir::toNativeSeparators(lanesJson));
    return false;
  }
  entry->path = lanesJson;
  entry->lanes = static_cast<int>(group.lanes.size());
  entry->size = images.first().size();
  entry->thumbnail = tileBatch(images).scaled(kThumbnailSize, kThumbnailSize, Qt::KeepAspectRatio, Qt::SmoothTransformation);
  QStringList lines;
  for (std::size_t i = 0; i < group.lanes.size(); ++i) {
    const auto& l = group.lanes[i];
    QString line = tr("Lane %1: %2").arg(i + 1).arg(QString::fromStdString(l.title));
    if (static_cast<int>(i) == group.baseline) line += tr(" (baseline)");
    else if (l.compared) line += tr(" · %1× · %2").arg(l.speedup, 0, 'f', 2).arg(l.identical ? tr("identical") : tr("PSNR %1 dB").arg(l.psnr, 0, 'f', 1));
    if (l.image.empty()) line += tr(" · did not finish");
    lines << line;
  }
  entry->parameters = lines.join(QLatin1Char('\n'));
  entry->modified = QFileInfo(lanesJson).lastModified();
  return true;
}

void GalleryView::setFolder(const QString& dir) {
  if (m_listing) {  // a newer listing replaces it: stop it and drop what it still reports
    m_listing->disconnect(this);
    m_listing->cancel();
    m_listing->deleteLater();
  }
  m_folder = dir;
  m_entries.clear();
  m_list->clear();
  m_problems.clear();
  m_listing = new QFutureWatcher<Loaded>(this);
  auto* watcher = m_listing;
  connect(watcher, &QFutureWatcher<Loaded>::resultsReadyAt, this, [this, watcher](int begin, int end) {
    for (int i = begin; i < end; ++i) {
      const Loaded loaded = watcher->resultAt(i);
      if (!loaded.error.isEmpty()) m_problems << loaded.error;
      else if (!contains(loaded.entry.path)) insertItem(static_cast<int>(m_entries.size()), loaded.entry);
    }
    updateStatus();
  });
  connect(watcher, &QFutureWatcher<Loaded>::finished, this, [this, watcher] {
    watcher->deleteLater();
    m_listing = nullptr;
    updateStatus();
    emit loaded();
  });
  updateStatus();
  watcher->setFuture(QtConcurrent::run(
      [](QPromise<Loaded>& promise, const QString& folder) {
        // The PNGs and the lane groups' lanes.json, newest first.
        QFileInfoList files = QDir(folder).entryInfoList({QStringLiteral("*.png"), QStringLiteral("*.PNG")}, QDir::Files);
        for (const QFileInfo& group : QDir(folder).entryInfoList({QStringLiteral("lanes-*")}, QDir::Dirs | QDir::NoDotAndDotDot))
          if (const QFileInfo lanes(QDir(group.filePath()).filePath(QStringLiteral("lanes.json"))); lanes.isFile()) files << lanes;
        std::stable_sort(files.begin(), files.end(),
                         [](const QFileInfo& a, const QFileInfo& b) { return a.lastModified() > b.lastModified(); });
        for (const QFileInfo& fi : files) {
          if (promise.isCanceled()) return;
          Loaded loaded;
          if (fi.fileName() == QLatin1String("lanes.json")) readLanesEntry(fi.filePath(), &loaded.entry, &loaded.error);
          else readEntry(fi.filePath(), &loaded.entry, &loaded.error);
          promise.addResult(loaded);
        }
      },
      dir));
}

bool GalleryView::contains(const QString& path) const {
  return std::any_of(m_entries.begin(), m_entries.end(), [&](const Entry& e) { return e.path == path; });
}

void GalleryView::updateStatus() {
  QString status = tr("%n image(s) in %1", nullptr, static_cast<int>(m_entries.size())).arg(QDir::toNativeSeparators(m_folder));
  if (m_listing) status += tr(" · loading…");
  if (!m_problems.isEmpty()) status += tr(" · %n unreadable", nullptr, static_cast<int>(m_problems.size()));
  m_status->setText(status);
  m_status->setToolTip(m_problems.join(QLatin1Char('\n')));
  updateButtons();
}

void GalleryView::insertItem(int row, const Entry& e) {
  m_entries.insert(row, e);
  auto* item = new QListWidgetItem(QIcon(QPixmap::fromImage(e.thumbnail)), caption(e));
  item->setData(Qt::UserRole, e.path);
  item->setData(Qt::UserRole + 1, e.lanes);
  item->setToolTip(e.lanes > 0 ? tr("%1 (double-click to compare)\n%2").arg(QFileInfo(e.path).dir().dirName(), e.parameters)
                               : tr("%1 (%2×%3)\n%4")
                                     .arg(QFileInfo(e.path).fileName())
                                     .arg(e.size.width())
                                     .arg(e.size.height())
                                     .arg(e.parameters.isEmpty() ? tr("no parameters") : e.parameters));
  m_list->insertItem(row, item);
}

void GalleryView::addFile(const QString& path) {
  auto* watcher = new QFutureWatcher<Loaded>(this);
  const QString folder = m_folder;
  connect(watcher, &QFutureWatcher<Loaded>::finished, this, [this, watcher, folder] {
    watcher->deleteLater();
    const Loaded one = watcher->result();
    if (folder != m_folder || !one.error.isEmpty() || contains(one.entry.path)) return;
    insertItem(0, one.entry);
    updateStatus();
    emit loaded();
  });
  watcher->setFuture(QtConcurrent::run([path] {
    Loaded loaded;
    readEntry(path, &loaded.entry, &loaded.error);
    return loaded;
  }));
}

QStringList GalleryView::selectedPaths() const {
  QStringList paths;
  for (int row = 0; row < m_list->count(); ++row)
    if (m_list->item(row)->isSelected()) paths << m_list->item(row)->data(Qt::UserRole).toString();
  return paths;
}

void GalleryView::updateButtons() {
  const qsizetype n = selectedPaths().size();
  const bool images = !lanesSelected();  // a lane group is reopened by double-click, or deleted
  m_saveAs->setEnabled(n == 1 && images);
  m_delete->setEnabled(n > 0);
  m_compare->setEnabled(n == 2 && images);
  m_useAsInput->setEnabled(n == 1 && images);
}

bool GalleryView::lanesSelected() const {
  for (int row = 0; row < m_list->count(); ++row)
    if (m_list->item(row)->isSelected() && m_list->item(row)->data(Qt::UserRole + 1).toInt() > 0) return true;
  return false;
}

QString GalleryView::saveCopy(const QString& from, const QString& to) {
  if (!QFileInfo(from).isFile()) return tr("cannot copy %1: it no longer exists").arg(QDir::toNativeSeparators(from));
  if (QFileInfo(from).canonicalFilePath() == QFileInfo(to).canonicalFilePath()) return {};
  if (QFileInfo::exists(to) && !QFile::remove(to)) return tr("cannot replace %1").arg(QDir::toNativeSeparators(to));
  QFile source(from);
  if (!source.copy(to)) return tr("cannot copy %1 to %2: %3").arg(QDir::toNativeSeparators(from), QDir::toNativeSeparators(to), source.errorString());
  return {};
}

QString GalleryView::deleteFiles(const QStringList& paths) {
  QStringList failed;
  for (const QString& path : paths) {
    // A lane group goes as a whole: its lanes-* folder inside the gallery's folder.
    const QFileInfo info(path);
    const bool group = info.fileName() == QLatin1String("lanes.json") && info.dir().dirName().startsWith(QLatin1String("lanes-")) &&
                       QFileInfo(info.dir().absolutePath()).dir() == QDir(m_folder);
    if (group) {
      QDir dir = info.dir();
      if (!dir.removeRecursively()) {
        failed << tr("%1 (not every file of the lane group could be removed)").arg(dir.dirName());
        continue;
      }
    } else if (QFile file(path); !file.remove()) {
      failed << tr("%1 (%2)").arg(info.fileName(), file.errorString());
      continue;
    }
    for (int row = 0; row < m_list->count(); ++row)
      if (m_list->item(row)->data(Qt::UserRole).toString() == path) {
        delete m_list->takeItem(row);
        m_entries.removeAt(row);
        break;
      }
  }
  updateStatus();
  return failed.isEmpty() ? QString() : tr("Could not delete: %1").arg(failed.join(QStringLiteral(", ")));
}

void GalleryView::saveSelectedAs() {
  const QStringList paths = selectedPaths();
  if (paths.size() != 1) return;
  const QString to = QFileDialog::getSaveFileName(this, tr("Save image as"), QFileInfo(paths[0]).fileName(),
                                                  tr("PNG images (*.png)"));
  if (to.isEmpty()) return;
  const QString error = saveCopy(paths[0], to);
  if (!error.isEmpty()) QMessageBox::warning(this, tr("Save as"), error);
}

void GalleryView::deleteSelected() {
  const QStringList paths = selectedPaths();
  if (paths.isEmpty()) return;
  QStringList names;
  for (const QString& p : paths) names << QFileInfo(p).fileName();
  const auto answer = QMessageBox::question(
      this, tr("Delete images"),
      tr("Delete %n image(s) from the disk? This cannot be undone.\n\n%1", nullptr, static_cast<int>(paths.size()))
          .arg(names.join(QLatin1Char('\n'))),
      QMessageBox::Yes | QMessageBox::No, QMessageBox::No);
  if (answer != QMessageBox::Yes) return;
  const QString error = deleteFiles(paths);
  if (!error.isEmpty()) QMessageBox::warning(this, tr("Delete images"), error);
}

}  // namespace diffract::ui
