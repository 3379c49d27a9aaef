#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/text/clip_tokenizer.h"  // TokenizedPrompt

namespace diffract::text {

// T5's SentencePiece unigram tokenizer as SD3 runs it (diffusers' _get_t5_prompt_embeds through
// transformers' T5Tokenizer / T5TokenizerFast): the text split at the special tokens (</s>,
// <pad>, <unk>, <extra_id_N>), each part encoded by SentencePiece (its own normalisation:
// NFKC, whitespace runs to one, a leading "▁"), then truncated to max_length - 1, </s>
// appended and padded with <pad> (id 0) to max_length. No BOS.
//
// SentencePiece is optional in the build (Debian libsentencepiece-dev); without it available()
// is false and from_folder / from_model_file throw an Error saying so.
class T5Tokenizer {
 public:
  static bool available();

  // A tokenizer folder (SD3's tokenizer_3): spiece.model, with extra_ids from
  // tokenizer_config.json when it says (default 100).
  static T5Tokenizer from_folder(const std::filesystem::path& dir);
  static T5Tokenizer from_model_file(const std::filesystem::path& spiece_model, int extra_ids = 100);

  T5Tokenizer(T5Tokenizer&&) noexcept;
  T5Tokenizer& operator=(T5Tokenizer&&) noexcept;
  ~T5Tokenizer();

  // Tokens + </s>, untruncated and unpadded.
  std::vector<int> encode(const std::string& text) const;
  // padding="max_length", truncation=True: exactly max_length ids (diffusers' SD3 default 256).
  TokenizedPrompt encode(const std::string& text, int max_length) const;

  int eos_id() const;
  int pad_id() const;
  int unk_id() const;
  int vocab_size() const;  // SentencePiece's pieces plus the extra ids

  struct Impl;

 private:
  explicit T5Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace diffract::text
