#include "train/device_batches.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/backend.h"
#include "runtime/host_transfer.h"

namespace mt {

DeviceBatches::DeviceBatches(Transformer& model, int64_t micro_batches, int64_t tokens)
    : model_(model), dev_(model.device()), mb_(micro_batches), tokens_(tokens) {
  const size_t n = static_cast<size_t>(2 * 2 * mb_ * tokens_);
  pinned_ = static_cast<int32_t*>(host_alloc_pinned(dev_, n * sizeof(int32_t)));
  std::vector<Tensor> b = device_buffers(dev_, mb_, tokens_);
  inputs_ = std::move(b[0]);
  loss_acc_ = std::move(b[1]);
  scalars_ = std::move(b[2]);
  model_.set_device_inputs(true);
}

std::vector<Tensor> DeviceBatches::device_buffers(Device dev, int64_t micro_batches, int64_t tokens) {
  std::vector<Tensor> b;
  b.push_back(Tensor::empty_on(dev, {2 * 2 * micro_batches * tokens}, DType::I32, MemCategory::Activations));
  b.push_back(Tensor::empty_on(dev, {tokens}, DType::F32, MemCategory::Activations));  // loss_acc_
  b.push_back(Tensor::empty_on(dev, {4}, DType::F32, MemCategory::Activations));       // scalars_: 2 doubles
  return b;
}

DeviceBatches::~DeviceBatches() {
  model_.set_device_inputs(false);
  model_.set_loss_sink(nullptr);
  host_free_pinned(dev_, pinned_);
}

int32_t* DeviceBatches::check(int64_t m, int set, const int32_t* ids, const int32_t* targets) {
  if (m < 0 || m >= mb_) throw std::out_of_range("DeviceBatches::upload: micro-batch " + std::to_string(m));
  const int64_t V = model_.config().vocab_size;
  for (int64_t i = 0; i < tokens_; ++i)
    if (ids[i] < 0 || ids[i] >= V)
      throw std::out_of_range("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                              " is outside the vocabulary of " + std::to_string(V));
  for (int64_t i = 0; i < tokens_; ++i)
    if (targets[i] >= V)
      throw std::out_of_range("target id " + std::to_string(targets[i]) + " is outside the vocabulary");
  const size_t bytes = static_cast<size_t>(tokens_) * sizeof(int32_t);
  int32_t* h = pinned_ + 2 * (set * mb_ + m) * tokens_;
  std::memcpy(h, ids, bytes);
  std::memcpy(h + tokens_, targets, bytes);
  return h;
}

void DeviceBatches::upload(int64_t m, const int32_t* ids, const int32_t* targets) {
  const int32_t* h = check(m, cur_, ids, targets);
  dev::copy_from_host_async(dev_, inputs_.i32() + 2 * (cur_ * mb_ + m) * tokens_, h,
                            2 * static_cast<size_t>(tokens_) * sizeof(int32_t));
}

void DeviceBatches::upload_next(int64_t m, const int32_t* ids, const int32_t* targets) {
  const int next = 1 - cur_;
  const int32_t* h = check(m, next, ids, targets);
  dev::upload_async(dev_, inputs_.i32() + 2 * (next * mb_ + m) * tokens_, h,
                    2 * static_cast<size_t>(tokens_) * sizeof(int32_t));
  ++next_count_;
}

const int32_t* DeviceBatches::ids(int64_t m) const { return inputs_.i32() + 2 * (cur_ * mb_ + m) * tokens_; }
const int32_t* DeviceBatches::targets(int64_t m) const { return ids(m) + tokens_; }

void DeviceBatches::begin_step() {
  if (!next_ready())
    throw std::logic_error("DeviceBatches::begin_step: " + std::to_string(next_count_) + " of " + std::to_string(mb_) +
                           " micro-batches uploaded");
  cur_ = 1 - cur_;
  next_count_ = 0;
  dev::uploads_ready(dev_);
  dev::zero(dev_, loss_acc_.raw(), loss_acc_.nbytes());
  model_.set_loss_sink(loss_acc_.f32());
}

double* DeviceBatches::norm_slot() { return static_cast<double*>(scalars_.raw()) + 1; }

void DeviceBatches::finish_step() {
  model_.set_loss_sink(nullptr);
  model_.kernels().sum_to(static_cast<double*>(scalars_.raw()), loss_acc_.f32(), tokens_);
}

void DeviceBatches::read_step(double* loss, double* norm_sq) {
  double s[2];
  dev::copy_to_host(dev_, s, scalars_.raw(), sizeof s);
  *loss = s[0] / static_cast<double>(tokens_);
  *norm_sq = s[1];
}

double DeviceBatches::end_step() {
  model_.set_loss_sink(nullptr);
  return model_.kernels().sum(loss_acc_.f32(), tokens_) / static_cast<double>(tokens_);
}

}  // namespace mt
