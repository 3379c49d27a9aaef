// The gallery over a temporary output folder: loading off the GUI thread, parameters, save as,
// delete with confirmation, double-click to restore, two selected to compare.
#include <QApplication>
#include <QDir>
#include <QFile>
#include <QLabel>
#include <QListWidget>
#include <QMessageBox>
#include <QPushButton>
#include <QSignalSpy>
#include <QTemporaryDir>
#include <QSet>
#include <QTimer>

#include "core/io/image.h"
#include "test_util.h"
#include "ui/gallery.h"

using namespace diffract;
using diffract::ui::GalleryView;

namespace {

void writeImage(const QString& path, int width, int height, std::uint8_t shade, const std::string& seed) {
  io::write_png(path.toStdString(), io::Image{width, height, std::vector<std::uint8_t>(std::size_t(width) * height * 3, shade)},
                {{"parameters", "a mug\nSteps: 12, Sampler: Euler, CFG scale: 7, Seed: " + seed},
                 {"diffract", R"({"prompt": "a mug", "steps": 12, "seed": )" + seed + "}"}});
}

// Clicks the message box's button once it is up (it is modal: the click comes from the event loop).
void answerNextMessageBox(QMessageBox::StandardButton button, QString* text) {
  QTimer::singleShot(0, [=] {
    auto* box = qobject_cast<QMessageBox*>(QApplication::activeModalWidget());
    if (!box) qFatal("no message box");
    *text = box->text();
    box->button(button)->click();
  });
}

}  // namespace

class TestGallery : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  QString m_dir;

 private slots:
  void init() {
    m_dir = m_tmp.filePath(QString::number(QDateTime::currentMSecsSinceEpoch()));
    QVERIFY(QDir().mkpath(m_dir));
    writeImage(m_dir + "/a.png", 64, 32, 40, "11");
    writeImage(m_dir + "/b.png", 32, 32, 120, "22");
    writeImage(m_dir + "/c.png", 200, 400, 200, "33");
    QFile junk(m_dir + "/broken.png");
    QVERIFY(junk.open(QIODevice::WriteOnly));
    junk.write("not a png at all");
    junk.close();
    QFile text(m_dir + "/notes.txt");
    QVERIFY(text.open(QIODevice::WriteOnly));
  }

  void loadsWithoutBlockingAndShowsParameters() {
    GalleryView g;
    QSignalSpy loaded(&g, &GalleryView::loaded);
    g.setFolder(m_dir);
    QVERIFY(g.entries().isEmpty());  // setFolder returned before reading anything
    QVERIFY(loaded.wait(10000));
    QCOMPARE(g.entries().size(), 3);
    auto* list = g.findChild<QListWidget*>("galleryList");
    QCOMPARE(list->count(), 3);
    for (const auto& e : g.entries()) {
      QVERIFY(e.thumbnail.width() <= GalleryView::kThumbnailSize && e.thumbnail.height() <= GalleryView::kThumbnailSize);
      QVERIFY(e.parameters.contains("Steps: 12"));
      QVERIFY(e.metadataJson.contains("\"seed\""));
    }
    const auto c = std::find_if(g.entries().begin(), g.entries().end(), [](const auto& e) { return e.path.endsWith("c.png"); });
    QCOMPARE(c->size, QSize(200, 400));
    QCOMPARE(c->thumbnail.size(), QSize(80, 160));
    const QString status = g.findChild<QLabel*>("galleryStatus")->text();
    QVERIFY2(status.contains("3 image(s)") && status.contains("1 unreadable"), qPrintable(status));
    QVERIFY(g.findChild<QLabel*>("galleryStatus")->toolTip().contains("broken.png"));
    bool captioned = false;
    for (int i = 0; i < list->count(); ++i) captioned |= list->item(i)->text() == "seed 22 · 12 steps";
    QVERIFY(captioned);
  }

  void saveAsCopiesTheFile() {
    const QString to = m_tmp.filePath("copy.png");
    QCOMPARE(GalleryView::saveCopy(m_dir + "/a.png", to), QString());
    QFile x(m_dir + "/a.png"), y(to);
    QVERIFY(x.open(QIODevice::ReadOnly) && y.open(QIODevice::ReadOnly));
    QCOMPARE(x.readAll(), y.readAll());
    QVERIFY(GalleryView::saveCopy(m_dir + "/missing.png", m_tmp.filePath("x.png")).contains("cannot copy"));
  }

  void deleteAsksFirst() {
    GalleryView g;
    QSignalSpy loaded(&g, &GalleryView::loaded);
    g.setFolder(m_dir);
    QVERIFY(loaded.wait(10000));
    auto* list = g.findChild<QListWidget*>("galleryList");
    auto* del = g.findChild<QPushButton*>("galleryDelete");
    QVERIFY(!del->isEnabled());
    const int row = list->row(list->findItems("seed 11 · 12 steps", Qt::MatchExactly).value(0));
    QVERIFY(row >= 0);
    list->item(row)->setSelected(true);
    QVERIFY(del->isEnabled());

    QString question;
    answerNextMessageBox(QMessageBox::No, &question);
    del->click();
    QVERIFY2(question.contains("a.png"), qPrintable(question));
    QVERIFY(QFile::exists(m_dir + "/a.png"));  // said no
    QCOMPARE(list->count(), 3);

    answerNextMessageBox(QMessageBox::Yes, &question);
    del->click();
    QVERIFY(!QFile::exists(m_dir + "/a.png"));
    QCOMPARE(list->count(), 2);
    QCOMPARE(g.entries().size(), 2);
    QVERIFY(g.deleteFiles({m_dir + "/gone.png"}).contains("gone.png"));
  }

  void doubleClickAsksToRestoreAndTwoSelectedCompare() {
    GalleryView g;
    g.resize(800, 400);
    g.show();
    QVERIFY(QTest::qWaitForWindowExposed(&g));
    QSignalSpy loaded(&g, &GalleryView::loaded);
    g.setFolder(m_dir);
    QVERIFY(loaded.wait(10000));
    auto* list = g.findChild<QListWidget*>("galleryList");
    QSignalSpy restore(&g, &GalleryView::restoreRequested);
    const QRect r = list->visualItemRect(list->item(1));
    QTest::mouseClick(list->viewport(), Qt::LeftButton, {}, r.center());
    QTest::mouseDClick(list->viewport(), Qt::LeftButton, {}, r.center());
    QCOMPARE(restore.size(), 1);
    QCOMPARE(restore.first().first().toString(), g.entries()[1].path);

    QSignalSpy compare(&g, &GalleryView::compareRequested);
    auto* button = g.findChild<QPushButton*>("galleryCompare");
    QVERIFY(!button->isEnabled());
    QTest::mouseClick(list->viewport(), Qt::LeftButton, Qt::ControlModifier, list->visualItemRect(list->item(2)).center());
    QVERIFY(button->isEnabled());
    button->click();
    QCOMPARE(compare.size(), 1);
    QCOMPARE(QSet<QString>({compare.first()[0].toString(), compare.first()[1].toString()}),
             QSet<QString>({g.entries()[1].path, g.entries()[2].path}));
  }

  void aNewFolderReplacesOneStillLoading() {
    const QString other = m_dir + "-other";
    QVERIFY(QDir().mkpath(other));
    writeImage(other + "/only.png", 16, 16, 7, "5");
    GalleryView g;
    QSignalSpy loaded(&g, &GalleryView::loaded);
    g.setFolder(m_dir);
    g.setFolder(other);
    QVERIFY(loaded.wait(10000));
    QTest::qWait(200);  // anything the first listing still reports would arrive now
    QCOMPARE(loaded.size(), 1);
    QCOMPARE(g.entries().size(), 1);
    QCOMPARE(g.entries().first().path, other + "/only.png");
    QCOMPARE(g.findChild<QListWidget*>("galleryList")->count(), 1);
  }

  void newRenderAppearsFirst() {
    GalleryView g;
    QSignalSpy loaded(&g, &GalleryView::loaded);
    g.setFolder(m_dir);
    QVERIFY(loaded.wait(10000));
    writeImage(m_dir + "/new.png", 16, 16, 0, "99");
    g.addFile(m_dir + "/new.png");
    QVERIFY(loaded.wait(10000));
    QCOMPARE(g.entries().size(), 4);
    QCOMPARE(g.entries().first().path, m_dir + "/new.png");
  }
};

QTEST_MAIN(TestGallery)
#include "test_gallery.moc"
