#pragma once
// The one place where the core's worker-thread callbacks become Qt signals on the GUI thread.
#include <QImage>
#include <QList>
#include <QObject>
#include <QString>
#include <QVector>
#include <functional>
#include <memory>

#include "core/engine/lanes.h"
#include "core/job/job.h"

namespace diffract::engine {
class Engine;
class Job;
}  // namespace diffract::engine

namespace diffract::ui {

// A finished job's stage timings in milliseconds (the core's StageTimings, Qt side).
struct JobTimings {
  double loadMs = 0;
  double tokenizeMs = 0;
  double textEncodeMs = 0;
  QVector<double> stepMs;
  QVector<int> cachedSteps;  // indices into stepMs a step cache served
  QVector<double> previewMs;
  double vaeDecodeMs = 0;
  double totalMs = 0;
};

// A finished lane group's row per lane (the core's LaneOutcome, Qt side).
struct LaneRow {
  QString title;
  QString state;  // "done", "failed", "cancelled"
  QString error;
  QString devices;  // "cuda:1,cuda:2", "cpu"
  double timeMs = 0;  // text encode to decoded image
  bool compared = false;  // against the baseline lane (not the baseline itself)
  double speedup = 0, psnr = 0, ssim = 0, latentsRelL2 = 0;
  QStringList differences;
};

// Deep copy of an RGB8 core image.
QImage toQImage(const io::Image& image);
// And back, for writing PNGs through the core (any QImage format).
io::Image toCoreImage(const QImage& image);
// An image file the user picked (any format Qt reads, EXIF orientation applied), refused above
// the core's size limits before its pixels are read; a null image with `error` set otherwise.
QImage readImageFile(const QString& path, QString* error);

// Owns an engine::Engine (its worker thread) and turns each job's callbacks into queued
// signals, so slots always run on the thread the bridge lives on (the GUI thread) and the
// engine never waits on that thread. Only the newest job is reported: starting a job cancels
// the one running, whose late events are dropped by job id.
class EngineBridge : public QObject {
  Q_OBJECT
 public:
  explicit EngineBridge(QObject* parent = nullptr);
  ~EngineBridge() override;  // cancels the running job and joins the engine's worker

  // Starts a job (cancelling the current one) and returns its id (1, 2, ...).
  quint64 start(const job::GenerationRequest& request);
  // Starts a lane group (cancelling the current job): `request` through every lane of `lanes`
  // on the devices engine::plan_lanes gives them out of `enabledGpus`. Lane events arrive as
  // the lane* signals, the end as lanesFinished; the results and lanes.json are written to
  // `saveDir` (empty: not written) before it.
  quint64 startLanes(const job::GenerationRequest& request, const engine::LaneSet& lanes,
                     const std::vector<int>& enabledGpus, const QString& saveDir);
  void cancel();
  // On a GPU, loads the request's model and prepares its size, batch and previews in the
  // background (engine::Engine::preload), replacing a preparation still queued; silent.
  // Returns false (nothing queued) for CPU requests and requests without a model.
  bool prepare(const job::GenerationRequest& request);
  bool isRunning() const { return m_running; }
  quint64 currentJob() const { return m_currentJob; }

 signals:
  void started(quint64 job);
  void stageTimed(const QString& stage, double ms);
  void stepDone(int index, int total, double timestep, double ms, bool cached);
  void previewReady(int index, const QImage& image, double decodeMs);
  void finished(const QList<QImage>& images, const QString& metadataJson, const QString& parameters,
                const diffract::ui::JobTimings& timings);
  void failed(const QString& message);
  void cancelled();
  void laneStarted(int lane);
  void laneStep(int lane, int index, int total, double ms, bool cached);
  void lanePreview(int lane, const QImage& image);
  void laneFinished(int lane, const QList<QImage>& images, const QString& metadataJson, const QString& parameters,
                    const diffract::ui::JobTimings& timings);
  void laneFailed(int lane, const QString& message);
  void laneCancelled(int lane);
  // The group's end: a row per lane; `savedFile` the lanes.json written, or `saveError` why not.
  void lanesFinished(const QList<diffract::ui::LaneRow>& rows, bool cancelled, const QString& savedFile,
                     const QString& saveError);

 private:
  bool isCurrent(quint64 job) const { return m_running && job == m_currentJob; }
  // From any thread: on the bridge's thread, if `job` is still the current one, marks it ended
  // and runs `emitEnd` (which emits its last signal).
  void endJob(quint64 job, std::function<void()> emitEnd);

  std::unique_ptr<engine::Engine> m_engine;
  std::shared_ptr<engine::Job> m_job;
  std::shared_ptr<engine::Job> m_prepareJob;
  quint64 m_currentJob = 0;
  bool m_running = false;
};

}  // namespace diffract::ui

Q_DECLARE_METATYPE(diffract::ui::JobTimings)
Q_DECLARE_METATYPE(diffract::ui::LaneRow)
