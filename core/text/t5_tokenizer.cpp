#include "core/text/t5_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <fstream>

#ifdef DIFFRACT_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace diffract::text {

namespace fs = std::filesystem;

#ifdef DIFFRACT_HAVE_SENTENCEPIECE

struct T5Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  int extra_ids = 100;
  int pieces = 0;
  int eos = 1, pad = 0, unk = 2;

  // A special token starting at text[pos]: its id and length, or {-1, 0}.
  std::pair<int, std::size_t> special_at(const std::string& text, std::size_t pos) const {
    for (const auto& [name, id] : {std::pair<const char*, int>{"</s>", eos}, {"<pad>", pad}, {"<unk>", unk}})
      if (text.compare(pos, std::char_traits<char>::length(name), name) == 0)
        return {id, std::char_traits<char>::length(name)};
    static const std::string extra = "<extra_id_";
    if (text.compare(pos, extra.size(), extra) != 0) return {-1, 0};
    const std::size_t digits = pos + extra.size();
    std::size_t end = digits;
    while (end < text.size() && end - digits < 9 && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    if (end == digits || end >= text.size() || text[end] != '>') return {-1, 0};
    const auto number = text.substr(digits, end - digits);
    const int n = std::stoi(number);
    if (n >= extra_ids || std::to_string(n) != number) return {-1, 0};  // "<extra_id_07>" is plain text
    // transformers puts the extra ids after the pieces in reverse: <extra_id_0> is the last id.
    return {pieces + extra_ids - 1 - n, end + 1 - pos};
  }

  void encode_part(const std::string& part, std::vector<int>& out) const {
    if (part.empty()) return;
    std::vector<int> ids;
    const auto status = sp.Encode(part, &ids);
    if (!status.ok()) throw Error("T5 tokenizer: SentencePiece failed on the prompt: " + status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }

  std::vector<int> tokens(const std::string& text) const {
    std::vector<int> out;
    std::size_t start = 0;
    for (std::size_t i = 0; i < text.size(); ++i) {
      if (text[i] != '<') continue;
      const auto [id, len] = special_at(text, i);
      if (id < 0) continue;
      encode_part(text.substr(start, i - start), out);
      out.push_back(id);
      start = i + len;
      i = start - 1;
    }
    encode_part(text.substr(start), out);
    return out;
  }
};

bool T5Tokenizer::available() { return true; }

T5Tokenizer T5Tokenizer::from_model_file(const fs::path& spiece_model, int extra_ids) {
  if (!fs::is_regular_file(spiece_model)) throw Error(spiece_model.string() + ": missing (T5's SentencePiece model)");
  if (extra_ids < 0) throw Error(spiece_model.string() + ": extra_ids must not be negative");
  auto impl = std::make_unique<Impl>();
  const auto status = impl->sp.Load(spiece_model.string());
  if (!status.ok())
    throw Error(spiece_model.string() + ": not a SentencePiece model (" + status.ToString() + ")");
  impl->extra_ids = extra_ids;
  impl->pieces = impl->sp.GetPieceSize();
  impl->eos = impl->sp.eos_id();
  impl->pad = impl->sp.pad_id();
  impl->unk = impl->sp.unk_id();
  if (impl->eos < 0 || impl->pad < 0)
    throw Error(spiece_model.string() + ": the SentencePiece model has no " + (impl->eos < 0 ? "</s>" : "<pad>") +
                " piece, so it is not a T5 tokenizer");
  return T5Tokenizer(std::move(impl));
}

#else  // no SentencePiece in this build

struct T5Tokenizer::Impl {
  int extra_ids = 0, pieces = 0, eos = 1, pad = 0, unk = 2;
  std::vector<int> tokens(const std::string&) const { return {}; }
};

bool T5Tokenizer::available() { return false; }

T5Tokenizer T5Tokenizer::from_model_file(const fs::path& spiece_model, int) {
  throw Error(spiece_model.string() + ": this build of Diffract has no SentencePiece, so it cannot load T5's "
              "tokenizer (build it with the Debian package libsentencepiece-dev installed)");
}

#endif

T5Tokenizer T5Tokenizer::from_folder(const fs::path& dir) {
  const auto model = dir / "spiece.model";
  if (!fs::is_regular_file(model)) {
    if (fs::is_regular_file(dir / "tokenizer.json"))
      throw Error(dir.string() + ": spiece.model is missing; Diffract's T5 tokenizer reads the SentencePiece model, "
                  "not tokenizer.json (copy spiece.model from the model's original repository, e.g. "
                  "google/t5-v1_1-xxl)");
    throw Error(dir.string() + ": spiece.model is missing (T5's SentencePiece model)");
  }
  int extra_ids = 100;
  const auto config = dir / "tokenizer_config.json";
  if (fs::is_regular_file(config)) {
    const auto j = io::read_json(config);
    if (j.contains("extra_ids") && j["extra_ids"].is_number_integer()) extra_ids = j["extra_ids"].get<int>();
  }
  return from_model_file(model, extra_ids);
}

T5Tokenizer::T5Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
T5Tokenizer::T5Tokenizer(T5Tokenizer&&) noexcept = default;
T5Tokenizer& T5Tokenizer::operator=(T5Tokenizer&&) noexcept = default;
T5Tokenizer::~T5Tokenizer() = default;

std::vector<int> T5Tokenizer::encode(const std::string& text) const {
  auto ids = impl_->tokens(text);
  ids.push_back(impl_->eos);
  return ids;
}

TokenizedPrompt T5Tokenizer::encode(const std::string& text, int max_length) const {
  if (max_length < 1) throw Error("T5 tokenizer: max_length must be at least 1, got " + std::to_string(max_length));
  auto tokens = impl_->tokens(text);
  TokenizedPrompt out;
  const auto keep = std::min<std::size_t>(tokens.size(), static_cast<std::size_t>(max_length - 1));
  out.dropped = static_cast<int>(tokens.size() - keep);
  out.ids.assign(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(keep));
  out.ids.push_back(impl_->eos);
  out.length = static_cast<int>(out.ids.size());
  out.attention_mask.assign(out.ids.size(), 1);
  out.ids.resize(static_cast<std::size_t>(max_length), impl_->pad);
  out.attention_mask.resize(static_cast<std::size_t>(max_length), 0);
  return out;
}

int T5Tokenizer::eos_id() const { return impl_->eos; }
int T5Tokenizer::pad_id() const { return impl_->pad; }
int T5Tokenizer::unk_id() const { return impl_->unk; }
int T5Tokenizer::vocab_size() const { return impl_->pieces + impl_->extra_ids; }

}  // namespace diffract::text
