#pragma once
// Helpers for the suites that drive the main window: its named widgets, a small job on the tiny
// model, and the GUI thread's longest stall while jobs run.
#include <QCheckBox>
#include <QElapsedTimer>
#include <QLineEdit>
#include <QObject>
#include <QPlainTextEdit>
#include <QSpinBox>
#include <QTimer>

#include <algorithm>
#include <functional>

#include "test_util.h"
#include "ui/main_window.h"

namespace diffract::test {

template <typename T>
T* child(const QWidget& w, const char* name) {
  auto* c = w.findChild<T*>(QString::fromLatin1(name));
  if (!c) qFatal("no child %s", name);
  return c;
}

inline QString tinyModel() { return QString::fromStdString((fixtures() / "tiny-sd").string()); }

// Fills the fields for a small, fast job on the tiny model (64², fixed seed).
inline void setUpJob(diffract::ui::MainWindow& w, int steps, const QString& model = tinyModel(),
                     const QString& seed = QStringLiteral("5")) {
  child<QLineEdit>(w, "modelEdit")->setText(model);
  child<QSpinBox>(w, "widthSpin")->setValue(64);
  child<QSpinBox>(w, "heightSpin")->setValue(64);
  child<QSpinBox>(w, "stepsSpin")->setValue(steps);
  child<QCheckBox>(w, "randomSeedCheck")->setChecked(false);
  child<QLineEdit>(w, "seedEdit")->setText(seed);
}

// The longest gap between 10 ms timer ticks on the GUI thread while `measuring()` holds.
class StallMeter : public QObject {
 public:
  explicit StallMeter(std::function<bool()> measuring) : m_measuring(std::move(measuring)) {
    m_timer.setInterval(10);
    m_timer.setTimerType(Qt::PreciseTimer);
    connect(&m_timer, &QTimer::timeout, this, [this] {
      const qint64 now = m_clock.elapsed();
      if (m_ticks > 0 && m_measuring()) m_maxGap = std::max(m_maxGap, now - m_last);
      m_last = now;
      ++m_ticks;
    });
  }
  void start() {
    m_clock.start();
    m_timer.start();
  }
  void stop() { m_timer.stop(); }
  qint64 maxGap() const { return m_maxGap; }
  qint64 ticks() const { return m_ticks; }

 private:
  std::function<bool()> m_measuring;
  QTimer m_timer;
  QElapsedTimer m_clock;
  qint64 m_last = 0, m_maxGap = 0, m_ticks = 0;
};

}  // namespace diffract::test
