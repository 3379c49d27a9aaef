#pragma once
#include <memory>
#include <QStringList>
#include <QSize>
#include <QWidget>

#include <cstdint>
#include <optional>

#include "core/engine/png_parameters.h"
#include "core/engine/preset.h"
#include "core/job/request.h"

#include "core/parallel/registry.h"

class QCheckBox;
class QLabel;
class QComboBox;
class QDoubleSpinBox;
class QLineEdit;
class QPlainTextEdit;
class QSettings;
class QSpinBox;

namespace diffract::text {
class CLIPTokenizer;
}

namespace diffract::ui {

class PromptHighlighter;

// The generation settings form: prompt and negative prompt, the model (path, browse buttons, the
// Hugging Face cache's models) and its TAESD, size (with its presets), steps, CFG, Flux.1-dev's
// guidance and Flux's T5 placement (enabled for Flux models), seed, sampler, batch, preview size
// and the strategy row. It owns the widgets and keeps the rules inside the form (a size no preset
// has shows Custom; patches only for strategies that take them); the window reads and fills the
// widgets and reacts to their signals.
class SettingsPanel : public QWidget {
  Q_OBJECT
 public:
  explicit SettingsPanel(QWidget* parent = nullptr);

  QPlainTextEdit* prompt() const { return m_prompt; }
  // Under the prompt: its tokens per 75-token chunk (the model's CLIP tokenizer, else the
  // embedded model's), or what is wrong with its syntax.
  QLabel* promptTokens() const { return m_promptTokens; }
  QPlainTextEdit* negative() const { return m_negative; }
  QLineEdit* model() const { return m_model; }
  QComboBox* discovered() const { return m_discovered; }
  QLineEdit* taesd() const { return m_taesd; }
  QSpinBox* widthSpin() const { return m_width; }
  QSpinBox* heightSpin() const { return m_height; }
  QSpinBox* steps() const { return m_steps; }
  QDoubleSpinBox* cfg() const { return m_cfg; }
  // Flux.1-dev's distilled guidance; enabled while the model is a Flux one.
  QDoubleSpinBox* guidance() const { return m_guidance; }
  // Flux's T5 placement (job::GenerationRequest::t5_placement); enabled with the guidance.
  QComboBox* t5Placement() const { return m_t5; }
  QComboBox* precision() const { return m_precision; }
  QLabel* sizeWarning() const { return m_sizeWarning; }
  // The GPU the job will run on and its free memory, for the size warning's estimate; an empty
  // name: the CPU (this machine's memory).
  void setJobDevice(const QString& gpuName, std::uint64_t freeBytes);
  QLineEdit* seed() const { return m_seed; }
  QCheckBox* randomSeed() const { return m_randomSeed; }
  QComboBox* sampler() const { return m_sampler; }
  QSpinBox* batch() const { return m_batch; }
  QComboBox* previewSize() const { return m_previewSize; }
  QComboBox* strategy() const { return m_strategy; }
  // Shows a strategy's speed-up measured by the last job that ran it (sequential model work or
  // rounds against the plain loop's steps) beside its name in the list and in its tooltip; 0
  // shows its name alone again.
  void noteStrategySpeedup(const QString& strategy, double speedup);
  QSpinBox* devices() const { return m_devices; }
  QSpinBox* patches() const { return m_patches; }
  QDoubleSpinBox* cacheThreshold() const { return m_cacheThreshold; }  // shown for the step caches
  const parallel::StrategyInfo& strategyInfo() const;  // the registry entry chosen
  // The request the fields make: the prompt as typed (the window fills a preset's template with
  // it), the strategy without its devices (the window's device choice gives them).
  job::GenerationRequest request() const;
  // The seed field as a number; std::nullopt when it is empty or past 64 bits.
  std::optional<std::uint64_t> seedValue() const;

  // The fields to and from the settings, but the TAESD: whether the window matched it to the
  // model is the window's, and it must be read before the model.
  void loadSettings(const QSettings& s);
  void saveSettings(QSettings& s) const;

  // The preset's settings (not its template: the window wraps the prompt in it).
  void applyPreset(const engine::Preset& p);
  // The size fields to `canvas`'s aspect at about the pixels they ask for now (a megapixel when
  // they say "model"), never above the canvas, in multiples of 64: a large photo is not run at its
  // own size.
  void fitSizeTo(const QSize& canvas);
  // A restored PNG's parameters, in two parts so that the window's device comes between them in
  // the report: the prompts, size, steps, CFG, seed, sampler, batch, model and TAESD; then the
  // strategy and its devices or skip factor. Each names what it set in `restored` and what it
  // could not in `notRestored`.
  void restoreFields(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored);
  void restoreStrategy(const engine::PngParameters& p, QStringList& restored, QStringList& notRestored);

 private:
  void applySizePreset(int index);
  void updatePromptTokens();
  void modelChanged();
  void updateGuidanceField(bool flux);
  // The size warning under the size fields: shown for sizes far beyond the model's native one.
  void updateSizeWarning();
  // The threshold field to `value`, or (negative) to the chosen strategy's default.
  void setCacheThreshold(double value);

  QPlainTextEdit* m_prompt = nullptr;
  QPlainTextEdit* m_negative = nullptr;
  QLabel* m_promptTokens = nullptr;
  PromptHighlighter* m_highlighter = nullptr;
  PromptHighlighter* m_negativeHighlighter = nullptr;
  std::shared_ptr<text::CLIPTokenizer> m_tokenizer;
  QString m_tokenizerDir;  // where m_tokenizer came from
  QLineEdit* m_model = nullptr;
  QComboBox* m_discovered = nullptr;
  QLineEdit* m_taesd = nullptr;
  QComboBox* m_sizePreset = nullptr;
  QLabel* m_sizeWarning = nullptr;
  int m_nativeSize = 0;  // the model's native side (engine::guess_native_size); 0: unknown
  std::uint64_t m_weightBytes = 0;  // engine::model_weight_bytes of m_weightBytesOf
  QString m_weightBytesOf;
  QString m_gpuName;                 // the job's GPU; empty: the CPU
  std::uint64_t m_gpuFreeBytes = 0;
  QSpinBox* m_width = nullptr;
  QSpinBox* m_height = nullptr;
  QSpinBox* m_steps = nullptr;
  QDoubleSpinBox* m_cfg = nullptr;
  QDoubleSpinBox* m_guidance = nullptr;
  QComboBox* m_t5 = nullptr;
  QComboBox* m_precision = nullptr;
  QLineEdit* m_seed = nullptr;
  QCheckBox* m_randomSeed = nullptr;
  QComboBox* m_sampler = nullptr;
  QSpinBox* m_batch = nullptr;
  QComboBox* m_previewSize = nullptr;  // the previews' largest side (GenerationRequest::preview_max_side; 0: full size)
  QComboBox* m_strategy = nullptr;
  QSpinBox* m_devices = nullptr;
  QSpinBox* m_patches = nullptr;
  QDoubleSpinBox* m_cacheThreshold = nullptr;
  // The strategy default the threshold field holds (-1: none yet; NaN: a value of the user's):
  // switching to another step cache gives that one's default unless the user set the value.
  double m_thresholdDefault = -1;
  QDoubleSpinBox* m_hiresScale = nullptr;
  QDoubleSpinBox* m_hiresStrength = nullptr;
  QComboBox* m_hiresUpscaler = nullptr;  // pipefusion / cfg-pipefusion: latent row patches (0: one per stage)
};

}  // namespace diffract::ui
