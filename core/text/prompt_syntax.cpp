#include "core/text/prompt_syntax.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "core/text/clip_tokenizer.h"
#include "core/util/error.h"

namespace diffract::text {

namespace {

constexpr double kRoundMultiplier = 1.1;
constexpr double kSquareMultiplier = 1 / 1.1;
constexpr int kChunkLength = 75;  // tokens a chunk, bos and eos not counted

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
// Python's \w on UTF-8 bytes: ASCII letters, digits, '_', and (approximately) every non-ASCII character.
bool is_word(char c) {
  const auto u = static_cast<unsigned char>(c);
  return std::isalnum(u) || c == '_' || u >= 0x80;
}

// Python's float() on what A1111's weight pattern [+-]?[.\d]+ matched.
double parse_weight(const std::string& digits, const std::string& token) {
  std::size_t i = digits[0] == '+' || digits[0] == '-' ? 1 : 0;
  std::size_t dots = 0, numbers = 0;
  for (std::size_t k = i; k < digits.size(); ++k) (digits[k] == '.' ? dots : numbers)++;
  if (dots > 1 || numbers == 0)
    throw Error("prompt weight '" + token + "' is not a number: write it as (text:1.2)");
  return std::strtod(digits.c_str(), nullptr);
}

struct Entry {
  WeightedText run;
  std::size_t begin, end;  // in the prompt
};

// Splits a text run (at `at` in the prompt) at A1111's \s*\bBREAK\b\s*, appending the parts and a
// BREAK between each two.
void append_text(std::vector<Entry>& res, const std::string& text, std::size_t at) {
  std::size_t start = 0, search = 0;
  while (true) {
    const auto found = text.find("BREAK", search);
    if (found == std::string::npos) break;
    const auto end = found + 5;
    const bool bounded = (found == 0 || !is_word(text[found - 1])) && (end == text.size() || !is_word(text[end]));
    if (!bounded) {
      search = found + 1;
      continue;
    }
    auto left = found;
    while (left > start && is_space(text[left - 1])) --left;
    auto right = end;
    while (right < text.size() && is_space(text[right])) ++right;
    res.push_back({{text.substr(start, left - start), 1.0}, at + start, at + left});
    res.push_back({{"BREAK", -1}, at + found, at + end});
    start = search = right;
  }
  res.push_back({{text.substr(start), 1.0}, at + start, at + text.size()});
}

// A1111's parse_prompt_attention before its merge of equal neighbours.
std::vector<Entry> scan(const std::string& prompt) {
  std::vector<Entry> res;
  std::vector<std::size_t> round, square;
  // BREAK markers keep their weight of -1 inside brackets (A1111 multiplies them too, which turns
  // "(a BREAK b)" into the word "break" at weight -1.1; here a BREAK stays a BREAK).
  const auto multiply_range = [&](std::size_t from, double m) {
    for (auto p = from; p < res.size(); ++p)
      if (!res[p].run.is_break()) res[p].run.weight *= m;
  };
  const std::size_t n = prompt.size();
  std::size_t i = 0;
  while (i < n) {
    const char c = prompt[i];
    if (c == '\\') {
      // "\(", "\)", "\[", "\]", "\\": the character; a lone backslash: nothing.
      if (i + 1 < n && (prompt[i + 1] == '(' || prompt[i + 1] == ')' || prompt[i + 1] == '[' || prompt[i + 1] == ']' ||
                        prompt[i + 1] == '\\')) {
        res.push_back({{std::string(1, prompt[i + 1]), 1.0}, i + 1, i + 2});
        i += 2;
      } else {
        res.push_back({{"", 1.0}, i, i});
        ++i;
      }
    } else if (c == '(') {
      round.push_back(res.size());
      ++i;
    } else if (c == '[') {
      square.push_back(res.size());
      ++i;
    } else if (c == ':') {
      // ":([+-]?[.\d]+)\)": a weight closing the innermost round bracket, else text.
      std::size_t j = i + 1;
      if (j < n && (prompt[j] == '+' || prompt[j] == '-')) ++j;
      const std::size_t digits_from = j;
      while (j < n && (prompt[j] == '.' || std::isdigit(static_cast<unsigned char>(prompt[j])))) ++j;
      if (j > digits_from && j < n && prompt[j] == ')') {
        const auto token = prompt.substr(i, j + 1 - i);
        if (!round.empty()) {
          const double w = parse_weight(prompt.substr(i + 1, j - i - 1), token);
          multiply_range(round.back(), w);
          round.pop_back();
        } else {
          append_text(res, token, i);
        }
        i = j + 1;
      } else {
        append_text(res, ":", i);
        ++i;
      }
    } else if (c == ')' && !round.empty()) {
      multiply_range(round.back(), kRoundMultiplier);
      round.pop_back();
      ++i;
    } else if (c == ']' && !square.empty()) {
      multiply_range(square.back(), kSquareMultiplier);
      square.pop_back();
      ++i;
    } else if (c == ')' || c == ']') {
      append_text(res, std::string(1, c), i);
      ++i;
    } else {
      std::size_t j = i;
      while (j < n && prompt[j] != '\\' && prompt[j] != '(' && prompt[j] != ')' && prompt[j] != '[' &&
             prompt[j] != ']' && prompt[j] != ':')
        ++j;
      append_text(res, prompt.substr(i, j - i), i);
      i = j;
    }
  }
  for (const auto p : round) multiply_range(p, kRoundMultiplier);
  for (const auto p : square) multiply_range(p, kSquareMultiplier);
  return res;
}

}  // namespace

std::vector<WeightedText> parse_prompt_attention(const std::string& prompt) {
  auto res = scan(prompt);
  if (res.empty()) return {{"", 1.0}};
  std::vector<WeightedText> merged;
  for (auto& e : res) {
    auto& r = e.run;
    if (!merged.empty() && merged.back().weight == r.weight && !merged.back().is_break() && !r.is_break())
      merged.back().text += r.text;
    else
      merged.push_back(std::move(r));
  }
  return merged;
}

std::vector<WeightedSpan> attention_spans(const std::string& prompt) {
  std::vector<WeightedSpan> out;
  for (const auto& e : scan(prompt))
    if (e.end > e.begin) out.push_back({e.begin, e.end, e.run.weight});
  return out;
}

std::string plain_text(const std::vector<WeightedText>& parsed) {
  std::string out;
  for (const auto& r : parsed) {
    if (r.is_break()) {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += r.text;
    }
  }
  return out;
}

bool PromptChunk::weighted() const {
  return std::any_of(weights.begin(), weights.end(), [](float w) { return w != 1.0f; });
}

ChunkedPrompt chunk_prompt(const CLIPTokenizer& tokenizer, const std::vector<WeightedText>& parsed, int comma_backtrack) {
  const int comma = tokenizer.token_id(",</w>");
  ChunkedPrompt out;
  PromptChunk chunk;
  int last_comma = -1;
  const auto next_chunk = [&](bool is_last) {
    out.token_count += is_last ? static_cast<int>(chunk.ids.size()) : kChunkLength;
    const auto fill = kChunkLength - static_cast<int>(chunk.ids.size());
    if (fill > 0) {
      chunk.ids.insert(chunk.ids.end(), static_cast<std::size_t>(fill), tokenizer.eos_id());
      chunk.weights.insert(chunk.weights.end(), static_cast<std::size_t>(fill), 1.0f);
    }
    chunk.ids.insert(chunk.ids.begin(), tokenizer.bos_id());
    chunk.ids.push_back(tokenizer.eos_id());
    chunk.weights.insert(chunk.weights.begin(), 1.0f);
    chunk.weights.push_back(1.0f);
    if (tokenizer.pad_id() != tokenizer.eos_id()) {
      const auto eos = std::find(chunk.ids.begin(), chunk.ids.end(), tokenizer.eos_id());
      std::fill(eos + 1, chunk.ids.end(), tokenizer.pad_id());
    }
    last_comma = -1;
    out.chunks.push_back(std::move(chunk));
    chunk = PromptChunk();
  };
  for (const auto& run : parsed) {
    if (run.is_break()) {
      next_chunk(false);
      continue;
    }
    const auto weight = static_cast<float>(run.weight);
    for (const int token : tokenizer.tokens(run.text)) {
      const int size = static_cast<int>(chunk.ids.size());
      if (token == comma) {
        last_comma = size;
      } else if (comma_backtrack != 0 && size == kChunkLength && last_comma != -1 &&
                 size - last_comma <= comma_backtrack) {
        const auto cut = static_cast<std::ptrdiff_t>(last_comma + 1);
        std::vector<int> ids(chunk.ids.begin() + cut, chunk.ids.end());
        std::vector<float> weights(chunk.weights.begin() + cut, chunk.weights.end());
        chunk.ids.resize(static_cast<std::size_t>(cut));
        chunk.weights.resize(static_cast<std::size_t>(cut));
        next_chunk(false);
        chunk.ids = std::move(ids);
        chunk.weights = std::move(weights);
      }
      if (static_cast<int>(chunk.ids.size()) == kChunkLength) next_chunk(false);
      chunk.ids.push_back(token);
      chunk.weights.push_back(weight);
    }
  }
  if (!chunk.ids.empty() || out.chunks.empty()) next_chunk(true);
  return out;
}

namespace {
std::string trim(const std::string& s) {
  std::size_t a = 0, b = s.size();
  while (a < b && is_space(s[a])) ++a;
  while (b > a && is_space(s[b - 1])) --b;
  return s.substr(a, b - a);
}

double tag_number(const std::string& arg, const std::string& tag) {
  const auto t = trim(arg);
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size())
    throw Error("the weight '" + t + "' in " + tag + " is not a number (write <lora:NAME:0.8>)");
  return v;
}
}  // namespace

ExtractedPrompt extract_extra_networks(const std::string& prompt) {
  // A1111's pattern: <(\w+):([^>]+)>, the arguments split at ':'.
  ExtractedPrompt out;
  std::size_t i = 0;
  while (i < prompt.size()) {
    const auto open = prompt.find('<', i);
    if (open == std::string::npos) break;
    std::size_t j = open + 1;
    while (j < prompt.size() && is_word(prompt[j]) && static_cast<unsigned char>(prompt[j]) < 0x80) ++j;
    const auto close = prompt.find('>', j);
    if (j == open + 1 || j >= prompt.size() || prompt[j] != ':' || close == std::string::npos || close == j + 1) {
      out.prompt += prompt.substr(i, open + 1 - i);
      i = open + 1;
      continue;
    }
    const auto kind = prompt.substr(open + 1, j - open - 1);
    const auto tag = prompt.substr(open, close + 1 - open);
    std::vector<std::string> args;
    for (std::size_t a = j + 1;;) {
      const auto colon = prompt.find(':', a);
      if (colon == std::string::npos || colon > close) {
        args.push_back(prompt.substr(a, close - a));
        break;
      }
      args.push_back(prompt.substr(a, colon - a));
      a = colon + 1;
    }
    if (kind != "lora" && kind != "lyco")
      throw Error("the prompt's " + tag + " names a '" + kind +
                  "' network: only <lora:NAME:WEIGHT> is read (remove the tag)");
    ExtraNetworkTag t;
    t.kind = "lora";
    t.name = trim(args[0]);
    t.text = tag;
    if (t.name.empty()) throw Error("the prompt's " + tag + " names no LoRA");
    if (args.size() > 3) throw Error("the prompt's " + tag + " has more than a name and two weights");
    if (args.size() >= 2) t.text_encoder_weight = t.weight = tag_number(args[1], tag);
    if (args.size() == 3) t.weight = tag_number(args[2], tag);
    out.tags.push_back(t);
    out.prompt += prompt.substr(i, open - i);
    i = close + 1;
  }
  if (i < prompt.size()) out.prompt += prompt.substr(i);
  return out;
}

}  // namespace diffract::text
