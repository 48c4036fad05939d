// A standalone export's file (bitquilt.export.standalone) mapped read-only: a safetensors file, its tensors as
// pointers into the mapping and its "bitquilt.runtime.standalone" metadata parsed. The mapping is private and never
// written, so its pages are the page cache's and count once, as they are first touched; it asks for huge pages. Errors are
// std::runtime_error with a one-line reason for the user.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "text/json_value.h"

namespace bitquilt_standalone {

constexpr const char* kMetadataKey = "bitquilt.runtime.standalone";
constexpr int kFormatVersion = 3;  // bitquilt.runtime.standalone.model.FORMAT_VERSION

struct Tensor {
  std::string dtype;  // safetensors' name: F32, U8, I8, I32, I64
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t nbytes = 0;

  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
};

inline int64_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes{{"F32", 4}, {"U8", 1}, {"I8", 1}, {"I32", 4}, {"I64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = open(path.c_str(), O_RDONLY);
    if (fd < 0) unreadable(std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size < 8) {
      close(fd);
      unreadable("shorter than a safetensors header");
    }
    const auto size = static_cast<size_t>(st.st_size);
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) unreadable(std::strerror(errno));
    map_.base = base_ = static_cast<const uint8_t*>(p);
    map_.size = size_ = size;
    // Huge pages where the page cache holds the file in 2 MB folios, and 2 MB folios where it reads the file in on
    // our faults (readahead for a huge-page mapping): a decode step reads every weight once, and on 4 KB pages the
    // TLB misses cost more than the reads (docs/memory.md, "bitquilt-native").
    madvise(p, size, MADV_HUGEPAGE);
    uint64_t length = 0;
    std::memcpy(&length, base_, 8);  // little-endian, as every CPU this runs on
    if (length > size_ - 8) unreadable("its header length " + std::to_string(length) + " runs past the end of the file");
    try {
      header_ = bitquilt_json::parse(std::string(reinterpret_cast<const char*>(base_) + 8, length));
    } catch (const std::runtime_error& e) {
      unreadable(e.what());
    }
    if (header_.kind != bitquilt_json::Value::Object) unreadable("its header is not a JSON object");
    start_ = 8 + length;
    const auto& meta = header_["__metadata__"][kMetadataKey];
    if (meta.kind != bitquilt_json::Value::String)
      throw std::runtime_error(path_ + " has no standalone metadata; re-export the model");
    try {
      config_ = bitquilt_json::parse(meta.string);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(path_ + ": its standalone metadata is not valid (" + e.what() + "); re-export the model");
    }
    const auto& version = config_["format_version"];
    if (version.kind != bitquilt_json::Value::Number || version.integer() != kFormatVersion)
      throw std::runtime_error(path_ + " is standalone format " +
                               (version.kind == bitquilt_json::Value::Number ? std::to_string(version.integer())
                                                                              : std::string("None")) +
                               "; this bitquilt reads " + std::to_string(kFormatVersion) + ": re-export the model");
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const bitquilt_json::Value& config() const { return config_; }  // the parsed "bitquilt.runtime.standalone" metadata
  bool has(const std::string& name) const { return name != "__metadata__" && header_.has(name); }

  // Tensor `name`, checked to lie inside the file; `dtype` when given must be its dtype.
  Tensor tensor(const std::string& name, const std::string& dtype = "") const {
    if (!has(name))
      throw std::runtime_error(path_ + " has no tensor '" + name + "'; the file is incomplete or not a standalone export");
    const auto& entry = header_[name];
    Tensor t;
    t.dtype = entry["dtype"].string;
    const int64_t size = dtype_bytes(t.dtype);
    if (size == 0)
      throw std::runtime_error(path_ + ": tensor '" + name + "' " +
                               (t.dtype.empty() ? std::string("has no dtype") : "is " + t.dtype) +
                               "; the standalone runtime reads F32, U8, I8, I32, I64");
    if (!dtype.empty() && t.dtype != dtype)
      throw std::runtime_error(path_ + ": tensor '" + name + "' is " + t.dtype + ", expected " + dtype);
    for (const auto& s : entry["shape"].array) t.shape.push_back(s.integer());
    const auto& offsets = entry["data_offsets"].array;
    const int64_t begin = offsets.size() == 2 ? offsets[0].integer() : -1;
    const int64_t end = offsets.size() == 2 ? offsets[1].integer() : -1;
    if (begin < 0 || end < begin || end - begin != t.numel() * size || start_ + end > static_cast<uint64_t>(size_))
      throw std::runtime_error(path_ + ": tensor '" + name +
                               "' does not fit its offsets; the file is truncated or corrupt");
    t.data = base_ + start_ + begin;
    t.nbytes = end - begin;
    return t;
  }

 private:
  [[noreturn]] void unreadable(const std::string& why) const {
    throw std::runtime_error(path_ + " is not a readable safetensors file: " + why);
  }

  struct Mapping {  // unmapped on destruction, also when the constructor throws after mapping
    const uint8_t* base = nullptr;
    size_t size = 0;
    ~Mapping() {
      if (base != nullptr) munmap(const_cast<uint8_t*>(base), size);
    }
  };

  std::string path_;
  Mapping map_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint64_t start_ = 0;
  bitquilt_json::Value header_, config_;
};

}  // namespace bitquilt_standalone
