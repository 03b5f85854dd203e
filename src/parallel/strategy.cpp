#include "parallel/strategy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "kernels/backend.h"
#include "parallel/data_parallel.h"
#include "parallel/sharded_data_parallel.h"

namespace mt::parallel {

namespace {

// DDP: full replicas, bucketed all-reduce overlapped with backward, AdamW on the whole model.
class DdpStrategy final : public Strategy {
 public:
  DdpStrategy(Transformer& m, std::shared_ptr<comm::ProcessGroup> dp, const StrategySpec& spec)
      : model_(m), dp_(std::move(dp)), ddp_(m, dp_, spec.bucket_mb),
        adam_(AdamW::full_spans(m.params()), m.flat_size(), spec.adam) {}
  const char* name() const override { return to_string(ShardingStrategy::NoShard); }
  UnitHooks* hooks() override { return &ddp_; }
  void load_unit(int u, const float* w, const float* m, const float* v) override {
    const UnitRange& r = model_.unit(u);
    if (r.numel == 0) return;
    dev::copy(model_.device(), model_.weights().f32() + r.offset, w, static_cast<size_t>(r.numel) * sizeof(float));
    put(adam_.exp_avg(), r, m);
    put(adam_.exp_avg_sq(), r, v);
  }
  void end_load(int64_t steps) override {
    adam_.set_step_count(steps);
    // Like torch DDP: rank 0's weights everywhere (identical already when every rank loaded the same).
    if (dp_->size() > 1)
      dp_->broadcast(model_.weights().f32(), static_cast<size_t>(model_.flat_size()), DType::F32, 0)->wait();
    model_.sync_compute_weights();
  }
  void gather_unit(int u, float* w, float* m, float* v) override {
    const UnitRange& r = model_.unit(u);
    if (r.numel == 0) return;
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    const Device d = model_.device();
    dev::copy(d, w, model_.weights().f32() + r.offset, bytes);
    if (m) dev::copy(d, m, adam_.exp_avg().f32() + r.offset, bytes);
    if (v) dev::copy(d, v, adam_.exp_avg_sq().f32() + r.offset, bytes);
  }
  OwnedSpan owned_span(int u) const override {
    return {0, model_.unit(u).numel, dp_->rank(), dp_->size()};
  }
  void read_owned(int u, float* w, float* m, float* v) override { gather_unit(u, w, m, v); }
  void write_owned(int u, const float* w, const float* m, const float* v) override { load_unit(u, w, m, v); }
  void end_load_owned(int64_t steps) override { end_load(steps); }
  void begin_microbatch(bool last) override { ddp_.set_sync(last); }
  void finish_backward(StepComm* c) override {
    DdpStepStats s = ddp_.finish();
    c->comm_ms += s.comm_ms;
    c->exposed_ms += s.exposed_ms;
  }
  double grad_norm_sq(const std::vector<double>& weight) override {
    // On a GPU, with every parameter weighted alike, one reduction over the whole gradient buffer
    // (padding holds zeros): one read from the device instead of one per parameter.
    if (model_.device() == Device::CUDA && std::all_of(weight.begin(), weight.end(), [](double w) { return w == 1.0; }))
      return model_.kernels().sum_squares(model_.grads().f32(), model_.flat_size());
    double s = 0;
    for (size_t i = 0; i < model_.params().size(); ++i) {
      const ParamInfo& p = model_.params()[i];
      s += (weight.empty() ? 1.0 : weight[i]) * model_.kernels().sum_squares(model_.grads().f32() + p.offset, p.numel);
    }
    return s;
  }
  bool grad_norm_sq_to(double* norm_sq, const std::vector<double>& weight) override {
    if (model_.device() != Device::CUDA || !std::all_of(weight.begin(), weight.end(), [](double w) { return w == 1.0; }))
      return false;
    model_.kernels().sum_squares_to(norm_sq, model_.grads().f32(), model_.flat_size());
    return true;
  }
  void optimizer_step(double lr, float scale, StepComm*) override { step(lr, scale, nullptr, 0.0); }
  void optimizer_step_clipped(double lr, const double* norm_sq, double clip_max, StepComm*) override {
    step(lr, 1.0f, norm_sq, clip_max);
  }
  int64_t adam_steps() const override { return adam_.step_count(); }
  void with_full_unit(int u, const std::function<void(const void*)>& f) override { f(model_.unit_compute_weights(u)); }

 private:
  void step(double lr, float scale, const double* norm_sq, double clip_max) {
    // bf16: the compute copy is refreshed by the update itself (padding, in no span, never changes).
    const bool bf = model_.compute_dtype() == DType::BF16;
    adam_.step(model_.weights().f32(), model_.grads().f32(), lr, scale, false, false,
               bf ? model_.compute_weights().bf() : nullptr, norm_sq, clip_max);
    model_.zero_grads();
  }
  static void put(Tensor& t, const UnitRange& r, const float* src) {
    const size_t bytes = static_cast<size_t>(r.numel) * sizeof(float);
    if (src) dev::copy(t.device(), t.f32() + r.offset, src, bytes);
    else dev::zero(t.device(), t.f32() + r.offset, bytes);
  }
  Transformer& model_;
  std::shared_ptr<comm::ProcessGroup> dp_;
  DataParallel ddp_;
  AdamW adam_;
};

class ShardedStrategy final : public Strategy {
 public:
  ShardedStrategy(Transformer& m, std::shared_ptr<comm::ProcessGroup> shard,
                  std::shared_ptr<comm::ProcessGroup> replicate, std::shared_ptr<comm::ProcessGroup> norm,
                  ShardOptions o, AdamWConfig adam)
      : sdp_(m, std::move(shard), std::move(replicate), std::move(norm), o, adam) {}
  const char* name() const override { return to_string(sdp_.strategy()); }
  UnitHooks* hooks() override { return &sdp_; }
  void begin_load() override { sdp_.release_all(); }
  void load_unit(int u, const float* w, const float* m, const float* v) override { sdp_.load_unit(u, w, m, v); }
  void end_load(int64_t steps) override { sdp_.optimizer().set_step_count(steps); }
  void gather_unit(int u, float* w, float* m, float* v) override { sdp_.gather_unit(u, w, m, v); }
  OwnedSpan owned_span(int u) const override {
    const int64_t n = sdp_.unit_shard(u);
    return {sdp_.shard_rank() * n, (sdp_.shard_rank() + 1) * n, sdp_.replicate_rank(), sdp_.replicas()};
  }
  void read_owned(int u, float* w, float* m, float* v) override { sdp_.read_owned(u, w, m, v); }
  void write_owned(int u, const float* w, const float* m, const float* v) override { sdp_.write_owned(u, w, m, v); }
  void end_load_owned(int64_t steps) override {
    sdp_.optimizer().set_step_count(steps);
    sdp_.finish_owned_load();
  }
  void begin_microbatch(bool last) override { sdp_.begin_microbatch(last); }
  void finish_backward(StepComm*) override { sdp_.finish_backward(); }
  double grad_norm_sq(const std::vector<double>& weight) override { return sdp_.grad_norm_sq(weight); }
  bool grad_norm_sq_to(double* norm_sq, const std::vector<double>& weight) override {
    return sdp_.grad_norm_sq_to(norm_sq, weight);
  }
  void optimizer_step(double lr, float scale, StepComm* c) override {
    ShardStepStats s;
    sdp_.optimizer_step(lr, scale, &s);
    c->comm_ms += s.comm_ms;
    c->exposed_ms += s.exposed_ms;
  }
  void optimizer_step_clipped(double lr, const double* norm_sq, double clip_max, StepComm* c) override {
    ShardStepStats s;
    sdp_.optimizer_step(lr, 1.0f, &s, norm_sq, clip_max);
    c->comm_ms += s.comm_ms;
    c->exposed_ms += s.exposed_ms;
  }
  void after_eval() override { sdp_.release_all(); }
  void with_full_unit(int u, const std::function<void(const void*)>& f) override { sdp_.with_full_unit(u, f); }
  int64_t adam_steps() const override { return const_cast<ShardedDataParallel&>(sdp_).optimizer().step_count(); }
  ShardedDataParallel& sdp() { return sdp_; }

 private:
  ShardedDataParallel sdp_;
};

}  // namespace

ModelStorage model_storage(const StrategySpec& spec, DType compute, int shard_size) {
  if (!is_sharded(spec.strategy)) return ModelStorage{};
  return ShardedDataParallel::storage_for(spec.strategy, compute, shard_size);
}

void Strategy::optimizer_step_clipped(double, const double*, double, StepComm*) {
  throw std::logic_error(std::string("strategy ") + name() + " has no device-side clipping (grad_norm_sq_to said no)");
}

std::unique_ptr<Strategy> make_strategy(const StrategySpec& spec, Transformer& model,
                                        std::shared_ptr<comm::ProcessGroup> dp,
                                        std::shared_ptr<comm::ProcessGroup> shard,
                                        std::shared_ptr<comm::ProcessGroup> replicate,
                                        std::shared_ptr<comm::ProcessGroup> norm) {
  if (!is_sharded(spec.strategy)) return std::make_unique<DdpStrategy>(model, dp, spec);
  ShardOptions o;
  o.strategy = spec.strategy;
  o.reshard_after_forward = spec.reshard_after_forward;
  o.prefetch = spec.prefetch;
  o.reduce_every_microbatch = spec.reduce_every_microbatch;
  return std::make_unique<ShardedStrategy>(model, shard, replicate, norm, o, spec.adam);
}

StateBytes expected_state_bytes(ShardingStrategy strategy, DType compute, int64_t flat, int shard_size) {
  const int64_t N = shard_size;
  const bool f32 = compute == DType::F32;
  const int64_t pb = f32 ? 4 : 2, ob = f32 ? 8 : 12;  // bf16: fp32 master lives with the moments
  StateBytes b;
  if (!is_sharded(strategy)) {
    b = {pb * flat, 4 * flat, ob * flat};
  } else if (!shards_gradients(strategy)) {  // ZERO1
    b = {pb * flat, 4 * flat, ob * flat / N};
  } else if (!shards_parameters(strategy)) {  // SHARD_GRAD_OP, HYBRID_SHARD_ZERO2
    b = {pb * flat, 4 * flat / N, ob * flat / N};
  } else {  // FULL_SHARD, HYBRID_SHARD: only shards persist (fp32 master counted as params in fp32)
    b = f32 ? StateBytes{4 * flat / N, 4 * flat / N, 8 * flat / N} : StateBytes{0, 4 * flat / N, 12 * flat / N};
  }
  return b;
}

int64_t zero_paper_bytes(ShardingStrategy strategy, int64_t P, int shard_size) {
  const int64_t N = shard_size;
  if (!is_sharded(strategy)) return 16 * P;
  if (!shards_gradients(strategy)) return 4 * P + 12 * P / N;   // ZERO1
  if (!shards_parameters(strategy)) return 2 * P + 14 * P / N;  // SHARD_GRAD_OP, HYBRID_SHARD_ZERO2
  return 16 * P / N;
}

void verify_same_model(const Transformer& model, comm::ProcessGroup& group) {
  if (group.size() == 1) return;
  // Fingerprint: parameter count, unit count and unit sizes.
  std::vector<int64_t> mine = {model.num_params(), model.num_units()};
  for (int u = 0; u < model.num_units(); ++u) mine.push_back(model.unit(u).numel);
  // Ranks with different unit counts would disagree on the size of the gather: lengths first.
  std::vector<int64_t> lens(group.size());
  const int64_t len = static_cast<int64_t>(mine.size());
  group.all_gather(&len, lens.data(), 1, DType::I64)->wait();
  for (int r = 0; r < group.size(); ++r)
    if (lens[r] != len)
      throw std::runtime_error("data-parallel rank " + std::to_string(r) + " built a model with " +
                               std::to_string(lens[r] - 2) + " units, rank " +
                               std::to_string(group.rank()) + " has " + std::to_string(model.num_units()) +
                               ": every rank must use the same model config");
  std::vector<int64_t> all(mine.size() * group.size());
  group.all_gather(mine.data(), all.data(), mine.size(), DType::I64)->wait();
  for (int r = 0; r < group.size(); ++r)
    for (size_t i = 0; i < mine.size(); ++i)
      if (all[r * mine.size() + i] != mine[i]) {
        std::string what = i == 0 ? "parameter count" : i == 1 ? "unit count" : "size of unit " + model.unit(int(i - 2)).name;
        throw std::runtime_error("data-parallel rank " + std::to_string(r) + " and rank " + std::to_string(group.rank()) +
                                 " built different models (" + what + " differs): every rank must use the same model config");
      }
}

}  // namespace mt::parallel
