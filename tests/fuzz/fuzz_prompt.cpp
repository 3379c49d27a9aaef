// A prompt in A1111's syntax: attention brackets, escapes, BREAK, <lora:...> tags, then CLIP
// tokenizing and 75-token chunking with the real vocabulary (DIFFRACT_CLIP_BPE).
#include <cstdlib>
#include <memory>

#include "core/text/clip_tokenizer.h"
#include "core/text/prompt_syntax.h"
#include "core/util/error.h"

namespace {

const diffract::text::CLIPTokenizer& tokenizer() {
  static const auto tok = std::make_unique<diffract::text::CLIPTokenizer>(
      diffract::text::CLIPTokenizer::from_openai_bpe(std::getenv("DIFFRACT_CLIP_BPE")));
  return *tok;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (!std::getenv("DIFFRACT_CLIP_BPE")) std::abort();  // scripts/fuzz.sh sets it
  tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string prompt(reinterpret_cast<const char*>(data), size);
  try {
    const auto extracted = diffract::text::extract_extra_networks(prompt);
    const auto parsed = diffract::text::parse_prompt_attention(extracted.prompt);
    diffract::text::attention_spans(prompt);
    diffract::text::plain_text(parsed);
    diffract::text::chunk_prompt(tokenizer(), parsed);
    tokenizer().tokenize(prompt);
  } catch (const diffract::Error&) {
  }
  return 0;
}
