#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/io/dtype.h"

namespace diffract::io {

class MappedFile;

// One tensor of a safetensors file: its header entry and a view of its bytes in the mapping.
struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;  // inside the owning file's copy-on-write mapping
  std::size_t nbytes = 0;
  std::int64_t numel() const;
};

// How many times a page of a mapped file was touched past the file's end (another program
// truncated or rewrote a file while it was being read): each would have been a SIGBUS, which a
// handler answers by mapping zeros there. A reader compares the count before and after copying
// and reports the file instead of using what it read.
std::uint64_t mapping_faults();

// A memory-mapped safetensors file (or a sharded set through `*.safetensors.index.json`).
// The header is validated when opened: length within the file, well-formed JSON, known
// dtypes, dtype × shape = byte length, offsets inside the data area and not overlapping.
// Nothing is copied; tensors stay views into the mapping for as long as this object lives.
class SafetensorsArchive {
 public:
  // `path` is a `.safetensors` file or a `.safetensors.index.json` naming the shards.
  static std::shared_ptr<SafetensorsArchive> open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  // All tensors, sorted by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& at(const std::string& name) const;  // throws naming the file and tensor
  // The `__metadata__` entries of the (first) file.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The file holding `name` (a shard for sharded checkpoints).
  const std::filesystem::path& file_of(const std::string& name) const;

 private:
  void add_file(const std::filesystem::path& file);
  void index();

  std::filesystem::path path_;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::vector<TensorInfo> tensors_;
  std::vector<std::size_t> file_index_;  // per tensor, into files_
  std::map<std::string, std::string> metadata_;
};

}  // namespace diffract::io
