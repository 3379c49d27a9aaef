#pragma once
// Reading a file a user named: a missing file, a folder, a FIFO, a device or a symlink loop is an
// Error naming it, and nothing waits on a FIFO's writer.
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

namespace diffract::io {

// Nothing when the path is a regular file (following symlinks); else an Error naming the path
// and what it is instead (missing, a folder, a FIFO, a device, a symlink loop). `what` names
// the role ("preset") in the message.
void require_regular_file(const std::filesystem::path& path, const std::string& what = "");

// The whole file, at most `max_bytes` (larger is an Error), opened without blocking.
std::string read_file(const std::filesystem::path& path, std::size_t max_bytes, const std::string& what = "");

// The file's first `n` bytes (fewer when it is shorter), with the same checks.
std::string read_file_head(const std::filesystem::path& path, std::size_t n, const std::string& what = "");

}  // namespace diffract::io

namespace diffract::io {

// The files in `dir` whose names end in `extension` (".json"), sorted; none when `dir` is no folder.
std::vector<std::filesystem::path> files_in(const std::filesystem::path& dir, const std::string& extension);

// Writes `bytes` to a hidden temporary file beside `path`, then renames it over `path`: a full
// disk or a crash mid-write leaves any earlier file whole. Creates the folder. Throws an Error
// naming `path` (and `what`, the role).
void write_file_atomically(const std::filesystem::path& path, const std::string& bytes, const std::string& what = "");

}  // namespace diffract::io
