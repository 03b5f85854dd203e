#include "parallel/offload.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels/backend.h"
#include "runtime/host_transfer.h"

namespace mt::parallel {

ModelStorage offload_model_storage() { return ModelStorage{.weights = true, .master = false, .grads = true}; }

StateBytes offload_host_bytes(DType compute, int64_t flat) {
  // fp32 master + two fp32 moments; fp32 gradient copies; in bf16 the rounded upload copy.
  return {compute == DType::BF16 ? 2 * flat : 0, 4 * flat, 12 * flat};
}

namespace {

// One page-locked host buffer of n elements of T, counted in the pinned tracker. On Meta (a dry
// run) it is counted only: no memory behind it.
template <class T>
class PinnedBuffer {
 public:
  PinnedBuffer(Device d, int64_t n, MemCategory c) : dev_(d), bytes_(static_cast<size_t>(n) * sizeof(T)), cat_(c) {
    if (n == 0) return;
    if (d != Device::Meta) {
      p_ = static_cast<T*>(host_alloc_pinned(d, bytes_));
      std::memset(p_, 0, bytes_);
    }
    pinned_memory_tracker().on_alloc(cat_, static_cast<int64_t>(bytes_));
  }
  ~PinnedBuffer() {
    if (bytes_ == 0) return;
    if (p_) host_free_pinned(dev_, p_);
    pinned_memory_tracker().on_free(cat_, static_cast<int64_t>(bytes_));
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  T* get() const { return p_; }

 private:
  Device dev_;
  size_t bytes_;
  MemCategory cat_;
  T* p_ = nullptr;
};

class OffloadHooks final : public UnitHooks {
 public:
  OffloadHooks(Transformer& m, float* host_grads) : model_(m), host_grads_(host_grads) {}
  void set_last(bool last) { last_ = last; }
  // Backward has finished unit u: in the step's last micro-batch its gradients are final (the tied
  // embedding's too: the embedding unit, which also receives the head's part, finishes last).
  void post_backward(int u) override {
    if (!last_ || !host_grads_) return;
    const UnitRange& r = model_.unit(u);
    if (r.numel == 0) return;
    dev::copy_to_host_async(model_.device(), host_grads_ + r.offset, model_.grads().f32() + r.offset,
                            static_cast<size_t>(r.numel) * sizeof(float));
    pending_ = true;
  }
  // Waits for the queued copies (nothing when none is pending).
  void wait() {
    if (!pending_) return;
    dev::wait_copies(model_.device());
    pending_ = false;
  }

 private:
  Transformer& model_;
  float* host_grads_;
  bool last_ = true, pending_ = false;
};

class OffloadStrategy final : public Strategy {
 public:
  OffloadStrategy(Transformer& m, const StrategySpec& spec)
      : model_(m), spec_(spec), dev_(m.device()), bf_(m.compute_dtype() == DType::BF16), F_(m.flat_size()),
        master_(dev_, F_, MemCategory::Optimizer), m_(dev_, F_, MemCategory::Optimizer),
        v_(dev_, F_, MemCategory::Optimizer), grads_(dev_, F_, MemCategory::Grads),
        upload_(dev_, bf_ ? F_ : 0, MemCategory::Params), hooks_(m, grads_.get()), cpu_(kernels::table(Device::CPU)) {
    if (!m.weights().defined() && !bf_) throw std::logic_error("offload: the model has no fp32 weights");
    if (bf_ && !m.compute_weights().defined()) throw std::logic_error("offload: the model has no bf16 weights");
    if (m.expert_weights().defined())
      throw std::invalid_argument("train.offload = optimizer: experts held apart (expert parallelism) are not offloaded");
    spans_.resize(static_cast<size_t>(m.num_units()));
    for (const ParamInfo& p : m.params()) spans_[static_cast<size_t>(p.unit)].push_back(&p);
  }
  const char* name() const override { return to_string(spec_.strategy); }
  UnitHooks* hooks() override { return &hooks_; }

  void load_unit(int u, const float* w, const float* m, const float* v) override {
    const UnitRange& r = model_.unit(u);
    if (r.numel == 0 || dev_ == Device::Meta) return;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    hooks_.wait();
    dev::copy_to_host(dev_, master_.get() + r.offset, w, bytes);
    get_moment(m_.get() + r.offset, m, bytes);
    get_moment(v_.get() + r.offset, v, bytes);
    if (bf_) cpu_.cast_f32_to_bf16(upload_.get() + r.offset, master_.get() + r.offset, r.numel);
    dev::copy_from_host(dev_, device_weights(r), host_weights(r), upload_bytes(r));
  }
  void end_load(int64_t steps) override { step_ = steps; }
  void gather_unit(int u, float* w, float* m, float* v) override {
    const UnitRange& r = model_.unit(u);
    if (r.numel == 0 || dev_ == Device::Meta) return;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    dev::copy_from_host(dev_, w, master_.get() + r.offset, bytes);
    if (m) dev::copy_from_host(dev_, m, m_.get() + r.offset, bytes);
    if (v) dev::copy_from_host(dev_, v, v_.get() + r.offset, bytes);
  }
  OwnedSpan owned_span(int u) const override { return {0, model_.unit(u).numel, 0, 1}; }
  void read_owned(int u, float* w, float* m, float* v) override { gather_unit(u, w, m, v); }
  void write_owned(int u, const float* w, const float* m, const float* v) override { load_unit(u, w, m, v); }
  void end_load_owned(int64_t steps) override { end_load(steps); }
  void begin_microbatch(bool last) override {
    hooks_.wait();  // copies of a step whose optimizer step did not run must not meet its zeroing
    hooks_.set_last(last);
  }
  void finish_backward(StepComm*) override {}
  double grad_norm_sq(const std::vector<double>& weight) override {
    // On the device, while the gradients travel to the host (as DDP computes it without offload).
    if (dev_ == Device::CUDA && std::all_of(weight.begin(), weight.end(), [](double w) { return w == 1.0; }))
      return model_.kernels().sum_squares(model_.grads().f32(), F_);
    double s = 0;
    for (size_t i = 0; i < model_.params().size(); ++i) {
      const ParamInfo& p = model_.params()[i];
      s += (weight.empty() ? 1.0 : weight[i]) * model_.kernels().sum_squares(model_.grads().f32() + p.offset, p.numel);
    }
    return s;
  }
  void optimizer_step(double lr, float scale, StepComm*) override {
    hooks_.wait();
    ++step_;
    if (dev_ == Device::Meta) return;  // a dry run: the state is counted, not held
    const AdamWConfig& a = spec_.adam;
    for (int u = 0; u < model_.num_units(); ++u) {
      const UnitRange& r = model_.unit(u);
      if (r.numel == 0) continue;
      for (const ParamInfo* p : spans_[static_cast<size_t>(u)])
        cpu_.adamw_update(master_.get() + p->offset, grads_.get() + p->offset, m_.get() + p->offset,
                          v_.get() + p->offset, p->numel, static_cast<float>(lr), static_cast<float>(a.beta1),
                          static_cast<float>(a.beta2), static_cast<float>(a.eps),
                          p->decay ? static_cast<float>(a.weight_decay) : 0.0f, step_, scale,
                          bf_ ? upload_.get() + p->offset : nullptr);
      // This unit's weights go back while the CPU updates the next: queued on the compute stream,
      // so the next forward reads them; the host buffer changes again only in the next step,
      // after the step's loss read has waited for that stream.
      dev::copy_from_host_async(dev_, device_weights(r), host_weights(r), upload_bytes(r));
    }
    model_.zero_grads();
  }
  void with_full_unit(int u, const std::function<void(const void*)>& f) override { f(model_.unit_compute_weights(u)); }
  int64_t adam_steps() const override { return step_; }

 private:
  void get_moment(float* host, const float* src, size_t bytes) {
    if (src) dev::copy_to_host(dev_, host, src, bytes);
    else std::memset(host, 0, bytes);
  }
  void* device_weights(const UnitRange& r) {
    Tensor& w = model_.compute_weights();
    return static_cast<char*>(w.raw()) + static_cast<size_t>(r.offset) * dtype_size(w.dtype());
  }
  const void* host_weights(const UnitRange& r) const {
    return bf_ ? static_cast<const void*>(upload_.get() + r.offset) : static_cast<const void*>(master_.get() + r.offset);
  }
  size_t upload_bytes(const UnitRange& r) const {
    return static_cast<size_t>(r.numel) * (bf_ ? sizeof(bf16) : sizeof(float));
  }

  Transformer& model_;
  StrategySpec spec_;
  Device dev_;
  bool bf_;
  int64_t F_;
  PinnedBuffer<float> master_, m_, v_, grads_;
  PinnedBuffer<bf16> upload_;
  OffloadHooks hooks_;
  const kernels::KernelTable& cpu_;
  std::vector<std::vector<const ParamInfo*>> spans_;  // per unit, its parameters
  int64_t step_ = 0;
};

}  // namespace

std::unique_ptr<Strategy> make_offload_strategy(const StrategySpec& spec, Transformer& model,
                                                std::shared_ptr<comm::ProcessGroup> dp) {
  if (dp->size() != 1)
    throw std::invalid_argument("train.offload = optimizer runs on one rank (one GPU) so far; this job has " +
                                std::to_string(dp->size()) + " data-parallel ranks");
  return std::make_unique<OffloadStrategy>(model, spec);
}

}  // namespace mt::parallel
