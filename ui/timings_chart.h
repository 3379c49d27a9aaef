#pragma once
// Live stage timings: one bar per denoising step, filling in as steps finish, over text rows
// for text encode, preview decode, VAE decode and total.
#include <QString>
#include <QVector>
#include <QWidget>

#include "ui/engine_bridge.h"

namespace diffract::ui {

// "12.3 s", "2 min 5 s": a duration as the status lines show it.
QString formatSeconds(double s);

class TimingsChart : public QWidget {
  Q_OBJECT
 public:
  explicit TimingsChart(QWidget* parent = nullptr);

  void reset(int totalSteps);                  // a new job: empty bars, no stage times
  // `cached`: a step cache reused most of the model (drawn in the palette's mid tone, counted).
  void setStep(int index, int total, double ms, bool cached = false);
  void setStage(const QString& stage, double ms);  // core stage names: text_encode, vae_decode, total, ...
  void addPreviewDecode(double ms);
  void setTimings(const JobTimings& timings);  // a finished job's (or a kept image's) timings

  int barCount() const;                        // steps with a time so far
  int totalSteps() const { return m_steps.size(); }
  const QVector<double>& stepMs() const { return m_steps; }
  int cachedCount() const { return static_cast<int>(m_cached.count(true)); }
  QStringList rows() const;                    // the text rows as shown

  QSize sizeHint() const override { return {320, 180}; }
  QSize minimumSizeHint() const override { return {160, 120}; }

 protected:
  void paintEvent(QPaintEvent* event) override;

 private:
  QVector<double> m_steps;  // < 0: not run yet
  QVector<bool> m_cached;   // per step: reused cached blocks
  double m_textEncodeMs = -1;
  double m_previewMs = 0;
  int m_previews = 0;
  double m_vaeDecodeMs = -1;
  double m_totalMs = -1;
  double m_loadMs = -1;
};

}  // namespace diffract::ui
