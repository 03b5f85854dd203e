#include "parallel/data_parallel.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

namespace mt::parallel {

DataParallel::DataParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> dp, double bucket_mb,
                           double first_bucket_mb)
    : model_(model), dp_(std::move(dp)) {
  if (bucket_mb <= 0) throw std::invalid_argument("parallel.bucket_mb must be positive");
  const int U = model_.num_units();
  bucket_of_unit_.assign(U, -1);
  unit_done_.assign(U, 0);
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1e6 / sizeof(float));
  const int64_t first_cap = static_cast<int64_t>(std::min(first_bucket_mb, bucket_mb) * 1e6 / sizeof(float));
  // Walk units from the last (first to finish backward) to the first.
  for (int u = U - 1; u >= 0; --u) {
    const UnitRange& r = model_.unit(u);
    // The open bucket is buckets_.back(); bucket 0 (the first to be reduced) has the small cap.
    bool fits = !buckets_.empty() && buckets_.back().numel + r.numel <= (buckets_.size() == 1 ? first_cap : cap);
    if (!fits) {
      Bucket b;
      b.first_unit = b.last_unit = u;
      b.offset = r.offset;
      b.numel = r.numel;
      buckets_.push_back(b);
    } else {
      Bucket& b = buckets_.back();
      b.first_unit = u;
      b.offset = r.offset;
      b.numel += r.numel;
    }
    bucket_of_unit_[u] = static_cast<int>(buckets_.size()) - 1;
  }
}

void DataParallel::verify_and_broadcast() {
  // Fingerprint: parameter count, unit count and each unit's size, as floats (exact below 2^24
  // per entry would not hold for big models, so split each count in 16-bit halves).
  std::vector<float> mine;
  auto push = [&](int64_t v) {
    mine.push_back(static_cast<float>(v & 0xffff));
    mine.push_back(static_cast<float>((v >> 16) & 0xffff));
    mine.push_back(static_cast<float>((v >> 32) & 0xffff));
  };
  push(model_.num_params());
  push(model_.num_units());
  for (int u = 0; u < model_.num_units(); ++u) push(model_.unit(u).numel);
  // Ranks with a different number of units would call the all-gather with different sizes:
  // exchange the length first.
  std::vector<float> lens(dp_->size());
  float len = static_cast<float>(mine.size());
  dp_->all_gather(&len, lens.data(), 1, DType::F32)->wait();
  for (int r = 0; r < dp_->size(); ++r)
    if (lens[r] != len)
      throw std::runtime_error("data-parallel rank " + std::to_string(r) + " built a model with " +
                               std::to_string(static_cast<int>(lens[r] / 3) - 2) + " units, rank " +
                               std::to_string(dp_->rank()) + " has " + std::to_string(model_.num_units()) +
                               ": every rank must use the same model config");
  std::vector<float> all(mine.size() * dp_->size());
  dp_->all_gather(mine.data(), all.data(), mine.size(), DType::F32)->wait();
  for (int r = 0; r < dp_->size(); ++r) {
    const float* o = all.data() + r * mine.size();
    for (size_t i = 0; i < mine.size(); ++i)
      if (o[i] != mine[i]) {
        std::string what = i < 3 ? "parameter count" : i < 6 ? "unit count" : "size of unit " + model_.unit(int((i - 6) / 3)).name;
        throw std::runtime_error("data-parallel rank " + std::to_string(r) + " and rank " + std::to_string(dp_->rank()) +
                                 " built different models (" + what + " differs): every rank must use the same model config");
      }
  }
  dp_->broadcast(model_.weights().f32(), static_cast<size_t>(model_.flat_size()), DType::F32, 0)->wait();
  model_.sync_compute_weights();
}

void DataParallel::set_sync(bool sync) { sync_ = sync; }

void DataParallel::pre_backward(int unit) {
  if (unit == model_.num_units() - 1) {  // the head: backward of a micro-batch begins
    std::fill(unit_done_.begin(), unit_done_.end(), 0);
    for (auto& b : buckets_) {
      b.pending = b.last_unit - b.first_unit + 1;
      b.work.reset();
    }
  }
}

void DataParallel::post_backward(int unit) {
  unit_done_[unit] = 1;
  Bucket& b = buckets_[bucket_of_unit_[unit]];
  if (--b.pending == 0 && sync_ && dp_->size() > 1) launch(b);
}

void DataParallel::launch(Bucket& b) {
  float* g = model_.grads().f32() + b.offset;
  b.work = dp_->all_reduce(g, static_cast<size_t>(b.numel), DType::F32, comm::ReduceOp::Avg);
}

DdpStepStats DataParallel::finish() {
  DdpStepStats st;
  std::string missing;
  for (int u = 0; u < model_.num_units(); ++u)
    if (!unit_done_[u]) missing += (missing.empty() ? "" : ", ") + model_.unit(u).name;
  if (!missing.empty())
    throw std::runtime_error("DDP: backward finished without producing gradients for unit(s) " + missing +
                             " on rank " + std::to_string(dp_->rank()) +
                             "; their buckets were never reduced (every unit must take part in the loss)");
  if (!sync_ || dp_->size() == 1) return st;
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_)
    if (b.work) b.work->wait();
  st.exposed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (auto& b : buckets_)
    if (b.work) {
      st.comm_ms += b.work->elapsed_ms();
      ++st.buckets;
    }
  return st;
}

}  // namespace mt::parallel
