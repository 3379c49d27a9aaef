#pragma once
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

namespace diffract::text {

// Token ids of one prompt, laid out for a CLIP text encoder.
struct TokenizedPrompt {
  std::vector<int> ids;             // bos, tokens, eos, then pad to max_length
  std::vector<int> attention_mask;  // 1 for bos..eos, 0 for padding
  int length = 0;                   // bos..eos count after truncation
  int dropped = 0;                  // tokens cut off by truncation (0 when the prompt fits)
};

// An added (special) token as tokenizers treats it: matched in the raw text, or in the
// normalized text when `normalized`, before the BPE sees the rest.
struct SpecialToken {
  std::string content;
  int id = 0;
  bool normalized = false;
};

struct CLIPTokenizerOptions {
  std::string bos_token = "<|startoftext|>";
  std::string eos_token = "<|endoftext|>";
  std::string pad_token = "<|endoftext|>";  // SDXL's second tokenizer pads with "!"
  std::string unk_token = "<|endoftext|>";
  int max_length = 77;
};

// CLIP's byte-level BPE, matching transformers' CLIPTokenizer: NFC, whitespace runs to one
// space, lowercase, split into letter runs / single digits / other runs / contractions,
// byte-to-unicode, BPE with "</w>" word ends. Without ICU in the build only ASCII prompts are
// accepted (an error says so otherwise).
class CLIPTokenizer {
 public:
  // OpenAI's bpe_simple_vocab_16e6.txt.gz, from which the 49408-entry vocabulary is derived.
  static CLIPTokenizer from_openai_bpe(const std::filesystem::path& bpe_gz, CLIPTokenizerOptions options = {});
  // Writes the tokenizer folder transformers' CLIPTokenizer loads (vocab.json, merges.txt,
  // tokenizer_config.json, special_tokens_map.json) with the vocabulary derived from that file.
  static void write_folder_from_openai_bpe(const std::filesystem::path& bpe_gz, const std::filesystem::path& dir);
  // A tokenizer folder: vocab.json + merges.txt (or tokenizer.json), with special tokens,
  // pad token and model_max_length from tokenizer_config.json / special_tokens_map.json.
  static CLIPTokenizer from_folder(const std::filesystem::path& dir);

  // bos + tokens + eos, untruncated.
  std::vector<int> encode(const std::string& text) const;
  // The text's tokens alone (no bos / eos), untruncated.
  std::vector<int> tokens(const std::string& text) const;
  // The id of a vocabulary entry (",</w>"), or -1.
  int token_id(const std::string& entry) const;
  // Truncated to max_length (bos + first max_length-2 tokens + eos) and padded.
  TokenizedPrompt tokenize(const std::string& text) const;

  int bos_id() const { return bos_id_; }
  int eos_id() const { return eos_id_; }
  int pad_id() const { return pad_id_; }
  int max_length() const { return options_.max_length; }
  std::size_t vocab_size() const { return vocab_.size(); }
  int max_id() const { return max_id_; }  // the largest id it can produce
  static bool has_unicode_support();

 private:
  CLIPTokenizer(std::unordered_map<std::string, int> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                CLIPTokenizerOptions options, std::vector<SpecialToken> specials, const std::string& source);
  void bpe(const std::string& piece, std::vector<int>& out) const;
  void encode_text(const std::string& text, std::vector<int>& out) const;

  std::unordered_map<std::string, int> vocab_;
  std::unordered_map<std::string, int> merge_rank_;  // "a b" -> rank
  CLIPTokenizerOptions options_;
  std::vector<SpecialToken> specials_;
  std::string source_;
  int bos_id_ = 0, eos_id_ = 0, pad_id_ = 0, unk_id_ = 0, max_id_ = 0;
};

}  // namespace diffract::text
