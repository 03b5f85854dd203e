#include "runtime/tensor.h"

#include <cstring>

namespace mt {

Storage::Storage(size_t bytes, MemCategory c, Device d)
    : ptr_(device_alloc(d, bytes, c)), bytes_(bytes), cat_(c), dev_(d) {}
Storage::~Storage() { device_free(dev_, ptr_, bytes_, cat_); }

static int64_t shape_numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) throw std::invalid_argument("negative tensor dimension");
    n *= d;
  }
  return n;
}

Tensor Tensor::empty(std::vector<int64_t> shape, DType dt, MemCategory c) {
  return empty_on(current_device(), std::move(shape), dt, c);
}

Tensor Tensor::empty_on(Device d, std::vector<int64_t> shape, DType dt, MemCategory c) {
  Tensor t;
  t.dtype_ = dt;
  t.shape_ = std::move(shape);
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(shape_numel(t.shape_)) * dtype_size(dt), c, d);
  return t;
}

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dt, MemCategory c) {
  Tensor t = empty(std::move(shape), dt, c);
  t.zero_();
  return t;
}

int64_t Tensor::numel() const { return shape_numel(shape_); }

void Tensor::wrong_dtype(DType want) const {
  throw std::logic_error("tensor is " + std::string(dtype_name(dtype_)) + ", not " + dtype_name(want));
}

Tensor Tensor::view(int64_t start, std::vector<int64_t> shape) const {
  int64_t n = shape_numel(shape);
  if (start < 0 || start + n > numel())
    throw std::out_of_range("view [" + std::to_string(start) + ", " + std::to_string(start + n) +
                            ") outside tensor of " + std::to_string(numel()) + " elements");
  Tensor t = *this;
  t.offset_ = offset_ + static_cast<size_t>(start) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

void Tensor::zero_() const {
  if (defined()) dev::zero(device(), raw(), nbytes());
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
  return s + "]";
}

}  // namespace mt
