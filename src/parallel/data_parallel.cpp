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
    if (!model_.owns_unit(u)) continue;  // another pipeline stage's unit
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
  reset();
}

void DataParallel::reset() {
  std::fill(unit_done_.begin(), unit_done_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = b.last_unit - b.first_unit + 1;
    for (int u = b.first_unit; u <= b.last_unit; ++u) b.pending -= model_.owns_unit(u) ? 0 : 1;
    b.work.reset();
  }
}

void DataParallel::set_sync(bool sync) { sync_ = sync; }

void DataParallel::post_backward(int unit) {
  // Only the synchronising backward counts: each unit runs it once per step (with a pipeline, the
  // last micro-batch of the unit's stage), and its bucket starts when every unit in it is done.
  if (!sync_) return;
  unit_done_[unit] = 1;
  Bucket& b = buckets_[bucket_of_unit_[unit]];
  if (--b.pending == 0 && dp_->size() > 1) launch(b);
}

void DataParallel::launch(Bucket& b) {
  float* g = model_.grads().f32() + b.offset;
  b.work = dp_->all_reduce(g, static_cast<size_t>(b.numel), DType::F32, comm::ReduceOp::Avg);
}

DdpStepStats DataParallel::finish() {
  DdpStepStats st;
  if (!sync_) return st;
  std::string missing;
  for (int u = 0; u < model_.num_units(); ++u)
    if (model_.owns_unit(u) && !unit_done_[u]) missing += (missing.empty() ? "" : ", ") + model_.unit(u).name;
  if (!missing.empty())
    throw std::runtime_error("DDP: backward finished without producing gradients for unit(s) " + missing +
                             " on rank " + std::to_string(dp_->rank()) +
                             "; their buckets were never reduced (every unit must take part in the loss)");
  if (dp_->size() == 1) {
    reset();
    return st;
  }
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_)
    if (b.work) b.work->wait();
  st.exposed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (auto& b : buckets_)
    if (b.work) {
      st.comm_ms += b.work->elapsed_ms();
      ++st.buckets;
    }
  reset();
  return st;
}

}  // namespace mt::parallel
