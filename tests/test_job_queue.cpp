// The job queue: Generate during a run queues instead of restarting; reorder, remove, clear,
// estimates; variations over seeds; a grid over two parameters (core/engine/variation_grid.h).
#include <QCheckBox>
#include <QComboBox>
#include <QFile>
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

#include "core/engine/variation_grid.h"
#include "core/io/image.h"
#include "core/util/error.h"
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

  // Axes parse with named errors; a grid's cells are row by row with both values set.
  void gridAxesAndCells() {
    const auto x = engine::parse_grid_axis("steps", " 2, 3 ");
    QCOMPARE(x.values, (std::vector<std::string>{"2", "3"}));
    const auto y = engine::parse_grid_axis("sampler", "euler,ddim");
    job::GenerationRequest base;
    base.seed = 9;
    const auto cells = engine::expand_grid(base, x, y);
    QCOMPARE(cells.size(), std::size_t(4));
    QCOMPARE(cells[1].x, 1);
    QCOMPARE(cells[1].y, 0);
    QCOMPARE(cells[1].request.steps, 3);
    QCOMPARE(cells[2].request.sampler, std::string("ddim"));
    QCOMPARE(cells[3].request.seed, std::uint64_t(9));
    const auto strategy = engine::parse_grid_axis("strategy", "single, step-skip:3, driffusion:2");
    auto r = base;
    engine::apply_grid_value(r, strategy.parameter, strategy.values[1]);
    QCOMPARE(r.strategy.skip, 3);
    engine::apply_grid_value(r, strategy.parameter, strategy.values[2]);
    QCOMPARE(r.strategy.devices, 2);
    QCOMPARE(engine::grid_label(x, 0), std::string("steps 2"));
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("steps", "20, x"), "steps", "'x' is not a whole number");
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("steps", "20,,30"), "an empty value");
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("colour", "red"), "unknown parameter 'colour'", "lora_weight");
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("sampler", "euler, warp"), "warp");
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("strategy", "teleport:2"), "unknown 'teleport:2'");
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("cfg", "1e400"), "cfg", "not a number");
    DIFFRACT_EXPECT_ERROR(engine::expand_grid(base, x, x), "both axes vary steps");
    DIFFRACT_EXPECT_ERROR(engine::expand_grid(base, engine::parse_grid_axis("lora_weight", "0.5, 1"), std::nullopt),
                          "no LoRA to weigh");
    std::string many = "1";
    for (int i = 2; i <= engine::kMaxGridValues + 1; ++i) many += "," + std::to_string(i);
    DIFFRACT_EXPECT_ERROR(engine::parse_grid_axis("steps", many), "more than 16 values");
  }

  // A 2x2 grid (steps x sampler) from the window: four jobs queue and run, the labelled grid
  // shows and is saved with its axes; a bad value queues nothing and says why.
  void queuesAGrid() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 2, "70");
    auto* q = w.queuePanel();
    q->gridX()->setCurrentIndex(q->gridX()->findData("steps"));
    q->gridXValues()->setText("2, x");
    QTest::mouseClick(child<QPushButton>(w, "queueGridButton"), Qt::LeftButton);
    QCOMPARE(q->count(), 0);
    QVERIFY(child<QLabel>(w, "errorLabel")->text().contains("'x' is not a whole number"));
    q->gridXValues()->setText("2, 3");
    q->gridY()->setCurrentIndex(q->gridY()->findData("sampler"));
    q->gridYValues()->setText("euler, ddim");
    QSignalSpy finished(w.bridge(), &EngineBridge::finished);
    QTest::mouseClick(child<QPushButton>(w, "queueGridButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 4, 120000);
    QTRY_VERIFY_WITH_TIMEOUT(child<QLabel>(w, "statusLabel")->text().contains("Grid of 2 × 2 done"), 10000);
    const auto& r = w.results();
    QCOMPARE(r.size(), 5);  // four cells, then the grid
    const auto meta = [&](int i) { return nlohmann::json::parse(r[i].metadataJson.toStdString()); };
    QCOMPARE(meta(1)["steps"].get<int>(), 3);
    QCOMPARE(meta(2)["sampler"].get<std::string>(), std::string("ddim"));
    const auto& grid = r[4];
    const QSize cell = r[0].image.size();
    QCOMPARE(grid.image.width() > 2 * cell.width(), true);   // a label column on the left
    QCOMPARE(grid.image.height() > 2 * cell.height(), true);  // a label row above
    QVERIFY(QFile::exists(grid.savedPath));
    const auto json = nlohmann::json::parse(grid.metadataJson.toStdString());
    QCOMPARE(json["x"]["parameter"].get<std::string>(), std::string("steps"));
    QCOMPARE(json["y"]["values"], nlohmann::json::array({"euler", "ddim"}));
    QCOMPARE(json["cells"].size(), std::size_t(4));
    QVERIFY(json["cells"][3].contains("file"));
    io::PngText text;
    io::read_png(grid.savedPath.toStdString(), &text);
    QCOMPARE(text.size(), std::size_t(1));
    QCOMPARE(text[0].first, std::string("diffract-grid"));
    QVERIFY(QFile::exists(QString(grid.savedPath).replace(".png", ".json")));
  }
};

QTEST_MAIN(TestJobQueue)
#include "test_job_queue.moc"
