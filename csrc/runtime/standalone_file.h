// A standalone export's file (bitquilt.export.standalone) mapped read-only: a safetensors file, its tensors as
// pointers into the mapping and its "bitquilt.runtime.standalone" metadata parsed. The mapping is private and never
// written, so its pages are the page cache's and count once, as they are first touched; it asks for huge pages. Errors are
// std::runtime_error with a one-line reason for the user.
//
// The whole tensor table is validated when the file opens, as bitquilt/tensor_header.py validates it for the Python
// readers: known dtypes, dimensions that are integers in [0, 2^53], element and byte counts computed without
// overflow, offsets that match them, tensors that neither overlap nor leave gaps and end at the end of the file, each
// starting at a multiple of its element size (so that int32 / int64 / fp32 loads are aligned). `tensor()` then only
// hands out entries of that table.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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
// bitquilt.runtime.standalone.model.FORMAT_VERSIONS: 3 without routed linears, 4 with them (kind "slices"), 5 a
// Gemma 2 or 3 model (post-norms, GELU-tanh, sliding-window layers, scaled embeddings, soft-capped logits), 6 a
// mixture of experts (a router and expert linears in each MLP's place)
constexpr int kFormatVersion = 6, kOldestFormatVersion = 3;
// bitquilt.runtime.loop.NON_FINITE: what a model whose activations or logits hold NaN or Inf is told.
constexpr const char* kNonFinite =
    "the model's logits are NaN or infinite, so it has no next token: its weights or scales hold NaN/Inf (a diverged "
    "quantization, or a damaged or edited file); check them with `bitquilt eval`";

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
    validate_tensors();
    const auto& meta = header_["__metadata__"][kMetadataKey];
    if (meta.kind != bitquilt_json::Value::String)
      throw std::runtime_error(path_ + " has no standalone metadata; re-export the model");
    try {
      config_ = bitquilt_json::parse(meta.string);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(path_ + ": its standalone metadata is not valid (" + e.what() + "); re-export the model");
    }
    const auto& version = config_["format_version"];
    if (!version.is_integer(kOldestFormatVersion, kFormatVersion))
      throw std::runtime_error(path_ + " is standalone format " + version.describe() + "; this bitquilt reads " +
                               std::to_string(kOldestFormatVersion) + " to " + std::to_string(kFormatVersion) +
                               ": re-export the model");
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const bitquilt_json::Value& config() const { return config_; }  // the parsed "bitquilt.runtime.standalone" metadata
  bool has(const std::string& name) const { return tensors_.count(name) > 0; }

  // Tensor `name` of the validated table; `dtype` when given must be its dtype.
  Tensor tensor(const std::string& name, const std::string& dtype = "") const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end())
      throw std::runtime_error(path_ + " has no tensor '" + name + "'; the file is incomplete or not a standalone export");
    if (!dtype.empty() && it->second.dtype != dtype)
      throw std::runtime_error(path_ + ": tensor '" + name + "' is " + it->second.dtype + ", expected " + dtype);
    return it->second;
  }

 private:
  [[noreturn]] void unreadable(const std::string& why) const {
    throw std::runtime_error(path_ + " is not a readable safetensors file: " + why);
  }
  [[noreturn]] void corrupt(const std::string& name, const std::string& why) const {
    throw std::runtime_error(path_ + ": tensor '" + name + "' " + why + "; the file is truncated, damaged or was edited");
  }

  // Entry `name` of the header as a Tensor whose bytes lie at data offset `begin` (module comment's checks but the
  // table-wide ones).
  Tensor entry_tensor(const std::string& name, const bitquilt_json::Value& entry, int64_t& begin) const {
    using bitquilt_json::Value;
    constexpr int64_t kMaxDim = int64_t{1} << 53;
    if (entry.kind != Value::Object) corrupt(name, "is not an object");
    Tensor t;
    t.dtype = entry["dtype"].string;
    const int64_t size = dtype_bytes(t.dtype);
    if (size == 0)
      throw std::runtime_error(path_ + ": tensor '" + name + "' " +
                               (t.dtype.empty() ? std::string("has no dtype") : "is " + t.dtype) +
                               "; the standalone runtime reads F32, U8, I8, I32, I64");
    const Value& shape = entry["shape"];
    if (shape.kind != Value::Array) corrupt(name, "has no shape");
    int64_t numel = 1;
    for (const auto& s : shape.array) {
      if (!s.is_integer(0, kMaxDim)) corrupt(name, "has a dimension " + s.describe() + ", not an integer in [0, 2^53]");
      t.shape.push_back(s.integer());
      if (__builtin_mul_overflow(numel, t.shape.back(), &numel)) corrupt(name, "has more elements than int64 counts");
    }
    const auto& offsets = entry["data_offsets"].array;
    if (offsets.size() != 2 || !offsets[0].is_integer(0, kMaxDim) || !offsets[1].is_integer(0, kMaxDim))
      corrupt(name, "has no [begin, end] data offsets");
    begin = offsets[0].integer();
    const int64_t end = offsets[1].integer();
    if (__builtin_mul_overflow(numel, size, &t.nbytes) || end < begin || end - begin != t.nbytes)
      corrupt(name, "does not fit its offsets");
    if (start_ + static_cast<uint64_t>(end) > size_) corrupt(name, "runs past the end of the file");
    if ((start_ + static_cast<uint64_t>(begin)) % static_cast<uint64_t>(size) != 0)
      corrupt(name, "is not aligned to its element size");
    return t;
  }

  // Every tensor of the header checked (entry_tensor) and placed, the table as a whole checked for overlaps, gaps and
  // its end (module comment).
  void validate_tensors() {
    std::vector<std::pair<int64_t, std::string>> order;
    for (const auto& [name, entry] : header_.object) {
      if (name == "__metadata__") continue;
      int64_t begin = 0;
      Tensor t = entry_tensor(name, entry, begin);
      order.emplace_back(begin, name);
      tensors_.emplace(name, std::move(t));
    }
    std::sort(order.begin(), order.end(), [this](const auto& a, const auto& b) {
      return a.first != b.first ? a.first < b.first : tensors_.at(a.second).nbytes < tensors_.at(b.second).nbytes;
    });
    uint64_t position = 0;
    for (const auto& [begin, name] : order) {
      if (static_cast<uint64_t>(begin) != position)
        corrupt(name, static_cast<uint64_t>(begin) < position ? "overlaps another tensor" : "leaves a gap before it");
      Tensor& t = tensors_.at(name);
      position += static_cast<uint64_t>(t.nbytes);
      t.data = base_ + start_ + begin;
    }
    if (start_ + position != size_)
      unreadable("its tensors end at byte " + std::to_string(start_ + position) + " of " + std::to_string(size_) +
                 " (truncated or corrupt)");
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
  std::map<std::string, Tensor> tensors_;  // the validated table
};

}  // namespace bitquilt_standalone
