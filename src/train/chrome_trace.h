// A Chrome trace (the JSON "Trace Event Format" that Perfetto and chrome://tracing open) of one
// rank: complete events for every unit's forward and backward, optimizer steps, evaluations.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "model/transformer.h"

namespace mt {

class ChromeTrace {
 public:
  // `path` empty: disabled. The rank is inserted before the extension ("t.json" -> "t.rank1.json").
  ChromeTrace(const std::string& path, int rank);
  bool enabled() const { return !path_.empty(); }
  void begin(const std::string& name, const char* category);
  void end();
  // Writes the file (also on destruction).
  void flush();
  ~ChromeTrace();
  static std::string rank_path(const std::string& path, int rank);

 private:
  struct Event {
    std::string name;
    const char* cat;
    int64_t ts_us, dur_us;
  };
  int64_t now_us() const;
  std::string path_;
  int rank_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Event> events_;
  std::vector<size_t> open_;
};

// Records each unit's forward and backward around another set of hooks (the strategy's): the span
// starts after the inner pre-hook (which may wait for a gather) and ends before the post-hook.
class TracingHooks final : public UnitHooks {
 public:
  TracingHooks(UnitHooks* inner, ChromeTrace* trace, const Transformer* model)
      : inner_(inner), trace_(trace), model_(model) {}
  void pre_forward(int u) override;
  void post_forward(int u) override;
  void pre_backward(int u) override;
  void post_backward(int u) override;
  void pre_weights(int u) override {
    if (inner_) inner_->pre_weights(u);
  }
  bool takes_sparse_grad(int p) override { return inner_ && inner_->takes_sparse_grad(p); }
  void sparse_grad(int p, const int32_t* ids, const float* rows, int64_t n) override {
    inner_->sparse_grad(p, ids, rows, n);
  }
  int64_t grad_ready_rows(int p) override { return inner_ ? inner_->grad_ready_rows(p) : 0; }
  void grad_ready(int p, int64_t r0, int64_t r1) override { inner_->grad_ready(p, r0, r1); }

 private:
  UnitHooks* inner_;
  ChromeTrace* trace_;
  const Transformer* model_;
};

}  // namespace mt
