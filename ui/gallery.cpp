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

namespace diffract::ui {

namespace {

QString caption(const GalleryView::Entry& e) {
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
  connect(m_list, &QListWidget::itemDoubleClicked, this,
          [this](QListWidgetItem* item) { emit restoreRequested(item->data(Qt::UserRole).toString()); });
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
        const QFileInfoList files = QDir(folder).entryInfoList({QStringLiteral("*.png"), QStringLiteral("*.PNG")},
                                                               QDir::Files, QDir::Time);
        for (const QFileInfo& fi : files) {
          if (promise.isCanceled()) return;
          Loaded loaded;
          readEntry(fi.filePath(), &loaded.entry, &loaded.error);
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
  item->setToolTip(tr("%1 (%2×%3)\n%4")
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
  m_saveAs->setEnabled(n == 1);
  m_delete->setEnabled(n > 0);
  m_compare->setEnabled(n == 2);
  m_useAsInput->setEnabled(n == 1);
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
    QFile file(path);
    if (!file.remove()) {
      failed << tr("%1 (%2)").arg(QFileInfo(path).fileName(), file.errorString());
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
