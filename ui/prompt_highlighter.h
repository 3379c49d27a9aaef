#pragma once
// The prompt editor's reading of A1111's syntax: runs weighted above 1 tinted warm, below 1 cool
// (deeper the further from 1), BREAK and <lora:...> tags marked; and the token count per 75-token
// chunk under the editor, from the model's CLIP tokenizer.
#include <QString>
#include <QSyntaxHighlighter>
#include <vector>

namespace diffract::text {
class CLIPTokenizer;
}

namespace diffract::ui {

class PromptHighlighter : public QSyntaxHighlighter {
  Q_OBJECT
 public:
  explicit PromptHighlighter(QTextDocument* document);
  // The weight the highlighter gives the character at `index` of the document (1 outside any
  // run; -1 for BREAK; -2 in a <lora:...> tag; 0 for brackets, weights, escapes): what its colour shows.
  double weightAt(int index) const;

 protected:
  void highlightBlock(const QString& text) override;

 private:
  void reparse();
  QString m_parsed;
  std::vector<double> m_weights;  // per QString index of the document
};

// "12 tokens" / "93 tokens in 2 chunks (75 + 18)" / the parse error, for `prompt` read by `tokenizer`.
QString promptTokenSummary(const text::CLIPTokenizer& tokenizer, const QString& prompt);

}  // namespace diffract::ui
