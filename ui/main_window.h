#pragma once
#include <QElapsedTimer>
#include <QImage>
#include <QList>
#include <QMainWindow>

#include "ui/engine_bridge.h"

class QCheckBox;
class QComboBox;
class QDoubleSpinBox;
class QLabel;
class QLineEdit;
class QPlainTextEdit;
class QPushButton;
class QSpinBox;
class QSplitter;

namespace diffract::ui {

class ImageView;
class TimingsChart;

// One finished image with what made it, kept for the session (the gallery builds on this).
struct RenderedImage {
  QImage image;
  QString parameters;    // A1111 "parameters" text
  QString metadataJson;  // the "diffract" chunk
  JobTimings timings;
  QString savedPath;     // empty when saving failed
};

// The application window: prompt and settings on the left, the live view with its status line
// and stage timings on the right. Jobs run through one EngineBridge; nothing here waits on them.
class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(QWidget* parent = nullptr);
  ~MainWindow() override;

  EngineBridge* bridge() const { return m_bridge; }
  const QList<RenderedImage>& results() const { return m_results; }
  // Where final images go: $DIFFRACT_OUTPUT_DIR, else Pictures/Diffract.
  static QString outputDir();
  // Diffusers models in the Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub).
  static QStringList discoverHuggingFaceModels();
  engine::GenerationRequest requestFromFields();

 public slots:
  void generate();
  void cancel();

 protected:
  void closeEvent(QCloseEvent* event) override;

 private:
  void buildUi();
  void loadSettings();
  void saveSettings() const;
  void updateControls();
  void showError(const QString& message);
  void applySizePreset(int index);
  void onStep(int index, int total, double timestep, double ms);
  void onFinished(const QList<QImage>& images, const QString& metadataJson, const QString& parameters,
                  const JobTimings& timings);

  EngineBridge* m_bridge = nullptr;
  QPlainTextEdit* m_prompt = nullptr;
  QPlainTextEdit* m_negative = nullptr;
  QLineEdit* m_model = nullptr;
  QComboBox* m_discovered = nullptr;
  QLineEdit* m_taesd = nullptr;
  QComboBox* m_sizePreset = nullptr;
  QSpinBox* m_width = nullptr;
  QSpinBox* m_height = nullptr;
  QSpinBox* m_steps = nullptr;
  QDoubleSpinBox* m_cfg = nullptr;
  QSpinBox* m_seed = nullptr;
  QCheckBox* m_randomSeed = nullptr;
  QComboBox* m_sampler = nullptr;
  QSpinBox* m_batch = nullptr;
  QComboBox* m_device = nullptr;
  QPushButton* m_generate = nullptr;
  QPushButton* m_cancel = nullptr;
  QLabel* m_hint = nullptr;
  QLabel* m_error = nullptr;
  QLabel* m_status = nullptr;
  ImageView* m_view = nullptr;
  TimingsChart* m_timings = nullptr;
  QSplitter* m_mainSplitter = nullptr;
  QSplitter* m_viewSplitter = nullptr;

  QList<RenderedImage> m_results;
  QElapsedTimer m_jobClock;
  int m_stepsSeen = 0;
  double m_stepMsSum = 0;
};

}  // namespace diffract::ui
