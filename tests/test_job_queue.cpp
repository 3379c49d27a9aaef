// The job queue: Generate during a run queues instead of restarting; reorder, remove, clear,
// estimates; variations over seeds.
#include <QCheckBox>
#include <QLabel>
#include <QLineEdit>
#include <QListWidget>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QSettings>
#include <QSignalSpy>
#include <QSpinBox>
#include <QStandardPaths>
#include <QTemporaryDir>
#include <QtTest>

#include <nlohmann/json.hpp>

#include "ui/job_queue.h"
#include "ui/main_window.h"
#include "test_util.h"
#include "window_test_util.h"

using namespace diffract;
using namespace diffract::ui;

namespace {

using test::child;

void setUpJob(MainWindow& w, int steps, const char* seed) {
  test::setUpJob(w, steps, test::tinyModel(), QString::fromLatin1(seed));
  w.findChild<QPlainTextEdit*>("promptEdit")->setPlainText("a red apple");
}

QueuedJob queued(std::uint64_t seed, int steps = 20) {
  QueuedJob j;
  j.request.prompt = "a cat";
  j.request.seed = seed;
  j.request.steps = steps;
  j.request.width = j.request.height = 1000;
  return j;
}

std::uint64_t seedOf(const RenderedImage& r) {
  return nlohmann::json::parse(r.metadataJson.toStdString())["seed"].get<std::uint64_t>();
}

}  // namespace

class TestJobQueue : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

 private slots:
  void initTestCase() {
    QVERIFY(m_tmp.isValid());
    QStandardPaths::setTestModeEnabled(true);
    QCoreApplication::setOrganizationName("DiffractTests");
    QCoreApplication::setApplicationName("test_job_queue");
    qputenv("DIFFRACT_OUTPUT_DIR", m_tmp.filePath("out").toLocal8Bit());
  }
  void init() { QSettings().clear(); }

  void reordersRemovesAndEstimates() {
    JobQueuePanel q;
    for (std::uint64_t s : {1, 2, 3}) q.add(queued(s));
    QCOMPARE(q.count(), 3);
    QCOMPARE(q.list()->item(0)->text(), QString("a cat · 20 steps · 1000×1000 · seed 1"));
    QVERIFY(q.totalText().contains("time unknown"));
    q.moveDown(0);  // 2 1 3
    q.moveUp(2);    // 2 3 1
    QCOMPARE(q.at(0).request.seed, std::uint64_t(2));
    QCOMPARE(q.at(1).request.seed, std::uint64_t(3));
    QCOMPARE(q.at(2).request.seed, std::uint64_t(1));
    q.moveUp(0);  // no-ops at the ends
    q.moveDown(2);
    q.remove(7);
    QCOMPARE(q.at(0).request.seed, std::uint64_t(2));
    q.remove(1);  // 2 1
    QCOMPARE(q.count(), 2);
    // 10 ms per megapixel-step: a 1-megapixel job of 20 steps is 0.2 s.
    q.setStepCost(10);
    QCOMPARE(q.estimateSeconds(q.at(0)), 0.2);
    QVERIFY2(q.totalText().contains("2 jobs waiting · ~0.4 s in all"), qPrintable(q.totalText()));
    QVERIFY(q.list()->item(0)->text().endsWith("~0.2 s"));
    auto lanes = queued(9);
    lanes.lanes = engine::LaneSet{};
    lanes.lanes->lanes.resize(2);
    lanes.lanes->lanes[1].steps = 10;
    QCOMPARE(q.estimateSeconds(lanes), 0.3);  // 20 + 10 steps
    QCOMPARE(q.takeNext()->request.seed, std::uint64_t(2));
    q.clear();
    QCOMPARE(q.count(), 0);
    QVERIFY(!q.takeNext());
  }

  // Generate during a run adds to the queue; the running job goes on; a removed job never runs;
  // the rest run in order.
  void generateDuringARunQueues() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 60, "5");
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    QSignalSpy cancelled(w.bridge(), &EngineBridge::cancelled);
    QSignalSpy steps(w.bridge(), &EngineBridge::stepDone);
    auto* generate = child<QPushButton>(w, "generateButton");
    QTest::mouseClick(generate, Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() > 0, 60000);
    QCOMPARE(generate->text(), QString("Add to queue"));
    child<QSpinBox>(w, "stepsSpin")->setValue(3);
    for (const char* seed : {"6", "7", "8"}) {
      child<QLineEdit>(w, "seedEdit")->setText(seed);
      QTest::mouseClick(generate, Qt::LeftButton);
    }
    QCOMPARE(w.queuePanel()->count(), 3);
    QVERIFY(child<QLabel>(w, "statusLabel")->text().contains("Added to the queue (3 waiting)"));
    w.queuePanel()->remove(1);  // seed 7
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 3, 120000);
    QCOMPARE(cancelled.count(), 0);
    QTest::qWait(100);
    QCOMPARE(finished.count(), 3);
    QCOMPARE(w.queuePanel()->count(), 0);
    const auto& r = w.results();
    QCOMPARE(r.size(), 3);
    QCOMPARE(seedOf(r[0]), std::uint64_t(5));
    QCOMPARE(seedOf(r[1]), std::uint64_t(6));
    QCOMPARE(seedOf(r[2]), std::uint64_t(8));
    QVERIFY(!w.queuePanel()->totalText().contains("unknown"));  // a job has run: the cost is known
  }

  void queuesSeedVariations() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 2, "40");
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    w.queuePanel()->variations()->setValue(3);
    QTest::mouseClick(child<QPushButton>(w, "queueSeedsButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 3, 120000);
    QCOMPARE(seedOf(w.results()[0]), std::uint64_t(40));
    QCOMPARE(seedOf(w.results()[1]), std::uint64_t(41));
    QCOMPARE(seedOf(w.results()[2]), std::uint64_t(42));
  }
};

QTEST_MAIN(TestJobQueue)
#include "test_job_queue.moc"
