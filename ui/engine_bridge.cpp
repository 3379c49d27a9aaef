#include "ui/engine_bridge.h"

#include <QFileInfo>
#include <QImageReader>
#include <QMetaObject>
#include <algorithm>
#include <cstring>
#include <exception>

#include "core/engine/engine.h"

namespace diffract::ui {

QImage toQImage(const io::Image& image) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() < static_cast<std::size_t>(image.width) * image.height * 3)
    return {};
  QImage out(image.width, image.height, QImage::Format_RGB888);
  const auto row = static_cast<std::size_t>(image.width) * 3;
  for (int y = 0; y < image.height; ++y)  // QImage rows are 4-byte aligned; ours are packed
    std::memcpy(out.scanLine(y), image.rgb.data() + row * y, row);
  return out;
}

io::Image toCoreImage(const QImage& image) {
  const QImage rgb = image.convertToFormat(QImage::Format_RGB888);
  io::Image out;
  out.width = rgb.width();
  out.height = rgb.height();
  const auto row = static_cast<std::size_t>(out.width) * 3;
  out.rgb.resize(row * out.height);
  for (int y = 0; y < out.height; ++y) std::memcpy(out.rgb.data() + row * y, rgb.constScanLine(y), row);
  return out;
}

QImage readImageFile(const QString& path, QString* error) {
  QImageReader reader(path);
  reader.setAutoTransform(true);
  const QSize size = reader.size();
  if (size.isValid() && (size.width() > io::kMaxImageSide || size.height() > io::kMaxImageSide ||
                         static_cast<long long>(size.width()) * size.height() > io::kMaxImagePixels)) {
    *error = QObject::tr("%1 is %2×%3: more than %4 pixels a side or %5 megapixels")
                 .arg(QFileInfo(path).fileName())
                 .arg(size.width())
                 .arg(size.height())
                 .arg(io::kMaxImageSide)
                 .arg(io::kMaxImagePixels / (1024 * 1024));
    return {};
  }
  QImage image = reader.read();
  if (image.isNull()) *error = QObject::tr("Cannot read %1: %2").arg(QFileInfo(path).fileName(), reader.errorString());
  return image;
}

namespace {

JobTimings toJobTimings(const job::StageTimings& t) {
  JobTimings j;
  j.loadMs = t.load_ms;
  j.tokenizeMs = t.tokenize_ms;
  j.textEncodeMs = t.text_encode_ms;
  j.stepMs = QVector<double>(t.step_ms.begin(), t.step_ms.end());
  j.cachedSteps = QVector<int>(t.cached_steps.begin(), t.cached_steps.end());
  j.previewMs = QVector<double>(t.preview_ms.begin(), t.preview_ms.end());
  j.vaeDecodeMs = t.vae_decode_ms;
  j.totalMs = t.total_ms;
  return j;
}

}  // namespace

EngineBridge::EngineBridge(QObject* parent) : QObject(parent), m_engine(std::make_unique<engine::Engine>()) {
  qRegisterMetaType<diffract::ui::JobTimings>();
  qRegisterMetaType<diffract::ui::LaneRow>();
}

EngineBridge::~EngineBridge() {
  // The engine's destructor cancels and joins its worker while this object is still whole, so
  // no callback can post to a half-destroyed bridge; events already posted die with it.
  m_engine.reset();
}

bool EngineBridge::prepare(const job::GenerationRequest& request) {
  if (request.model.empty() || request.device.rfind("cuda", 0) != 0) return false;
  if (m_prepareJob) m_prepareJob->cancel();  // a queued one is skipped; one loading finishes
  job::JobObserver o;
  o.on_error = [](const std::string&) {};  // the job that needs the model reports it
  m_prepareJob = m_engine->preload(request, std::move(o));
  return true;
}

void EngineBridge::endJob(quint64 job, std::function<void()> emitEnd) {
  QMetaObject::invokeMethod(
      this, [this, job, emitEnd = std::move(emitEnd)] {
        if (!isCurrent(job)) return;
        m_running = false;
        m_job.reset();
        emitEnd();
      },
      Qt::QueuedConnection);
}

quint64 EngineBridge::start(const job::GenerationRequest& request) {
  if (m_job) m_job->cancel();  // its remaining events are stale from here on
  const quint64 id = ++m_currentJob;
  m_running = true;

  // Every callback runs on the engine's worker: convert there (deep copies), post, return.
  // The lambdas run on this object's thread through the event loop and drop stale jobs.
  job::JobObserver o;
  o.on_stage = [this, id](const std::string& stage, double ms) {
    QMetaObject::invokeMethod(
        this, [this, id, s = QString::fromStdString(stage), ms] {
          if (isCurrent(id)) emit stageTimed(s, ms);
        },
        Qt::QueuedConnection);
  };
  o.on_step = [this, id](const job::StepEvent& e) {
    QMetaObject::invokeMethod(
        this, [this, id, e] {
          if (isCurrent(id)) emit stepDone(e.index, e.total, e.timestep, e.step_ms, e.cached);
        },
        Qt::QueuedConnection);
  };
  o.on_preview = [this, id](const job::PreviewEvent& e) {
    QMetaObject::invokeMethod(
        this, [this, id, index = e.index, image = toQImage(e.image), ms = e.decode_ms] {
          if (isCurrent(id)) emit previewReady(index, image, ms);
        },
        Qt::QueuedConnection);
  };
  o.on_done = [this, id](const job::GenerationResult& r) {
    QList<QImage> images;
    for (const auto& image : r.images) images.append(toQImage(image));
    endJob(id, [this, images, meta = QString::fromStdString(r.metadata_json),
                params = QString::fromStdString(r.a1111_parameters), timings = toJobTimings(r.timings)] {
      emit finished(images, meta, params, timings);
    });
  };
  o.on_error = [this, id](const std::string& message) {
    endJob(id, [this, m = QString::fromStdString(message)] { emit failed(m); });
  };
  o.on_cancelled = [this, id] { endJob(id, [this] { emit cancelled(); }); };
  try {
    m_job = m_engine->submit(request, std::move(o));
  } catch (const std::exception& e) {  // submit only queues; keep the promise of a signal anyway
    QMetaObject::invokeMethod(
        this, [this, id, m = QString::fromUtf8(e.what())] {
          if (!isCurrent(id)) return;
          m_running = false;
          emit failed(m);
        },
        Qt::QueuedConnection);
  }
  emit started(id);
  return id;
}

quint64 EngineBridge::startLanes(const job::GenerationRequest& request, const engine::LaneSet& lanes,
                                 const std::vector<int>& enabledGpus, const QString& saveDir) {
  if (m_job) m_job->cancel();
  const quint64 id = ++m_currentJob;
  m_running = true;
  // Each lane's callbacks run on that lane's thread: convert there, post, return.
  const auto post = [this, id](auto f) {
    QMetaObject::invokeMethod(
        this, [this, id, f = std::move(f)] {
          if (isCurrent(id)) f();
        },
        Qt::QueuedConnection);
  };
  engine::LaneGroupObserver o;
  o.on_lane_started = [post, this](int lane) { post([this, lane] { emit laneStarted(lane); }); };
  o.lane = [post, this](int lane) {
    job::JobObserver j;
    j.on_step = [post, this, lane](const job::StepEvent& e) {
      post([this, lane, e] { emit laneStep(lane, e.index, e.total, e.step_ms, e.cached); });
    };
    j.on_preview = [post, this, lane](const job::PreviewEvent& e) {
      post([this, lane, image = toQImage(e.image)] { emit lanePreview(lane, image); });
    };
    j.on_done = [post, this, lane](const job::GenerationResult& r) {
      QList<QImage> images;
      for (const auto& image : r.images) images.append(toQImage(image));
      post([this, lane, images, meta = QString::fromStdString(r.metadata_json),
            params = QString::fromStdString(r.a1111_parameters), timings = toJobTimings(r.timings)] {
        emit laneFinished(lane, images, meta, params, timings);
      });
    };
    j.on_error = [post, this, lane](const std::string& m) {
      post([this, lane, m = QString::fromStdString(m)] { emit laneFailed(lane, m); });
    };
    j.on_cancelled = [post, this, lane] { post([this, lane] { emit laneCancelled(lane); }); };
    return j;
  };
  engine::Engine::LaneGroupEnd end;
  const std::string dir = saveDir.toStdString();
  const auto finish = [this, id](QList<LaneRow> rows, bool cancelled, QString file, QString error) {
    endJob(id, [this, rows, cancelled, file, error] { emit lanesFinished(rows, cancelled, file, error); });
  };
  end.on_done = [finish, dir](const engine::LaneGroupResult& r) {
    QList<LaneRow> rows;
    for (std::size_t i = 0; i < r.lanes.size(); ++i) {
      const auto& o = r.lanes[i];
      LaneRow row;
      row.title = QString::fromStdString(engine::lane_title(r.set.lanes[i]));
      row.state = o.state == engine::LaneOutcome::State::Done     ? QStringLiteral("done")
                  : o.state == engine::LaneOutcome::State::Failed ? QStringLiteral("failed")
                                                                  : QStringLiteral("cancelled");
      row.error = QString::fromStdString(o.error);
      QStringList devices;
      for (const auto& d : r.plans[i].devices) devices << QString::fromStdString(d);
      row.devices = devices.join(QLatin1Char(','));
      if (o.state == engine::LaneOutcome::State::Done) row.timeMs = o.result.timings.total_ms - o.result.timings.load_ms;
      row.compared = o.compared;
      row.speedup = o.against_baseline.speedup;
      row.psnr = o.against_baseline.psnr;
      row.ssim = o.against_baseline.ssim;
      row.latentsRelL2 = o.against_baseline.latents_rel_l2;
      for (const auto& d : o.differences) row.differences << QString::fromStdString(d);
      rows << row;
    }
    QString file, error;
    const bool any = std::any_of(r.lanes.begin(), r.lanes.end(),
                                 [](const auto& o) { return o.state == engine::LaneOutcome::State::Done; });
    if (!dir.empty() && any) {
      try {
        file = QString::fromStdString(engine::save_lane_group(r, dir).string());
      } catch (const std::exception& e) {
        error = QString::fromUtf8(e.what());
      }
    }
    finish(rows, r.cancelled, file, error);
  };
  end.on_error = [this, id](const std::string& message) {
    endJob(id, [this, m = QString::fromStdString(message)] { emit failed(m); });
  };
  m_job = m_engine->submit_lanes(request, lanes, enabledGpus, std::move(o), std::move(end));
  emit started(id);
  return id;
}

void EngineBridge::cancel() {
  if (m_job) m_job->cancel();  // cancelled() follows from the worker (or on_done if it was already past the end)
}

}  // namespace diffract::ui
