// Little-endian byte buffers for checkpoints of the learned state. Hosts we build for (x86-64,
// aarch64) are little-endian, so values are copied as they lie in memory.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace libra::cmlfq {

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void put_string(std::string_view s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in) : in_(in) {}
  template <typename T>
  T get() {
    static_assert(std::is_arithmetic_v<T>);
    require(sizeof(T));
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string get_string() {
    const auto size = get<uint32_t>();
    require(size);
    std::string s(in_.substr(pos_, size));
    pos_ += size;
    return s;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  void require(size_t size) const {
    if (in_.size() - pos_ < size) throw std::invalid_argument("C-MLFQ checkpoint is truncated");
  }
  std::string_view in_;
  size_t pos_ = 0;
};

}  // namespace libra::cmlfq
