#pragma once
#include <QElapsedTimer>
#include <QImage>
#include <QList>
#include <QString>
#include <QStringList>
#include <QWidget>

#include "ui/engine_bridge.h"

class QGridLayout;
class QLabel;
class QPushButton;

namespace diffract::ui {

class ImageView;
class TimingsChart;

// The live view of a lane group: one tile per lane with its title, preview every step (its final
// render once decoded), step counter, it/s and ETA, its per-step timing bars, and once the group
// has ended its speed-up, PSNR and SSIM against the baseline lane.
class LaneGrid : public QWidget {
  Q_OBJECT
 public:
  explicit LaneGrid(QWidget* parent = nullptr);

  // A new group: `titles` in lane order, `steps` each lane's step count, `waiting` a line per
  // lane ("waits for lane 1") or empty.
  void reset(const QStringList& titles, const QList<int>& steps, const QStringList& waiting, int baseline);
  int laneCount() const { return static_cast<int>(m_tiles.size()); }

  void setStarted(int lane);
  void setStep(int lane, int index, int total, double ms, bool cached);
  void setPreview(int lane, const QImage& image);
  void setFinished(int lane, const QImage& image, const JobTimings& timings);
  void setFailed(int lane, const QString& message);
  void setCancelled(int lane);
  void setRows(const QList<LaneRow>& rows);  // the group's end

  // For tests and the window: a lane's status line, its view, its chart.
  QString statusText(int lane) const;
  QString resultText(int lane) const;
  ImageView* view(int lane) const;
  TimingsChart* chart(int lane) const;
  int stepsSeen(int lane) const;

 signals:
  void compareRequested(int lane);  // "Compare" on a lane's tile: it against the baseline

 private:
  struct Tile {
    QWidget* box = nullptr;
    QLabel* title = nullptr;
    ImageView* view = nullptr;
    QLabel* status = nullptr;
    QLabel* result = nullptr;
    TimingsChart* chart = nullptr;
    QPushButton* compare = nullptr;
    QElapsedTimer clock;
    int steps = 0;
    double stepMsSum = 0;
  };
  QGridLayout* m_grid = nullptr;
  QList<Tile> m_tiles;
  int m_baseline = 0;
};

}  // namespace diffract::ui
