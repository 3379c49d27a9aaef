#pragma once
// A variation grid while its jobs run and once they have (the queue's "Queue grid"; the axes and
// jobs from core/engine/variation_grid.h): each cell's image as its job ends, then one labelled
// image of them all, the x axis's values above the columns and the y axis's left of the rows.
#include <QImage>
#include <QList>
#include <QString>
#include <QStringList>
#include <QVector>

#include <optional>
#include <vector>

#include "core/engine/variation_grid.h"

namespace diffract::ui {

// A batch's images in one picture for the view: ceil(sqrt(N)) columns, each image at the first's
// size with its number (#1, #2, ...) in the corner, as they are saved (index 0 first).
QImage tileBatch(const QList<QImage>& images);

class GridRun {
 public:
  GridRun() = default;
  GridRun(engine::GridAxis x, std::optional<engine::GridAxis> y, std::vector<engine::GridCell> cells);

  const engine::GridAxis& x() const { return m_x; }
  const std::optional<engine::GridAxis>& y() const { return m_y; }
  const std::vector<engine::GridCell>& cells() const { return m_cells; }
  int columns() const { return static_cast<int>(m_x.values.size()); }
  int rows() const { return m_y ? static_cast<int>(m_y->values.size()) : 1; }

  // Cell `index` ended: its first image and saved file, or a null image when it failed or was
  // cancelled (drawn grey, marked).
  void setCell(int index, const QImage& image, const QString& savedFile = {});
  int done() const { return m_done; }
  bool complete() const { return m_done == static_cast<int>(m_cells.size()); }
  const QStringList& files() const { return m_files; }

  // The labelled grid: every cell at the first image's size (others scaled to it), a label band
  // above (x values) and, with a y axis, one on the left; on white.
  QImage compose() const;
  // grid_json() of the axes, the cells and their files (names only).
  std::string json() const;

 private:
  engine::GridAxis m_x;
  std::optional<engine::GridAxis> m_y;
  std::vector<engine::GridCell> m_cells;
  QVector<QImage> m_images;
  QStringList m_files;
  QVector<bool> m_ended;
  int m_done = 0;
};

}  // namespace diffract::ui
