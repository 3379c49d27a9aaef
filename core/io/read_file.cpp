#include "core/io/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/util/error.h"

namespace diffract::io {

namespace {

std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::string name_of(const std::filesystem::path& path, const std::string& what) {
  return what.empty() ? path.string() : what + " " + path.string();
}

Error stat_error(const std::filesystem::path& path, const std::string& what, int err) {
  if (err == ENOENT) return Error(name_of(path, what) + ": missing");
  if (err == ELOOP) return Error(name_of(path, what) + ": a loop of symbolic links");
  return Error(name_of(path, what) + ": cannot read: " + std::strerror(err));
}

}  // namespace

void require_regular_file(const std::filesystem::path& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw stat_error(path, what, errno);
  if (!S_ISREG(st.st_mode)) throw Error(name_of(path, what) + ": " + kind_of(st.st_mode) + ", not a file");
}

namespace {

// Reads at most `limit` bytes; more than `limit` in the file is an error when `whole`.
std::string read_bytes(const std::filesystem::path& path, std::size_t limit, bool whole, const std::string& what) {
  // O_NONBLOCK: a FIFO opens at once instead of waiting for a writer; fstat then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw stat_error(path, what, errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw stat_error(path, what, errno);
  if (!S_ISREG(st.st_mode)) throw Error(name_of(path, what) + ": " + kind_of(st.st_mode) + ", not a file");
  const auto too_large = [&] {
    return Error(name_of(path, what) + ": larger than the " + std::to_string(limit) + " bytes such a file may have");
  };
  if (whole && static_cast<std::uint64_t>(st.st_size) > limit) throw too_large();
  std::string text;
  text.reserve(std::min<std::size_t>(limit, static_cast<std::size_t>(st.st_size)));
  char buf[1 << 16];
  while (text.size() < limit || whole) {
    const ssize_t n = ::read(fd, buf, std::min(sizeof buf, whole ? sizeof buf : limit - text.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(name_of(path, what) + ": cannot read: " + std::strerror(errno));
    if (n == 0) break;
    if (text.size() + static_cast<std::size_t>(n) > limit) throw too_large();
    text.append(buf, static_cast<std::size_t>(n));
  }
  return text;
}

}  // namespace

std::string read_file(const std::filesystem::path& path, std::size_t max_bytes, const std::string& what) {
  return read_bytes(path, max_bytes, true, what);
}

std::string read_file_head(const std::filesystem::path& path, std::size_t n, const std::string& what) {
  return read_bytes(path, n, false, what);
}

}  // namespace diffract::io

namespace diffract::io {

std::vector<std::filesystem::path> files_in(const std::filesystem::path& dir, const std::string& extension) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == extension) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

void write_file_atomically(const std::filesystem::path& path, const std::string& bytes, const std::string& what) {
  namespace fs = std::filesystem;
  const std::string name = what.empty() ? path.string() : what + " " + path.string();
  std::error_code ec;
  if (!path.parent_path().empty()) fs::create_directories(path.parent_path(), ec);
  if (ec) throw Error(name + ": cannot create its folder: " + ec.message());
  const fs::path temporary = path.parent_path() / ("." + path.filename().string() + ".tmp");
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(name + ": cannot open for writing");
    out << bytes;
    out.flush();
    if (!out) {
      out.close();
      fs::remove(temporary, ec);
      throw Error(name + ": write failed (disk full?); the file was left as it was");
    }
  }
  fs::rename(temporary, path, ec);
  if (ec) {
    fs::remove(temporary, ec);
    throw Error(name + ": cannot replace the file: " + ec.message());
  }
}

}  // namespace diffract::io
