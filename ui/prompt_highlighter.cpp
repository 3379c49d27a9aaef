#include "ui/prompt_highlighter.h"

#include <QColor>
#include <QTextCharFormat>
#include <QTextDocument>
#include <algorithm>
#include <cmath>

#include "core/text/clip_tokenizer.h"
#include "core/text/prompt_syntax.h"

namespace diffract::ui {

namespace {
// QString index of each UTF-8 byte of `utf8` (the text's own UTF-16 positions).
std::vector<int> byte_to_index(const QString& text) {
  std::vector<int> map;
  for (int i = 0; i < text.size(); ++i) {
    const bool pair = text[i].isHighSurrogate() && i + 1 < text.size();
    const auto bytes = QString(text.mid(i, pair ? 2 : 1)).toUtf8().size();
    for (int b = 0; b < bytes; ++b) map.push_back(i);
    if (pair) ++i;
  }
  return map;
}
}  // namespace

PromptHighlighter::PromptHighlighter(QTextDocument* document) : QSyntaxHighlighter(document) {}

void PromptHighlighter::reparse() {
  const QString text = document()->toPlainText();
  if (text == m_parsed && !m_weights.empty()) return;
  m_parsed = text;
  m_weights.assign(static_cast<std::size_t>(text.size()), 0.0);
  const std::string utf8 = text.toStdString();
  const auto index = byte_to_index(text);
  const auto mark = [&](std::size_t begin, std::size_t end, double w) {
    for (auto b = begin; b < end && b < index.size(); ++b) m_weights[static_cast<std::size_t>(index[b])] = w;
  };
  try {
    for (const auto& s : text::attention_spans(utf8)) mark(s.begin, s.end, s.weight);
  } catch (const std::exception&) {
    std::fill(m_weights.begin(), m_weights.end(), 1.0);  // the job says what is wrong
  }
  // <lora:...> tags: -2.
  for (std::size_t at = utf8.find("<lora:"); at != std::string::npos; at = utf8.find("<lora:", at + 1)) {
    const auto close = utf8.find('>', at);
    if (close == std::string::npos) break;
    mark(at, close + 1, -2.0);
  }
}

double PromptHighlighter::weightAt(int index) const {
  const_cast<PromptHighlighter*>(this)->reparse();
  return index >= 0 && static_cast<std::size_t>(index) < m_weights.size() ? m_weights[static_cast<std::size_t>(index)] : 1.0;
}

void PromptHighlighter::highlightBlock(const QString& text) {
  reparse();
  const int offset = currentBlock().position();
  for (int i = 0; i < text.size(); ++i) {
    const double w = weightAt(offset + i);
    QTextCharFormat f;
    if (w == -1) {
      f.setFontWeight(QFont::Bold);
      f.setForeground(QColor(128, 64, 160));
    } else if (w == -2) {
      f.setForeground(QColor(30, 120, 60));  // a LoRA tag
    } else if (w == 0) {
      f.setForeground(QColor(120, 120, 120));  // brackets, weights, escapes
    } else if (w != 1) {
      const double t = std::clamp(std::abs(std::log(std::abs(w))) / std::log(2.0), 0.15, 1.0);
      const QColor tint = w > 1 ? QColor(255, 140, 0) : QColor(60, 120, 255);
      QColor bg = tint;
      bg.setAlphaF(static_cast<float>(0.15 + 0.45 * t));
      f.setBackground(bg);
    } else {
      continue;
    }
    setFormat(i, 1, f);
  }
}

QString promptTokenSummary(const text::CLIPTokenizer& tokenizer, const QString& prompt) {
  try {
    const auto extracted = text::extract_extra_networks(prompt.toStdString());
    const auto chunked = text::chunk_prompt(tokenizer, text::parse_prompt_attention(extracted.prompt));
    QStringList sizes;
    int total = 0;
    for (const auto& c : chunked.chunks) {
      int n = 0;
      const auto eos = std::find(c.ids.begin() + 1, c.ids.end(), tokenizer.eos_id());
      n = static_cast<int>(eos - c.ids.begin()) - 1;
      sizes << QString::number(n);
      total += n;
    }
    QString s = chunked.chunks.size() == 1
                    ? QObject::tr("%1 / 75 tokens").arg(total)
                    : QObject::tr("%1 tokens in %2 chunks (%3)").arg(total).arg(chunked.chunks.size()).arg(sizes.join(QStringLiteral(" + ")));
    if (!extracted.tags.empty()) s += QObject::tr(", %n LoRA tag(s)", nullptr, static_cast<int>(extracted.tags.size()));
    return s;
  } catch (const std::exception& e) {
    return QString::fromUtf8(e.what());
  }
}

}  // namespace diffract::ui
