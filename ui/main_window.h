#pragma once
#include <QElapsedTimer>
#include <QTimer>
#include <QImage>
#include <QList>
#include <QSet>
#include <QMainWindow>

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "core/engine/devices.h"
#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/parallel/registry.h"
#include "ui/compare_view.h"
#include "ui/controlnet_panel.h"
#include "ui/engine_bridge.h"
#include "ui/job_queue.h"
#include "ui/variation_grid.h"

class QComboBox;
class QDragEnterEvent;
class QDragMoveEvent;
class QDropEvent;
class QLabel;
class QLineEdit;
class QPlainTextEdit;
class QPushButton;
class QSettings;
class QSpinBox;
class QSplitter;
class QScrollArea;
class QTabWidget;

namespace diffract::ui {

class DevicesPanel;
class JobQueuePanel;
class LaneGrid;
class LanesPanel;
class InputPanel;
class LoraPanel;
class MaskEditor;
class MaskEditorPane;
class PresetBar;
class SettingsPanel;
class GalleryView;
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
  // The newest madebyollin TAESD snapshot in that cache for a model's family (a diffusers folder's
  // pipeline or a single file's tensor names: taesd, taesdxl, taesd3, taef1); empty when there is none.
  static QString matchingTaesd(const QString& modelDir);
  // The job the form describes, without its ControlNets (generate() adds them: making their
  // control images is the job's work).
  job::GenerationRequest requestFromFields();
  // The seed field as a number; std::nullopt when it is empty or past 64 bits.
  std::optional<std::uint64_t> seedValue() const;

  // Shipped presets (compiled-in resources) then the user's (userPresetDir()), as in the combo.
  const std::vector<engine::Preset>& presets() const;
  static QString userPresetDir();
  // Writes the fields as a user preset called `name` and selects it; returns the error, or "".
  QString savePreset(const QString& name);
  // Reads `png`'s generation parameters off the GUI thread, then fills the fields
  // (restoreFinished reports the outcome; failures show in the window).
  void restoreFromPng(const QString& png);
  GalleryView* gallery() const { return m_gallery; }
  InputPanel* inputPanel() const { return m_inputPanel; }
  LoraPanel* loraPanel() const { return m_loraPanel; }
  ControlNetPanel* controlNetPanel() const { return m_controlNetPanel; }
  LanesPanel* lanesPanel() const { return m_lanesPanel; }
  JobQueuePanel* queuePanel() const { return m_queuePanel; }
  LaneGrid* laneGrid() const { return m_laneGrid; }
  // Session results (indexes into results()) of the last lane group, per lane; -1 where a lane
  // made no image.
  const QList<int>& laneResults() const { return m_laneResults; }
  // Opens the compare window on the last lane group's baseline lane against `lane`.
  CompareView* compareLane(int lane);
  // A saved lane group (the gallery's lanes entry): the compare window on its baseline against
  // its first other finished lane, every finished lane in the menus; nullptr with the error shown.
  CompareView* openSavedLanes(const QString& lanesJson);
  MaskEditor* maskEditor() const;
  // Writes session result `index` (an index into results()) to `path` as the output folder would
  // (PNG, its parameters and metadata): the way out when the automatic save failed (a full
  // disk, a missing folder). Empty on success, else why not.
  QString saveResultAs(int index, const QString& path);
  // Opens the compare window on session results a and b (indexes into results()).
  CompareView* compareResults(int a, int b);
  // Reads two PNGs off the GUI thread, then opens the compare window on them.
  void compareFiles(const QString& a, const QString& b);

  // The GPUs the devices panel shows (tests give their own; DevicesPanel::refresh lists the real ones).
  void setDevices(const std::vector<engine::DeviceInfo>& devices);
  std::vector<int> enabledGpus() const;
  // The device(s) the enabled GPUs and the strategy give a job, or why they cannot run.
  engine::DeviceChoice deviceChoice() const;
  const parallel::StrategyInfo& currentStrategy() const;  // the registry entry chosen

 signals:
  void restoreFinished(bool ok);
  void compareOpened(diffract::ui::CompareView* view);

 public slots:
  void generate();
  void cancel();

 protected:
  void closeEvent(QCloseEvent* event) override;
  bool eventFilter(QObject* watched, QEvent* event) override;
  void dragEnterEvent(QDragEnterEvent* event) override;
  void dragMoveEvent(QDragMoveEvent* event) override;
  void dropEvent(QDropEvent* event) override;

 private:
  void buildUi();
  void loadSettings();
  void saveSettings();
  void writeSettings(QSettings& s) const;
  void updateControls();
  void updateDeviceSummary();
  // After the model, size, batch, CFG, previews or devices change (and at start): on a GPU the
  // engine loads and prepares that job in the background once the fields rest for a moment,
  // so that Generate starts at full speed.
  void schedulePrepare();
  void matchTaesdToModel();
  void showError(const QString& message);
  void reloadPresets(const QString& select = QString());
  // The settings a preset sets, as the form holds them now, and the check that marks the active
  // preset changed when they differ from what they were right after it was applied.
  QString presetFingerprint();
  void notePresetChange();
  void applyRestored(const engine::PngParameters& p, const QString& file);
  void onStep(int index, int total, double timestep, double ms, bool cached);
  // The job the form describes, checked, control images made; nothing (an error shown) when it cannot run.
  std::optional<QueuedJob> jobFromFields();
  void startJob(QueuedJob job);
  void startNextQueued();
  void queueVariations(int count);
  // "Queue grid": the form's job for every pair of the axes' values, queued as one grid.
  void queueGrid(const QString& xParameter, const QString& xValues, const QString& yParameter, const QString& yValues);
  // The running job's grid cell ended (its image, or a null one when it did not finish).
  void endGridCell(int grid, int cell, const QImage& image, const QString& savedFile);
  // Every cell ended: the labelled grid in the view, saved as grid-<stamp>.png (+ .json: the axes).
  void finishGrid(int grid);
  void generateLanes(const job::GenerationRequest& request, const engine::LaneSet& lanes);
  void onLanesFinished(const QList<LaneRow>& rows, bool cancelled, const QString& savedFile, const QString& saveError);
  void updateLanePlan();
  void onFinished(const QList<QImage>& images, const QString& metadataJson, const QString& parameters,
                  const JobTimings& timings);

  EngineBridge* m_bridge = nullptr;
  QTimer* m_prepareTimer = nullptr;
  QPlainTextEdit* m_prompt = nullptr;
  QLineEdit* m_model = nullptr;
  QLineEdit* m_taesd = nullptr;
  QLineEdit* m_seed = nullptr;
  QComboBox* m_strategy = nullptr;
  QSpinBox* m_devices = nullptr;
  DevicesPanel* m_devicesPanel = nullptr;
  SettingsPanel* m_settings = nullptr;  // owns the form's widgets (m_prompt to m_devices point into it)
  QString m_presetFingerprint;  // presetFingerprint() when the active preset was applied ("" unknown)
  bool m_taesdMatched = false;  // m_taesd holds matchingTaesd()'s pick, not the user's
  PresetBar* m_presetBar = nullptr;
  QLabel* m_restored = nullptr;
  QPushButton* m_compare = nullptr;
  QPushButton* m_saveAs = nullptr;
  GalleryView* m_gallery = nullptr;
  QPushButton* m_generate = nullptr;
  QPushButton* m_cancel = nullptr;
  QLabel* m_hint = nullptr;
  QLabel* m_error = nullptr;
  QLabel* m_settingsWarning = nullptr;  // the settings file could not be written
  QLabel* m_status = nullptr;
  QLabel* m_strategyResult = nullptr;  // the last job's strategy in plain words (hidden for the plain loop)
  QSet<QString> m_startedModels;  // model + device of the jobs started: their next jobs load nothing
  ImageView* m_view = nullptr;
  TimingsChart* m_timings = nullptr;
  InputPanel* m_inputPanel = nullptr;
  LoraPanel* m_loraPanel = nullptr;
  ControlNetPanel* m_controlNetPanel = nullptr;
  MaskEditorPane* m_maskPane = nullptr;
  QTabWidget* m_viewTabs = nullptr;
  job::GenerationRequest m_jobRequest;  // the running (or last) job, for saving its inputs
  std::vector<ControlNetPanel::Unit> m_jobControlUnits;  // how its control images were made
  QSplitter* m_mainSplitter = nullptr;
  QSplitter* m_viewSplitter = nullptr;

  LanesPanel* m_lanesPanel = nullptr;
  JobQueuePanel* m_queuePanel = nullptr;
  LaneGrid* m_laneGrid = nullptr;
  QScrollArea* m_laneScroll = nullptr;  // the Lanes tab: m_laneGrid, scrolled
  engine::LaneSet m_jobLanes;  // the running (or last) lane group
  QList<RenderedImage> m_laneImages;  // its lanes' first images as they finish (null: none yet)
  QList<int> m_laneResults;
  QString m_laneDir;

  QList<RenderedImage> m_results;
  std::map<int, GridRun> m_grids;  // the variation grids whose jobs have not all ended, by id
  int m_nextGrid = 1;
  int m_jobGrid = 0, m_jobGridCell = -1;  // the running job's grid cell (0: none)
  QElapsedTimer m_jobClock;
  int m_stepsSeen = 0;
  double m_stepMsSum = 0;
};

}  // namespace diffract::ui
