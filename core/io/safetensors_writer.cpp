#include "core/io/safetensors_writer.h"

#include <cstdint>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace diffract::io {

namespace {

const char* safetensors_dtype(at::ScalarType t, const std::string& name) {
  switch (t) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: throw Error("tensor " + name + ": dtype " + std::string(c10::toString(t)) + " cannot be written to safetensors");
  }
}

}  // namespace

void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> cpu;
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__") throw Error(path.string() + ": invalid tensor name '" + name + "'");
    if (!names.insert(name).second) throw Error(path.string() + ": tensor " + name + " given twice");
    if (!t.defined()) throw Error(path.string() + ": tensor " + name + " is undefined");
    auto c = t.detach().to(at::kCPU).contiguous();
    const std::uint64_t bytes = static_cast<std::uint64_t>(c.numel()) * c.element_size();
    header[name] = {{"dtype", safetensors_dtype(c.scalar_type(), name)},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(std::move(c));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(path.string() + ": cannot write (is the folder there and writable?)");
    std::uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& c : cpu)
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
    if (!out.flush()) throw Error(path.string() + ": write failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace diffract::io
