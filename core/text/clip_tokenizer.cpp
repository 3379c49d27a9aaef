#include "core/text/clip_tokenizer.h"

#include <zlib.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/log.h"

#ifdef DIFFRACT_HAS_ICU
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>
#endif

namespace diffract::text {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::u32string decode_utf8(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) throw Error("prompt is not valid UTF-8 (byte " + std::to_string(i) + ")");
    char32_t cp = len == 1 ? b : b & (0x7f >> len);
    for (int k = 1; k < len; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c >> 6) != 2) throw Error("prompt is not valid UTF-8 (byte " + std::to_string(i + k) + ")");
      cp = (cp << 6) | (c & 0x3f);
    }
    static constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
      throw Error("prompt is not valid UTF-8 (byte " + std::to_string(i) + ")");
    out.push_back(cp);
    i += len;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

enum class CharClass { Space, Letter, Number, Other };

#ifdef DIFFRACT_HAS_ICU
std::u32string normalize(const std::u32string& text) {
  // NFC, then full lowercase mapping of each code point on its own (no context, so no
  // final-sigma rule), as tokenizers' Lowercase normalizer does.
  UErrorCode ec = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(ec);
  icu::UnicodeString s;
  for (char32_t c : text) s.append(static_cast<UChar32>(c));
  icu::UnicodeString n = nfc->normalize(s, ec);
  if (U_FAILURE(ec)) throw Error(std::string("Unicode normalization failed: ") + u_errorName(ec));
  std::u32string out;
  for (int32_t i = 0; i < n.length();) {
    const UChar32 c = n.char32At(i);
    i += U16_LENGTH(c);
    UChar src[2];
    int32_t src_len = 0;
    U16_APPEND_UNSAFE(src, src_len, c);
    UChar dst[8];
    ec = U_ZERO_ERROR;
    const int32_t len = u_strToLower(dst, 8, src, src_len, "", &ec);
    if (U_FAILURE(ec)) throw Error(std::string("Unicode lowercasing failed: ") + u_errorName(ec));
    for (int32_t k = 0; k < len;) {
      UChar32 lc;
      U16_NEXT(dst, k, len, lc);
      out.push_back(static_cast<char32_t>(lc));
    }
  }
  return out;
}

CharClass classify(char32_t c) {
  const auto cp = static_cast<UChar32>(c);
  if (u_isUWhiteSpace(cp)) return CharClass::Space;
  const auto mask = U_GET_GC_MASK(cp);
  if (mask & U_GC_L_MASK) return CharClass::Letter;
  if (mask & U_GC_N_MASK) return CharClass::Number;
  return CharClass::Other;
}
#else
std::u32string normalize(const std::u32string& text) {
  std::u32string out = text;
  for (auto& c : out) {
    if (c > 0x7f) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "U+%04X", static_cast<unsigned>(c));
      throw Error(std::string("this build of Diffract has no Unicode support (ICU); the prompt contains ") + hex +
                  ": use ASCII text or a build with ICU");
    }
    if (c >= 'A' && c <= 'Z') c += 'a' - 'A';
  }
  return out;
}

CharClass classify(char32_t c) {
  if (c == ' ' || (c >= 0x09 && c <= 0x0d)) return CharClass::Space;
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::Letter;
  if (c >= '0' && c <= '9') return CharClass::Number;
  return CharClass::Other;
}
#endif

// The pieces of CLIP's pre-tokenizer: 's 't 're 've 'm 'll 'd | letter runs | one digit |
// runs of anything else but whitespace. Whitespace separates pieces and is dropped.
std::vector<std::u32string> split_pieces(const std::u32string& s) {
  static const std::u32string kContractions[] = {U"'s", U"'t", U"'re", U"'ve", U"'m", U"'ll", U"'d"};
  std::vector<std::u32string> pieces;
  std::size_t i = 0;
  while (i < s.size()) {
    const CharClass cls = classify(s[i]);
    if (cls == CharClass::Space) {
      ++i;
      continue;
    }
    if (s[i] == U'\'') {
      bool matched = false;
      for (const auto& c : kContractions)
        if (s.compare(i, c.size(), c) == 0) {
          pieces.push_back(c);
          i += c.size();
          matched = true;
          break;
        }
      if (matched) continue;
    }
    std::size_t j = i + 1;
    if (cls == CharClass::Letter) {
      while (j < s.size() && classify(s[j]) == CharClass::Letter) ++j;
    } else if (cls == CharClass::Other) {
      while (j < s.size() && classify(s[j]) == CharClass::Other) ++j;
    }
    pieces.push_back(s.substr(i, j - i));
    i = j;
  }
  return pieces;
}

// GPT-2's reversible byte -> printable-character table.
const std::vector<std::string>& byte_encoder() {
  static const std::vector<std::string> table = [] {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xa1; b <= 0xac; ++b) bs.push_back(b);
    for (int b = 0xae; b <= 0xff; ++b) bs.push_back(b);
    std::vector<std::string> t(256);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool direct = std::find(bs.begin(), bs.end(), b) != bs.end();
      std::string u;
      append_utf8(u, static_cast<char32_t>(direct ? b : 256 + extra++));
      t[b] = u;
    }
    return t;
  }();
  return table;
}

// The printable characters in bs order, as OpenAI's vocabulary lists them.
std::vector<std::string> byte_alphabet() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xa1; b <= 0xac; ++b) bs.push_back(b);
  for (int b = 0xae; b <= 0xff; ++b) bs.push_back(b);
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) bs.push_back(b);
  std::vector<std::string> out;
  for (int b : bs) out.push_back(byte_encoder()[b]);
  return out;
}

std::vector<std::pair<std::string, std::string>> parse_merges(std::istream& in, const std::string& source,
                                                             std::size_t limit = SIZE_MAX) {
  std::vector<std::pair<std::string, std::string>> merges;
  std::string line;
  std::size_t lineno = 0;
  while (merges.size() < limit && std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const auto sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == line.size() || line.find(' ', sp + 1) != std::string::npos)
      throw Error(source + ": line " + std::to_string(lineno) + " is not a merge 'a b': '" + line + "'");
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  return merges;
}

std::string token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

std::unordered_map<std::string, int> read_vocab(const fs::path& vocab_json) {
  if (!fs::is_regular_file(vocab_json)) throw Error(vocab_json.string() + ": tokenizer vocabulary is missing");
  const auto vj = io::JsonFile::read(vocab_json);
  std::unordered_map<std::string, int> vocab;
  for (const auto& [tok, id] : vj.json().items()) {
    if (!id.is_number_integer()) throw Error(vocab_json.string() + ": id of '" + tok + "' is not an integer");
    vocab.emplace(tok, id.get<int>());
  }
  return vocab;
}

std::vector<std::pair<std::string, std::string>> read_merges(const fs::path& merges_txt) {
  if (!fs::is_regular_file(merges_txt)) throw Error(merges_txt.string() + ": tokenizer merges file is missing");
  std::ifstream in(merges_txt);
  return parse_merges(in, merges_txt.string());
}

}  // namespace

bool CLIPTokenizer::has_unicode_support() {
#ifdef DIFFRACT_HAS_ICU
  return true;
#else
  return false;
#endif
}

CLIPTokenizer::CLIPTokenizer(std::unordered_map<std::string, int> vocab,
                             const std::vector<std::pair<std::string, std::string>>& merges,
                             CLIPTokenizerOptions options, std::vector<SpecialToken> specials, const std::string& source)
    : vocab_(std::move(vocab)), options_(std::move(options)), specials_(std::move(specials)), source_(source) {
  if (options_.max_length < 2) throw Error(source_ + ": max length " + std::to_string(options_.max_length) + " is below 2");
  for (std::size_t r = 0; r < merges.size(); ++r) merge_rank_.emplace(merges[r].first + " " + merges[r].second, int(r));
  for (const auto& [token, id] : vocab_) {
    if (id < 0) throw Error(source_ + ": the vocabulary gives '" + token.substr(0, 40) + "' the negative id " + std::to_string(id));
    max_id_ = std::max(max_id_, id);
  }
  for (const auto& s : specials_) {
    if (s.id < 0) throw Error(source_ + ": the special token '" + s.content.substr(0, 40) + "' has a negative id");
    max_id_ = std::max(max_id_, s.id);
  }
  auto id_of = [&](const std::string& token, const char* role) {
    auto it = vocab_.find(token);
    if (it == vocab_.end()) throw Error(source_ + ": the " + std::string(role) + " token '" + token + "' is not in the vocabulary");
    return it->second;
  };
  bos_id_ = id_of(options_.bos_token, "bos");
  eos_id_ = id_of(options_.eos_token, "eos");
  pad_id_ = id_of(options_.pad_token, "pad");
  unk_id_ = id_of(options_.unk_token, "unk");
  for (const auto& t : {options_.bos_token, options_.eos_token, options_.pad_token, options_.unk_token})
    if (std::none_of(specials_.begin(), specials_.end(), [&](const SpecialToken& s) { return s.content == t; }))
      specials_.push_back({t, vocab_.at(t), false});
  for (const auto& b : byte_encoder())
    if (!vocab_.count(b) || !vocab_.count(b + "</w>"))
      throw Error(source_ + ": the vocabulary lacks the byte symbol '" + b + "': not a CLIP byte-level vocabulary");
  // Longest first, so a special token that contains another wins.
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const SpecialToken& a, const SpecialToken& b) { return a.content.size() > b.content.size(); });
}

namespace {

std::vector<std::pair<std::string, std::string>> read_openai_merges(const fs::path& bpe_gz) {
  gzFile gz = gzopen(bpe_gz.c_str(), "rb");
  if (!gz) throw Error(bpe_gz.string() + ": cannot open");
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(gz, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(n));
  const bool failed = n < 0;
  gzclose(gz);
  if (failed) throw Error(bpe_gz.string() + ": corrupt gzip data");
  std::istringstream in(text);
  std::string header;
  std::getline(in, header);  // "#version: 0.2"
  constexpr std::size_t kMerges = 49152 - 256 - 2;
  auto merges = parse_merges(in, bpe_gz.string(), kMerges);
  if (merges.size() != kMerges)
    throw Error(bpe_gz.string() + ": holds " + std::to_string(merges.size()) + " merges, CLIP needs " + std::to_string(kMerges));
  return merges;
}

// Token strings by id, as OpenAI's CLIP (and transformers) derive them from the merges.
std::vector<std::string> openai_vocab(const std::vector<std::pair<std::string, std::string>>& merges) {
  std::vector<std::string> vocab;
  const auto alphabet = byte_alphabet();
  for (const auto& a : alphabet) vocab.push_back(a);
  for (const auto& a : alphabet) vocab.push_back(a + "</w>");
  for (const auto& [a, b] : merges) vocab.push_back(a + b);
  vocab.emplace_back("<|startoftext|>");
  vocab.emplace_back("<|endoftext|>");
  return vocab;
}

}  // namespace

CLIPTokenizer CLIPTokenizer::from_openai_bpe(const fs::path& bpe_gz, CLIPTokenizerOptions options) {
  auto merges = read_openai_merges(bpe_gz);
  std::unordered_map<std::string, int> vocab;
  int next = 0;
  for (auto& token : openai_vocab(merges)) vocab.emplace(std::move(token), next++);
  return CLIPTokenizer(std::move(vocab), merges, std::move(options), {}, bpe_gz.string());
}

void CLIPTokenizer::write_folder_from_openai_bpe(const fs::path& bpe_gz, const fs::path& dir) {
  const auto merges = read_openai_merges(bpe_gz);
  const auto vocab = openai_vocab(merges);
  fs::create_directories(dir);
  nlohmann::ordered_json v = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < vocab.size(); ++i) v[vocab[i]] = static_cast<int>(i);
  std::ofstream vj(dir / "vocab.json");
  vj << v.dump();
  std::ofstream mt(dir / "merges.txt");
  mt << "#version: 0.2\n";
  for (const auto& [a, b] : merges) mt << a << ' ' << b << '\n';
  const json special = {{"bos_token", "<|startoftext|>"}, {"eos_token", "<|endoftext|>"},
                        {"pad_token", "<|endoftext|>"}, {"unk_token", "<|endoftext|>"}};
  auto config = special;
  config["model_max_length"] = 77;
  config["do_lower_case"] = true;
  config["clean_up_tokenization_spaces"] = true;
  config["tokenizer_class"] = "CLIPTokenizer";
  std::ofstream(dir / "tokenizer_config.json") << config.dump(2) << '\n';
  std::ofstream(dir / "special_tokens_map.json") << special.dump(2) << '\n';
  if (!vj || !mt) throw Error(dir.string() + ": cannot write the tokenizer files");
}

CLIPTokenizer CLIPTokenizer::from_folder(const fs::path& dir) {
  if (!fs::is_directory(dir)) throw Error(dir.string() + ": tokenizer folder is missing");
  CLIPTokenizerOptions options;
  std::vector<SpecialToken> specials;
  auto apply_special = [&](const json& j) {
    if (j.contains("bos_token") && !token_content(j["bos_token"]).empty()) options.bos_token = token_content(j["bos_token"]);
    if (j.contains("eos_token") && !token_content(j["eos_token"]).empty()) options.eos_token = token_content(j["eos_token"]);
    if (j.contains("pad_token") && !token_content(j["pad_token"]).empty()) options.pad_token = token_content(j["pad_token"]);
    if (j.contains("unk_token") && !token_content(j["unk_token"]).empty()) options.unk_token = token_content(j["unk_token"]);
  };
  if (fs::is_regular_file(dir / "tokenizer_config.json")) {
    const auto cfg = io::JsonFile::read(dir / "tokenizer_config.json");
    apply_special(cfg.json());
    if (cfg.has("model_max_length")) {
      const double m = cfg.json()["model_max_length"].is_number() ? cfg.json()["model_max_length"].get<double>() : -1;
      if (m < 0) throw Error(cfg.path().string() + ": model_max_length is not a number");
      if (m <= 1e6) options.max_length = static_cast<int>(m);  // larger values mean "unset"
    }
    if (cfg.has("added_tokens_decoder") && cfg.json()["added_tokens_decoder"].is_object())
      for (const auto& [id, tok] : cfg.json()["added_tokens_decoder"].items())
        if (tok.is_object() && tok.contains("content"))
          specials.push_back({tok["content"].get<std::string>(), std::stoi(id), tok.value("normalized", false)});
  }
  if (fs::is_regular_file(dir / "special_tokens_map.json")) apply_special(io::JsonFile::read(dir / "special_tokens_map.json").json());

  if (fs::is_regular_file(dir / "vocab.json") || fs::is_regular_file(dir / "merges.txt"))
    return CLIPTokenizer(read_vocab(dir / "vocab.json"), read_merges(dir / "merges.txt"), options, std::move(specials),
                         dir.string());
  if (fs::is_regular_file(dir / "tokenizer.json")) {
    const auto tj = io::JsonFile::read(dir / "tokenizer.json");
    const auto& j = tj.json();
    if (!j.contains("model") || !j["model"].is_object() || j["model"].value("type", "") != "BPE" ||
        j["model"].value("end_of_word_suffix", json()).is_null() || j["model"]["end_of_word_suffix"] != "</w>")
      throw Error(tj.path().string() + ": not a CLIP BPE tokenizer (model.type BPE with end_of_word_suffix '</w>')");
    std::unordered_map<std::string, int> vocab;
    for (const auto& [tok, id] : j["model"]["vocab"].items()) vocab.emplace(tok, id.get<int>());
    std::vector<std::pair<std::string, std::string>> merges;
    for (const auto& m : j["model"]["merges"]) {
      if (m.is_array() && m.size() == 2) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else if (m.is_string()) {
        const auto s = m.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos) throw Error(tj.path().string() + ": malformed merge '" + s + "'");
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else {
        throw Error(tj.path().string() + ": malformed merge " + io::json_brief(m));
      }
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& tok : j["added_tokens"])
        specials.push_back({tok.at("content").get<std::string>(), tok.at("id").get<int>(), tok.value("normalized", false)});
    return CLIPTokenizer(std::move(vocab), merges, options, std::move(specials), dir.string());
  }
  throw Error(dir.string() + ": no tokenizer files (vocab.json + merges.txt, or tokenizer.json)");
}

void CLIPTokenizer::bpe(const std::string& piece, std::vector<int>& out) const {
  // Symbols start as the byte-level characters of the piece, the last marked as a word end.
  std::vector<std::string> symbols;
  for (unsigned char b : piece) symbols.push_back(byte_encoder()[b]);
  if (symbols.empty()) return;
  symbols.back() += "</w>";
  while (symbols.size() > 1) {
    int best_rank = INT_MAX;
    std::size_t best = 0;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merge_rank_.find(symbols[i] + " " + symbols[i + 1]);
      if (it != merge_rank_.end() && it->second < best_rank) {
        best_rank = it->second;
        best = i;
      }
    }
    if (best_rank == INT_MAX) break;
    const std::string first = symbols[best], second = symbols[best + 1];
    std::vector<std::string> merged;
    merged.reserve(symbols.size());
    for (std::size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == first && symbols[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(symbols[i++]);
      }
    }
    symbols = std::move(merged);
  }
  for (const auto& s : symbols) {
    auto it = vocab_.find(s);
    out.push_back(it == vocab_.end() ? unk_id_ : it->second);
  }
}

void CLIPTokenizer::encode_text(const std::string& text, std::vector<int>& out) const {
  // Special tokens are cut out first: raw-matched ones from the text as given, normalized
  // ones from each remaining segment after normalization (tokenizers' added-vocabulary order).
  auto split_on = [&](const std::u32string& s, bool normalized, auto&& emit_text) {
    std::size_t start = 0, i = 0;
    std::vector<std::pair<std::u32string, int>> specials;
    for (const auto& sp : specials_)
      if (sp.normalized == normalized) {
        const auto u = decode_utf8(sp.content);
        specials.emplace_back(normalized ? normalize(u) : u, sp.id);
      }
    while (i < s.size()) {
      bool hit = false;
      for (const auto& [content, id] : specials)
        if (!content.empty() && s.compare(i, content.size(), content) == 0) {
          emit_text(s.substr(start, i - start));
          out.push_back(id);
          i += content.size();
          start = i;
          hit = true;
          break;
        }
      if (!hit) ++i;
    }
    emit_text(s.substr(start));
  };
  split_on(decode_utf8(text), false, [&](const std::u32string& raw) {
    if (raw.empty()) return;
    split_on(normalize(raw), true, [&](const std::u32string& norm) {
      for (const auto& piece : split_pieces(norm)) {
        std::string utf8;
        for (char32_t c : piece) append_utf8(utf8, c);
        bpe(utf8, out);
      }
    });
  });
}

std::vector<int> CLIPTokenizer::encode(const std::string& text) const {
  std::vector<int> ids{bos_id_};
  encode_text(text, ids);
  ids.push_back(eos_id_);
  return ids;
}

std::vector<int> CLIPTokenizer::tokens(const std::string& text) const {
  std::vector<int> ids;
  encode_text(text, ids);
  return ids;
}

int CLIPTokenizer::token_id(const std::string& entry) const {
  const auto it = vocab_.find(entry);
  return it == vocab_.end() ? -1 : it->second;
}

TokenizedPrompt CLIPTokenizer::tokenize(const std::string& text) const {
  TokenizedPrompt t;
  t.ids = encode(text);
  const auto max = static_cast<std::size_t>(options_.max_length);
  if (t.ids.size() > max) {
    t.dropped = static_cast<int>(t.ids.size() - max);
    t.ids.resize(max - 1);
    t.ids.push_back(eos_id_);
  }
  t.length = static_cast<int>(t.ids.size());
  t.attention_mask.assign(t.ids.size(), 1);
  t.ids.resize(max, pad_id_);
  t.attention_mask.resize(max, 0);
  return t;
}

}  // namespace diffract::text
