// EngineBridge: the core's worker-thread callbacks arrive as signals on the GUI thread.
#include <QSignalSpy>
#include <QThread>

#include "test_util.h"
#include "ui/engine_bridge.h"

using namespace diffract;
using diffract::ui::EngineBridge;

namespace {

job::GenerationRequest tiny(int steps) {
  job::GenerationRequest r;
  r.model = (test::fixtures() / "tiny-sd").string();
  r.prompt = "a red apple";
  r.steps = steps;
  r.width = r.height = 64;
  r.seed = 3;
  r.preview_every = 1;
  return r;
}

}  // namespace

class TestEngineBridge : public QObject {
  Q_OBJECT
 private slots:
  void convertsImagesBothWays() {
    io::Image a;
    a.width = 3;  // 9-byte rows: QImage pads them to 12
    a.height = 2;
    for (int i = 0; i < 18; ++i) a.rgb.push_back(static_cast<std::uint8_t>(i * 13));
    const QImage q = ui::toQImage(a);
    QCOMPARE(q.size(), QSize(3, 2));
    QCOMPARE(q.pixel(2, 1), qRgb(15 * 13, 16 * 13, 17 * 13));
    QCOMPARE(ui::toCoreImage(q).rgb, a.rgb);
    QVERIFY(ui::toQImage(io::Image{}).isNull());
  }

  void streamsPreviewsThenFinishesOnTheGuiThread() {
    EngineBridge bridge;
    QSignalSpy steps(&bridge, &EngineBridge::stepDone);
    QSignalSpy previews(&bridge, &EngineBridge::previewReady);
    QSignalSpy stages(&bridge, &EngineBridge::stageTimed);
    QSignalSpy finished(&bridge, &EngineBridge::finished);
    QSignalSpy failed(&bridge, &EngineBridge::failed);
    // Direct connections run in the emitting thread: every one must be this (the GUI) thread.
    QList<QThread*> threads;
    QStringList order;
    connect(&bridge, &EngineBridge::stepDone, this, [&] { threads << QThread::currentThread(); order << "step"; },
            Qt::DirectConnection);
    connect(&bridge, &EngineBridge::previewReady, this,
            [&] { threads << QThread::currentThread(); order << "preview"; }, Qt::DirectConnection);
    connect(&bridge, &EngineBridge::finished, this, [&] { threads << QThread::currentThread(); order << "finished"; },
            Qt::DirectConnection);

    QCOMPARE(bridge.start(tiny(4)), quint64(1));
    QVERIFY(bridge.isRunning());
    QTRY_COMPARE_WITH_TIMEOUT(finished.count() + failed.count(), 1, 180000);
    QVERIFY2(failed.isEmpty(), failed.isEmpty() ? "" : qPrintable(failed.first().first().toString()));
    QVERIFY(!bridge.isRunning());
    for (QThread* t : threads) QCOMPARE(t, QThread::currentThread());
    QCOMPARE(order.last(), QStringLiteral("finished"));

    QCOMPARE(steps.count(), 4);
    QCOMPARE(previews.count(), 4);
    for (int i = 0; i < 4; ++i) {
      QCOMPARE(steps[i][0].toInt(), i);
      QCOMPARE(steps[i][1].toInt(), 4);
      QVERIFY(steps[i][3].toDouble() > 0);
      QCOMPARE(previews[i][0].toInt(), i);
      QVERIFY(!previews[i][1].value<QImage>().isNull());
    }
    QStringList stageNames;
    for (const auto& s : stages) stageNames << s[0].toString();
    QVERIFY2(stageNames.contains("text_encode") && stageNames.contains("vae_decode") && stageNames.contains("total"),
             qPrintable(stageNames.join(',')));

    const auto images = finished[0][0].value<QList<QImage>>();
    QCOMPARE(images.size(), 1);
    QCOMPARE(images[0].size(), QSize(64, 64));
    QVERIFY(finished[0][1].toString().contains("\"timings_ms\""));
    QVERIFY(finished[0][2].toString().contains("Steps: 4"));
    const auto timings = finished[0][3].value<ui::JobTimings>();
    QCOMPARE(timings.stepMs.size(), 4);
    QCOMPARE(timings.previewMs.size(), 4);
    QVERIFY(timings.totalMs > 0);
  }

  void cancelMidJobGivesCancelled() {
    EngineBridge bridge;
    QSignalSpy steps(&bridge, &EngineBridge::stepDone);
    QSignalSpy finished(&bridge, &EngineBridge::finished);
    QSignalSpy cancelled(&bridge, &EngineBridge::cancelled);
    QSignalSpy failed(&bridge, &EngineBridge::failed);
    bridge.start(tiny(500));
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 2 || !bridge.isRunning(), 180000);
    QVERIFY(bridge.isRunning());
    bridge.cancel();
    QTRY_COMPARE_WITH_TIMEOUT(cancelled.count(), 1, 60000);
    QVERIFY(!bridge.isRunning());
    QCOMPARE(finished.count(), 0);
    QCOMPARE(failed.count(), 0);
    QVERIFY(steps.count() < 500);
  }

  void errorsAreReportedAndTheNextJobWorks() {
    EngineBridge bridge;
    QSignalSpy finished(&bridge, &EngineBridge::finished);
    QSignalSpy failed(&bridge, &EngineBridge::failed);
    auto bad = tiny(2);
    bad.sampler = "heun";
    bridge.start(bad);
    QTRY_COMPARE_WITH_TIMEOUT(failed.count(), 1, 180000);
    QVERIFY2(failed[0][0].toString().contains("unknown sampler 'heun'"), qPrintable(failed[0][0].toString()));
    QVERIFY(!bridge.isRunning());

    auto missing = tiny(2);
    missing.model = (test::fixtures() / "nowhere").string();
    bridge.start(missing);
    QTRY_COMPARE_WITH_TIMEOUT(failed.count(), 2, 60000);
    QVERIFY2(failed[1][0].toString().contains("nowhere"), qPrintable(failed[1][0].toString()));

    bridge.start(tiny(2));
    QTRY_COMPARE_WITH_TIMEOUT(finished.count() + failed.count(), 3, 180000);
    QCOMPARE(finished.count(), 1);
  }

  // Preparing is for GPUs only, and a preparation that fails (here: no CUDA on this machine)
  // says nothing and leaves the bridge working.
  void prepareQueuesOnlyGpuRequestsAndFailsSilently() {
    EngineBridge bridge;
    QSignalSpy finished(&bridge, &EngineBridge::finished);
    QSignalSpy failed(&bridge, &EngineBridge::failed);
    QVERIFY(!bridge.prepare(tiny(2)));  // CPU
    auto noModel = tiny(2);
    noModel.model.clear();
    noModel.device = "cuda:0";
    QVERIFY(!bridge.prepare(noModel));
    auto gpu = tiny(2);
    gpu.device = "cuda:0";
    QVERIFY(bridge.prepare(gpu));
    QVERIFY(bridge.prepare(gpu));  // replaces the first
    QVERIFY(!bridge.isRunning());
    bridge.start(tiny(2));
    QTRY_COMPARE_WITH_TIMEOUT(finished.count() + failed.count(), 1, 180000);
    QCOMPARE(finished.count(), 1);
  }

  void aNewerJobSilencesTheOlderOne() {
    EngineBridge bridge;
    QSignalSpy steps(&bridge, &EngineBridge::stepDone);
    QSignalSpy finished(&bridge, &EngineBridge::finished);
    QSignalSpy cancelled(&bridge, &EngineBridge::cancelled);
    bridge.start(tiny(300));
    QCOMPARE(bridge.start(tiny(3)), quint64(2));
    QTRY_COMPARE_WITH_TIMEOUT(finished.count(), 1, 180000);
    QCOMPARE(cancelled.count(), 0);  // the first job's cancellation is stale
    QCOMPARE(steps.count(), 3);
    for (const auto& s : steps) QCOMPARE(s[1].toInt(), 3);
    QCOMPARE(finished[0][3].value<ui::JobTimings>().stepMs.size(), 3);
  }

  void destroyingWhileRunningIsClean() {
    auto bridge = std::make_unique<EngineBridge>();
    QSignalSpy steps(bridge.get(), &EngineBridge::stepDone);
    bridge->start(tiny(500));
    QTRY_VERIFY_WITH_TIMEOUT(steps.count() >= 1, 180000);
    bridge.reset();  // cancels and joins; queued events die with the object
    QCoreApplication::processEvents();
  }
};

QTEST_MAIN(TestEngineBridge)
#include "test_engine_bridge.moc"
