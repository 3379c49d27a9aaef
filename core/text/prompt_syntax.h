#pragma once
// A1111's prompt syntax: attention weights, BREAK, prompts longer than one CLIP window, and the
// extra-network tags (<lora:NAME:WEIGHT>) that A1111 takes out of the prompt before encoding it.
#include <cstddef>
#include <string>
#include <vector>

namespace diffract::text {

class CLIPTokenizer;

// A run of prompt text and its attention weight; a BREAK is a run of its own (is_break()).
struct WeightedText {
  std::string text;
  double weight = 1.0;
  bool is_break() const { return weight == -1 && text == "BREAK"; }
};

// A1111's parse_prompt_attention: "(a)" multiplies a's weight by 1.1, "((a))" by 1.21,
// "(a:1.3)" by 1.3, "[a]" divides by 1.1; "\(", "\)", "\[", "\]", "\\" are the literal
// characters; unclosed brackets reach to the end; "BREAK" (a word of its own, in capitals)
// starts a new chunk; neighbouring runs of equal weight are merged. A weight that does not
// read as a number ("(a:1.2.3)") is an error naming it.
std::vector<WeightedText> parse_prompt_attention(const std::string& prompt);

// Where each run of text sits in the prompt (byte offsets) and its weight, before merging: for
// an editor that colours the weights. Brackets, weights and escapes' backslashes are in no span;
// BREAK has weight -1. A weight that is not a number is an error as above.
struct WeightedSpan {
  std::size_t begin = 0, end = 0;
  double weight = 1.0;
};
std::vector<WeightedSpan> attention_spans(const std::string& prompt);

// The prompt's text without the syntax (escapes resolved, weights dropped, BREAK as a space):
// what an encoder without weights (T5) reads.
std::string plain_text(const std::vector<WeightedText>& parsed);

// One CLIP window: bos, 75 tokens (eos-padded), eos; each token's weight (1 for bos, eos and padding).
struct PromptChunk {
  std::vector<int> ids;
  std::vector<float> weights;
  bool weighted() const;  // some weight is not 1
};

struct ChunkedPrompt {
  std::vector<PromptChunk> chunks;  // at least one
  int token_count = 0;              // the prompt's tokens, as A1111 counts them (75 per full chunk)
};

// A1111's tokenize_line: each run tokenized on its own, 75 tokens a chunk; a chunk that fills
// up within `comma_backtrack` tokens after a comma moves the words after the comma to the next
// chunk (A1111's "comma padding backtrack", 20 by default; 0: off); BREAK pads the chunk out.
// With a pad id that is not the eos id (OpenCLIP's "!"), every position after the first eos
// takes the pad id, as A1111 does.
ChunkedPrompt chunk_prompt(const CLIPTokenizer& tokenizer, const std::vector<WeightedText>& parsed,
                           int comma_backtrack = 20);

// A1111's extra-network tags, taken out of the prompt: "<lora:NAME>", "<lora:NAME:W>" (W on the
// text encoders and the denoiser), "<lora:NAME:TE:UNET>" (A1111's order: text encoders first);
// "<lyco:...>" reads as lora.
struct ExtraNetworkTag {
  std::string kind;  // "lora"
  std::string name;
  double weight = 1.0;               // the denoiser's
  double text_encoder_weight = 1.0;  // the text encoders'
  std::string text;                  // the tag as written
};
struct ExtractedPrompt {
  std::string prompt;  // without the tags
  std::vector<ExtraNetworkTag> tags;
};
// Tags of other kinds (<hypernet:...>) are an error naming them; a weight that is not a number too.
ExtractedPrompt extract_extra_networks(const std::string& prompt);

}  // namespace diffract::text
