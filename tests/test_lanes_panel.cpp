// The lanes panel and the lane grid: setups, the table, the sharing line, and lane groups run from
// the window on CPU virtual devices (previews per lane, charts, compare, cancel, a live GUI).
#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QElapsedTimer>
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
#include <QTableWidget>
#include <QTemporaryDir>
#include <QTimer>
#include <QtTest>

#include <nlohmann/json.hpp>

#include "ui/compare_view.h"
#include "ui/gallery.h"
#include "ui/image_view.h"
#include "ui/lane_grid.h"
#include "ui/lanes_panel.h"
#include "ui/main_window.h"
#include "ui/timings_chart.h"
#include "test_util.h"
#include "window_test_util.h"

using namespace diffract;
using namespace diffract::ui;

namespace {

using test::child;

void setUpJob(MainWindow& w, int steps) {
  test::setUpJob(w, steps);
  w.findChild<QPlainTextEdit*>("promptEdit")->setPlainText("a red apple");
}

engine::LaneSet lanes(std::initializer_list<std::pair<const char*, int>> strategyAndSteps) {
  engine::LaneSet set;
  set.name = "test lanes";
  for (const auto& [strategy, steps] : strategyAndSteps) {
    engine::Lane l;
    l.strategy.name = strategy;
    l.strategy.devices = std::string(strategy) == "driffusion" ? 2 : 1;
    l.steps = steps;
    set.lanes.push_back(l);
  }
  return set;
}

}  // namespace

class TestLanesPanel : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

 private slots:
  void initTestCase() {
    QVERIFY(m_tmp.isValid());
    QStandardPaths::setTestModeEnabled(true);
    QCoreApplication::setOrganizationName("DiffractTests");
    QCoreApplication::setApplicationName("test_lanes_panel");
    qputenv("DIFFRACT_OUTPUT_DIR", m_tmp.filePath("out").toLocal8Bit());
  }

  void init() {
    QSettings().clear();
    QDir(LanesPanel::userLaneDir()).removeRecursively();
  }

  void listsShippedSetupsAndEditsLanes() {
    LanesPanel p;
    QVERIFY(!p.lanesEnabled());
    p.setChecked(true);  // unticked, its fields are disabled as a group
    QVERIFY(p.setups()->count() >= 5);  // "Custom" and the shipped setups
    QVERIFY(p.selectSetup("30 vs 20 vs 12 steps"));
    auto set = p.laneSet();
    QCOMPARE(set.lanes.size(), std::size_t(3));
    QCOMPARE(set.lanes[2].steps, 12);
    QCOMPARE(set.name, std::string("30 vs 20 vs 12 steps"));
    QVERIFY(p.problem().isEmpty());

    // A lane's strategy decides which of its cells apply.
    p.setLaneSet(lanes({{"single", 0}, {"step-skip", 0}, {"fbcache", 0}}));
    auto* table = p.table();
    const auto spin = [&](int row, int column) { return qobject_cast<QAbstractSpinBox*>(table->cellWidget(row, column)); };
    QVERIFY(!spin(1, LanesPanel::Devices)->isEnabled());
    QVERIFY(spin(1, LanesPanel::Skip)->isEnabled());
    QVERIFY(!spin(0, LanesPanel::Threshold)->isEnabled());
    QVERIFY(spin(2, LanesPanel::Threshold)->isEnabled());
    auto* strategy = qobject_cast<QComboBox*>(table->cellWidget(0, LanesPanel::Strategy));
    strategy->setCurrentIndex(strategy->findData("driffusion"));
    QVERIFY(spin(0, LanesPanel::Devices)->isEnabled());
    qobject_cast<QSpinBox*>(spin(0, LanesPanel::Devices))->setValue(2);
    qobject_cast<QSpinBox*>(spin(1, LanesPanel::Skip))->setValue(3);
    set = p.laneSet();
    QCOMPARE(set.lanes[0].strategy.name, std::string("driffusion"));
    QCOMPARE(set.lanes[0].strategy.devices, 2);
    QCOMPARE(set.lanes[1].strategy.skip, 3);
    QCOMPARE(engine::lane_title(set.lanes[1]), std::string("step-skip x3"));

    // Add, remove (never the last lane), and at most kMaxLanes.
    p.setLaneSet(lanes({{"single", 0}}));
    QPushButton* add = p.findChild<QPushButton*>("addLaneButton");
    QPushButton* remove = p.findChild<QPushButton*>("removeLaneButton");
    QVERIFY(!remove->isEnabled());
    for (int i = 0; i < 10; ++i) add->click();
    QCOMPARE(p.laneCount(), engine::kMaxLanes);
    remove->click();
    QCOMPARE(p.laneCount(), engine::kMaxLanes - 1);

    // What cannot run is said before the run.
    auto odd = lanes({{"single", 0}, {"cfg-driffusion", 0}});
    odd.lanes[1].strategy.devices = 3;
    p.setLaneSet(odd);
    QVERIFY2(p.problem().contains("needs an even number"), qPrintable(p.problem()));
  }

  void saysWhichLanesShareADevice() {
    LanesPanel p;
    p.setLaneSet(lanes({{"single", 0}, {"driffusion", 0}, {"single", 12}}));
    job::GenerationRequest r;
    p.showPlan(r, {});
    QCOMPARE(p.planText(), QString("Lanes 1, 2 and 3 share cpu: they run one after another"));
    p.showPlan(r, {0, 1, 2, 3});
    QCOMPARE(p.planText(), QString("Every lane has devices of its own: they run at the same time."));
    p.showPlan(r, {0});
    QVERIFY2(p.planText().contains("Lane 2 cannot run: driffusion x2 needs 2 GPUs; 1 enabled"), qPrintable(p.planText()));
  }

  void savesAUserSetup() {
    LanesPanel p;
    p.setLaneSet(lanes({{"single", 30}, {"step-skip", 30}}));
    QCOMPARE(p.saveSetup("My race"), QString());
    QVERIFY(QFile::exists(QDir(LanesPanel::userLaneDir()).filePath("my-race.json")));
    LanesPanel q;
    QVERIFY(q.selectSetup("My race"));
    QCOMPARE(engine::lane_set_to_json(q.laneSet()), engine::lane_set_to_json(p.laneSet()));
    // A broken user file is named, not fatal.
    QFile broken(QDir(LanesPanel::userLaneDir()).filePath("broken.json"));
    QVERIFY(broken.open(QIODevice::WriteOnly));
    broken.write("{\"name\": 3}");
    broken.close();
    const auto problems = q.reloadSetups();
    QCOMPARE(problems.size(), 1);
    QVERIFY(problems[0].contains("broken.json"));
  }

  void windowKeepsTheLanesBetweenSessions() {
    {
      MainWindow w;
      w.lanesPanel()->setChecked(true);
      w.lanesPanel()->setLaneSet(lanes({{"single", 0}, {"step-skip", 12}}));
    }  // the window saves its settings when it goes
    MainWindow again;
    QVERIFY(again.lanesPanel()->lanesEnabled());
    const auto set = again.lanesPanel()->laneSet();
    QCOMPARE(set.lanes.size(), std::size_t(2));
    QCOMPARE(set.lanes[1].strategy.name, std::string("step-skip"));
    QCOMPARE(set.lanes[1].steps, 12);
  }

  // Two lanes from the window: each lane's previews and chart, both results saved with
  // lanes.json, and the compare window on the baseline against lane 2.
  void twoLanesRunFromTheWindow() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    setUpJob(w, 6);
    w.lanesPanel()->setChecked(true);
    w.lanesPanel()->setLaneSet(lanes({{"single", 0}, {"step-skip", 0}}));
    QSignalSpy previews(w.bridge(), &EngineBridge::lanePreview);
    QSignalSpy finished(w.bridge(), &EngineBridge::lanesFinished);
    QSignalSpy opened(&w, &MainWindow::compareOpened);
    const int before = static_cast<int>(w.results().size());
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 1, 120000);
    std::set<int> lanesWithPreviews;
    for (const auto& p : previews) lanesWithPreviews.insert(p[0].toInt());
    QCOMPARE(lanesWithPreviews, (std::set<int>{0, 1}));
    auto* grid = w.laneGrid();
    QCOMPARE(grid->laneCount(), 2);
    QCOMPARE(grid->stepsSeen(0), 6);
    QVERIFY(grid->stepsSeen(1) > 0);
    QVERIFY(grid->view(0)->isFinal());
    QVERIFY(grid->view(1)->isFinal());
    QVERIFY2(grid->resultText(1).contains("PSNR"), qPrintable(grid->resultText(1)));
    QVERIFY(grid->resultText(1).contains("strategy single -> step-skip x2"));
    QCOMPARE(static_cast<int>(w.results().size()), before + 2);
    const auto rows = finished[0][0].value<QList<LaneRow>>();
    QCOMPARE(rows.size(), 2);
    QVERIFY(rows[1].compared);
    const QString file = finished[0][2].toString();
    QVERIFY2(QFile::exists(file), qPrintable(file));
    QFile f(file);
    QVERIFY(f.open(QIODevice::ReadOnly));
    const auto saved = nlohmann::json::parse(f.readAll().toStdString());
    QCOMPARE(saved["lanes"].size(), std::size_t(2));
    QVERIFY(QFile::exists(w.results().last().savedPath));
    // The compare window opened on lane 1 (baseline) against lane 2.
    QTRY_COMPARE(opened.count(), 1);
    auto* view = opened[0][0].value<CompareView*>();
    QVERIFY(view);
    QStringList picked;
    for (const auto* combo : view->findChildren<QComboBox*>()) picked << combo->currentText();
    QVERIFY2(picked.contains("Lane 1: single") && picked.contains("Lane 2: step-skip x2"), qPrintable(picked.join(" | ")));
    view->close();

    // The gallery of that folder lists the group; double-clicking it reopens the comparison.
    auto* gallery = w.findChild<GalleryView*>();
    QVERIFY(gallery);
    QSignalSpy listed(gallery, &GalleryView::loaded);
    gallery->setFolder(QFileInfo(QFileInfo(file).absolutePath()).absolutePath());
    QVERIFY(listed.wait(30000));
    const auto group = std::find_if(gallery->entries().begin(), gallery->entries().end(),
                                    [](const GalleryView::Entry& e) { return e.lanes > 0; });
    QVERIFY(group != gallery->entries().end());
    QCOMPARE(group->lanes, 2);
    QCOMPARE(QFileInfo(group->path).canonicalFilePath(), QFileInfo(file).canonicalFilePath());
    QVERIFY2(group->parameters.contains("Lane 2: step-skip x2 · "), qPrintable(group->parameters));
    auto* list = gallery->findChild<QListWidget*>();
    QListWidgetItem* item = nullptr;
    for (int row = 0; row < list->count(); ++row)
      if (list->item(row)->data(Qt::UserRole).toString() == group->path) item = list->item(row);
    QVERIFY(item);
    emit list->itemDoubleClicked(item);
    QTRY_COMPARE(opened.count(), 2);
    auto* again = opened[1][0].value<CompareView*>();
    picked.clear();
    for (const auto* combo : again->findChildren<QComboBox*>()) picked << combo->currentText();
    QVERIFY2(picked.contains("Lane 1: single") && picked.contains("Lane 2: step-skip x2"), qPrintable(picked.join(" | ")));
    again->close();
    // A damaged lanes.json is named, not opened.
    const QString broken = QDir(QFileInfo(file).absolutePath()).filePath("broken-lanes.json");
    QFile b(broken);
    QVERIFY(b.open(QIODevice::WriteOnly));
    b.write(R"({"baseline": 0, "lanes": [{"name": "x", "files": ["../../etc/passwd"]}]})");
    b.close();
    QVERIFY(w.openSavedLanes(broken) == nullptr);
    const QString error = child<QLabel>(w, "errorLabel")->text();
    QVERIFY2(error.contains("broken-lanes.json: lane 1: field 'files'") && error.contains("not a file of the group's folder"),
             qPrintable(error));
    // Deleting the group's tile removes its folder and the tile.
    const QString groupPath = group->path;
    QCOMPARE(gallery->deleteFiles({groupPath}), QString());
    QVERIFY(!QFileInfo::exists(QFileInfo(file).absolutePath()));
    QVERIFY(std::none_of(gallery->entries().begin(), gallery->entries().end(),
                         [&](const GalleryView::Entry& e) { return e.path == groupPath; }));
  }

  // Three lanes; the GUI thread never stalls 50 ms while they run; a cancel mid-run ends every
  // lane and the next group runs.
  void threeLanesStayResponsiveAndCancel() {
    MainWindow w;
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    w.resize(1280, 720);
    setUpJob(w, 200);
    w.lanesPanel()->setChecked(true);
    w.lanesPanel()->setLaneSet(lanes({{"single", 0}, {"driffusion", 0}, {"step-skip", 0}}));
    QSignalSpy steps(w.bridge(), &EngineBridge::laneStep);
    QSignalSpy finished(w.bridge(), &EngineBridge::lanesFinished);
    QSignalSpy cancelledLanes(w.bridge(), &EngineBridge::laneCancelled);
    test::StallMeter meter([&] { return steps.count() > 0 && w.bridge()->isRunning(); });
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    meter.start();
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 25, 120000);
    meter.stop();
    QVERIFY2(w.laneGrid()->statusText(1).contains("Waits for lane 1"), qPrintable(w.laneGrid()->statusText(1)));
    QTest::mouseClick(child<QPushButton>(w, "cancelButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 1, 60000);
    QVERIFY(finished[0][1].toBool());
    QCOMPARE(cancelledLanes.count(), 3);
    QVERIFY(!w.bridge()->isRunning());
    QVERIFY(child<QLabel>(w, "statusLabel")->text().contains("cancelled"));
    // Two rows of tiles scroll inside the Lanes tab: the window keeps the size it was given.
    QCOMPARE(w.size(), QSize(1280, 720));
    qInfo("largest GUI-thread gap %lld ms over %lld ticks", meter.maxGap(), meter.ticks());
    QVERIFY2(meter.maxGap() < 50, qPrintable(QString("the GUI thread stalled for %1 ms").arg(meter.maxGap())));
    // The next group runs to its end.
    child<QSpinBox>(w, "stepsSpin")->setValue(3);
    QTest::mouseClick(child<QPushButton>(w, "generateButton"), Qt::LeftButton);
    QTRY_VERIFY_WITH_TIMEOUT(finished.count() == 2, 120000);
    QVERIFY(!finished[1][1].toBool());
    for (const auto& r : finished[1][0].value<QList<LaneRow>>()) QCOMPARE(r.state, QString("done"));
  }
};

QTEST_MAIN(TestLanesPanel)
#include "test_lanes_panel.moc"
