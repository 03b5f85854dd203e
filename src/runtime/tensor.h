// Tensors: a shape and dtype over shared, category-tagged storage.
//
// Storage owns one allocation from its device's allocator (runtime/device.h); a Tensor is a
// (possibly offset) view of it. Tensors are cheap to copy (the storage is shared). New tensors go
// to the current device; their data pointers are device pointers: only kernels and the device
// operations may dereference them.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/memory.h"

namespace mt {

class Storage {
 public:
  Storage(size_t bytes, MemCategory c, Device d);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return cat_; }
  Device device() const { return dev_; }

 private:
  void* ptr_;
  size_t bytes_;
  MemCategory cat_;
  Device dev_;
};

class Tensor {
 public:
  Tensor() = default;
  // New storage on the current device (contents unspecified / zero-filled).
  static Tensor empty(std::vector<int64_t> shape, DType dt, MemCategory c);
  static Tensor zeros(std::vector<int64_t> shape, DType dt, MemCategory c);
  // The same on an explicit device.
  static Tensor empty_on(Device d, std::vector<int64_t> shape, DType dt, MemCategory c);

  bool defined() const { return static_cast<bool>(storage_); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : current_device(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  MemCategory category() const { return storage_->category(); }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  // The elements as their type; throws std::logic_error when the tensor has another dtype.
  float* f32() const { return as<float>(DType::F32); }
  bf16* bf() const { return as<bf16>(DType::BF16); }
  int32_t* i32() const { return as<int32_t>(DType::I32); }
  int64_t* i64() const { return as<int64_t>(DType::I64); }

  // A view of `count` elements starting at element `start`, reshaped to `shape`.
  Tensor view(int64_t start, std::vector<int64_t> shape) const;
  Tensor reshape(std::vector<int64_t> shape) const { return view(0, std::move(shape)); }
  void zero_() const;
  std::string shape_str() const;

 private:
  [[noreturn]] void wrong_dtype(DType want) const;  // throws std::logic_error naming both dtypes
  template <typename T>
  T* as(DType want) const {
    if (dtype_ != want) wrong_dtype(want);
    return data<T>();
  }
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  std::vector<int64_t> shape_;
  DType dtype_ = DType::F32;
};

}  // namespace mt
