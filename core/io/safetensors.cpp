#include "core/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace diffract::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The mappings a SIGBUS may belong to, as [begin, end) address pairs; 0 marks a free slot. The
// handler reads them without locks (async-signal-safe).
constexpr int kMappingSlots = 4096;
std::atomic<std::uintptr_t> g_mapping_begin[kMappingSlots], g_mapping_end[kMappingSlots];
std::atomic<std::uint64_t> g_mapping_faults{0};
struct sigaction g_previous_sigbus {};
std::uintptr_t g_page_size = 4096;  // set before the handler is installed (sysconf is not signal-safe)

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (int i = 0; i < kMappingSlots; ++i) {
    const auto begin = g_mapping_begin[i].load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= g_mapping_end[i].load(std::memory_order_acquire)) continue;
    // One of ours: zeros over the page past the end, counted; the read then goes on.
    void* at = reinterpret_cast<void*>(addr & ~(g_page_size - 1));
    if (::mmap(at, g_page_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      g_mapping_faults.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    break;
  }
  // Not ours: what was there before, or the default action (the faulting access runs again).
  if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
    if (g_previous_sigbus.sa_sigaction) return g_previous_sigbus.sa_sigaction(sig, info, context);
  } else if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN) {
    return g_previous_sigbus.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);
}

int register_mapping(const void* data, std::size_t size) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    g_page_size = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  for (int i = 0; i < kMappingSlots; ++i) {
    std::uintptr_t free = 0;
    if (g_mapping_begin[i].load() == 0 && g_mapping_end[i].load() == 0 &&
        g_mapping_end[i].compare_exchange_strong(free, begin + size)) {
      g_mapping_begin[i].store(begin, std::memory_order_release);
      return i;
    }
  }
  return -1;  // more files mapped at once than slots: this one goes unguarded
}

void unregister_mapping(int slot) {
  if (slot < 0) return;
  g_mapping_begin[slot].store(0, std::memory_order_release);
  g_mapping_end[slot].store(0, std::memory_order_release);
}

}  // namespace

std::uint64_t mapping_faults() { return g_mapping_faults.load(std::memory_order_relaxed); }

// A whole file mapped private (copy-on-write), so a tensor viewing it can never write back.
class MappedFile {
 public:
  explicit MappedFile(const fs::path& path) : path_(path) {
    // O_NONBLOCK: a FIFO or a device opens at once (and is refused below) instead of waiting.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw Error(path.string() + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error(path.string() + ": not a regular file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        throw Error(path.string() + ": cannot map: " + std::strerror(err));
      }
      data_ = static_cast<std::byte*>(p);
      slot_ = register_mapping(data_, size_);
    }
    ::close(fd);
  }
  ~MappedFile() {
    unregister_mapping(slot_);
    if (data_) ::munmap(data_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const fs::path& path() const { return path_; }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  fs::path path_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  int slot_ = -1;
};

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

namespace {

constexpr std::uint64_t kMaxHeader = 100ull << 20;  // the format's own limit
constexpr std::size_t kMaxRank = 16;

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct Parsed {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

Parsed parse_header(const MappedFile& file) {
  const std::string where = file.path().string();
  if (file.size() < 8)
    throw Error(where + ": truncated: " + std::to_string(file.size()) +
                " bytes cannot hold a safetensors header (8-byte length first)");
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);  // little-endian, as are all our hosts
  if (header_len > kMaxHeader)
    throw Error(where + ": header length " + std::to_string(header_len) +
                " exceeds the 100 MiB the format allows: not a safetensors file?");
  if (8 + header_len > file.size())
    throw Error(where + ": header length " + std::to_string(header_len) +
                " runs past the end of the file (" + std::to_string(file.size()) +
                " bytes): the file is truncated or not safetensors");

  const char* hdr = reinterpret_cast<const char*>(file.data() + 8);
  // Names must be unique (a second entry would silently replace the first); no dtype, shape
  // or offsets nest, so a few levels is all a header needs.
  const json j = parse_json(std::string_view(hdr, header_len), where + ": header", {.max_depth = 8, .unique_keys = true});
  if (!j.is_object()) throw Error(where + ": header JSON is not an object");

  const std::size_t data_size = file.size() - 8 - header_len;
  const std::byte* data_start = file.data() + 8 + header_len;
  Parsed out;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw Error(where + ": __metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) throw Error(where + ": __metadata__ value of '" + k + "' is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string what = where + ": tensor '" + name + "'";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      throw Error(what + ": header entry needs dtype, shape and data_offsets");
    const auto& jd = entry["dtype"];
    if (!jd.is_string()) throw Error(what + ": dtype is not a string");
    auto dtype = parse_dtype(jd.get<std::string>());
    if (!dtype) throw Error(what + ": unknown dtype " + json_brief(jd));

    TensorInfo t;
    t.name = name;
    t.dtype = *dtype;
    const auto& js = entry["shape"];
    if (!js.is_array()) throw Error(what + ": shape is not an array");
    if (js.size() > kMaxRank) throw Error(what + ": shape has " + std::to_string(js.size()) + " dimensions (at most " +
                                          std::to_string(kMaxRank) + ")");
    const auto shape_text = [&] {
      std::string out = "[";
      for (std::size_t i = 0; i < js.size(); ++i) out += (i ? ", " : "") + json_brief(js[i], 20);
      return out + "]";
    };
    std::uint64_t numel = 1;
    for (const auto& d : js) {
      if (!d.is_number_unsigned()) throw Error(what + ": shape " + shape_text() + " has a dimension that is not a natural number");
      const auto v = d.get<std::uint64_t>();
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (v > 0 && numel > std::numeric_limits<std::uint64_t>::max() / v))
        throw Error(what + ": shape " + shape_text() + " is too large");
      numel *= v;
      t.shape.push_back(static_cast<std::int64_t>(v));
    }
    const auto& jo = entry["data_offsets"];
    if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() || !jo[1].is_number_unsigned())
      throw Error(what + ": data_offsets must be two natural numbers, not " + json_brief(jo));
    const auto begin = jo[0].get<std::uint64_t>(), end = jo[1].get<std::uint64_t>();
    const std::string offsets = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
    if (begin > end) throw Error(what + ": data_offsets " + offsets + " end before they begin");
    if (end > data_size)
      throw Error(what + ": data_offsets " + offsets + " lie outside the data area (" + std::to_string(data_size) +
                  " bytes): the file is truncated or corrupt");
    if (numel > std::numeric_limits<std::uint64_t>::max() / dtype_size(*dtype))
      throw Error(what + ": shape " + shape_str(t.shape) + " of " + std::string(dtype_name(*dtype)) + " is too large");
    const std::uint64_t expected = numel * dtype_size(*dtype);
    if (expected != end - begin)
      throw Error(what + ": dtype " + std::string(dtype_name(*dtype)) + " x shape " + shape_str(t.shape) +
                  " needs " + std::to_string(expected) + " bytes but data_offsets span " +
                  std::to_string(end - begin));
    t.data = data_start + begin;
    t.nbytes = static_cast<std::size_t>(end - begin);
    out.tensors.push_back(std::move(t));
  }

  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : out.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->data < b->data; });
  // As the format requires (and its reference reader checks): the tensors tile the data area,
  // no holes, nothing after the last.
  const std::byte* at = data_start;
  const TensorInfo* prev = nullptr;
  for (const auto* cur : by_offset) {
    if (cur->data < at)
      throw Error(where + ": tensors '" + prev->name + "' and '" + cur->name + "' overlap in the data area");
    if (cur->data > at && cur->nbytes > 0)
      throw Error(where + ": " + std::to_string(cur->data - at) + " bytes before tensor '" + cur->name +
                  "' belong to no tensor: the file is corrupt");
    if (cur->data + cur->nbytes > at) {
      at = cur->data + cur->nbytes;
      prev = cur;
    }
  }
  if (at != data_start + data_size)
    throw Error(where + ": " + std::to_string(data_start + data_size - at) +
                " bytes after the last tensor belong to no tensor: the file is corrupt or not one safetensors file");
  return out;
}

}  // namespace

std::shared_ptr<SafetensorsArchive> SafetensorsArchive::open(const fs::path& path) {
  auto archive = std::shared_ptr<SafetensorsArchive>(new SafetensorsArchive());
  archive->path_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(path.string() + (ec ? ": cannot read: " + ec.message() : ": no such file"));
  const std::string name = path.filename().string();
  const std::string suffix = ".index.json";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const json j = read_json(path);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(path.string() + ": no 'weight_map' object: not a sharded checkpoint index");
    std::map<std::string, std::string> wanted;  // tensor -> shard
    std::vector<std::string> shards;
    for (const auto& [tensor, shard] : j["weight_map"].items()) {
      if (!shard.is_string()) throw Error(path.string() + ": weight_map entry '" + tensor + "' is not a file name");
      auto s = shard.get<std::string>();
      if (fs::path(s).has_parent_path() || s == "..")
        throw Error(path.string() + ": shard '" + s + "' must be a file name beside the index");
      wanted[tensor] = s;
      if (std::find(shards.begin(), shards.end(), s) == shards.end()) shards.push_back(s);
    }
    for (const auto& s : shards) {
      const auto file = path.parent_path() / s;
      if (!fs::exists(file, ec)) throw Error(path.string() + ": shard '" + s + "' is missing");
      archive->add_file(file);
    }
    archive->index();
    std::string missing;
    for (const auto& [tensor, shard] : wanted) {
      const auto* t = archive->find(tensor);
      if (!t || archive->file_of(tensor).filename() != shard) missing += "\n  " + tensor + " (in " + shard + ")";
    }
    if (!missing.empty()) throw Error(path.string() + ": tensors listed in the index but absent from their shard:" + missing);
  } else {
    archive->add_file(path);
    archive->index();
  }
  log::get("io").debug(log::str(path.string(), ": ", archive->tensors_.size(), " tensors in ", archive->files_.size(),
                                " file(s)"));
  return archive;
}

void SafetensorsArchive::add_file(const fs::path& file) {
  auto mapped = std::make_shared<MappedFile>(file);
  Parsed parsed = parse_header(*mapped);
  if (files_.empty()) metadata_ = parsed.metadata;
  for (auto& t : parsed.tensors) {
    tensors_.push_back(std::move(t));
    file_index_.push_back(files_.size());
  }
  files_.push_back(std::move(mapped));
}

void SafetensorsArchive::index() {
  std::vector<std::size_t> order(tensors_.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return tensors_[a].name < tensors_[b].name; });
  std::vector<TensorInfo> sorted;
  std::vector<std::size_t> files;
  for (auto i : order) {
    if (!sorted.empty() && sorted.back().name == tensors_[i].name)
      throw Error(path_.string() + ": tensor '" + tensors_[i].name + "' appears in both " +
                  files_[files.back()]->path().filename().string() + " and " +
                  files_[file_index_[i]]->path().filename().string());
    sorted.push_back(std::move(tensors_[i]));
    files.push_back(file_index_[i]);
  }
  tensors_ = std::move(sorted);
  file_index_ = std::move(files);
}

const TensorInfo* SafetensorsArchive::find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const TensorInfo& SafetensorsArchive::at(const std::string& name) const {
  if (const auto* t = find(name)) return *t;
  throw Error(path_.string() + ": no tensor '" + name + "'");
}

const fs::path& SafetensorsArchive::file_of(const std::string& name) const {
  const auto* t = &at(name);
  return files_[file_index_[static_cast<std::size_t>(t - tensors_.data())]]->path();
}

}  // namespace diffract::io
