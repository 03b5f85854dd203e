#include "parallel/pipeline_executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <stdexcept>

#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "runtime/clock.h"

namespace mt::parallel {

PipelineWindow pipeline_window(comm::ProcessGroup* pp, double span_ms, double mean_busy_ms) {
  float window = static_cast<float>(span_ms);
  if (pp) pp->all_reduce(&window, 1, DType::F32, comm::ReduceOp::Max)->wait();
  PipelineWindow w;
  w.window_ms = window;
  w.idle_ms = std::max(0.0, w.window_ms - mean_busy_ms);
  return w;
}

namespace {
// Message kinds (part of the tag, so a message is matched by what it is, not by posting order).
enum MsgKind { kAct = 0, kGrad = 1, kTiedGrad = 2, kTiedWeights = 3 };
// Tags stay within MPI's guaranteed 15 bits: kind (2) | chunk = stage / pp (3) | micro-batch (10);
// the pair of ranks and the direction determine the rest of the stage.
constexpr int kMaxChunks = 8, kMaxMicrobatches = 1024;
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}
// MESHTRAIN_PP_TRACE=PREFIX: each training step appends the times of this rank's actions and
// messages to PREFIX.rank<R>, one event a line - "KIND KEY T0 T1 ISSUED STARTED DONE", steady-clock
// nanoseconds (the same clock in every process of a machine): F / B / W (KEY = micro-batch; T0..T1
// the compute; ISSUED = the stage), wait / tiedwait (a receive waited for; KEY = message tag),
// stash (a send's copy), psend / precv (posting), send / recv (ISSUED, STARTED on the
// communication thread, DONE), tiedsend, step (the step's span), finish (the strategy's
// finish_backward); "END" closes a step. A dry run's steps (meta device) are not written.
// bench/pipeline_trace.py summarises them.
struct TraceEvent {
  const char* kind;
  int key;
  int64_t t0, t1, issued = 0, started = 0, done = 0;
};
}  // namespace

// ---- executor -------------------------------------------------------------------------------

PipelineExecutor::PipelineExecutor(Transformer& model, PipeSchedule schedule, StagePartition partition,
                                   std::shared_ptr<comm::ProcessGroup> pp, Strategy* strategy)
    : model_(model), sched_(std::move(schedule)), part_(std::move(partition)), pp_(std::move(pp)),
      strategy_(strategy) {
  rank_ = pp_->rank();
  S_ = sched_.num_stages();
  head_unit_ = model_.num_units() - 1;
  if (pp_->size() != sched_.pp)
    throw std::invalid_argument("pipeline schedule for " + std::to_string(sched_.pp) + " ranks on a pp group of " +
                                std::to_string(pp_->size()));
  if (static_cast<int>(part_.stages.size()) != S_)
    throw std::invalid_argument("stage partition has " + std::to_string(part_.stages.size()) + " stages, schedule " +
                                std::to_string(S_));
  if (sched_.virtual_stages > kMaxChunks || sched_.microbatches > kMaxMicrobatches)
    throw std::invalid_argument("pipeline: at most " + std::to_string(kMaxChunks) + " virtual stages per rank and " +
                                std::to_string(kMaxMicrobatches) + " micro-batches per step");
  ScheduleCheck chk = check_schedule(sched_);
  if (!chk.ok) throw std::invalid_argument("pipeline schedule '" + sched_.name + "' fails its check: " + chk.message);
  tied_split_ = model_.config().tied_embeddings && sched_.stage_rank(0) != sched_.stage_rank(S_ - 1);
  if (tied_split_ && rank_ == sched_.stage_rank(0))
    tied_grad_in_ = Tensor::zeros({model_.params()[0].numel}, DType::F32, MemCategory::Grads);  // the token embedding
}

bool PipelineExecutor::replace_schedule(PipeSchedule s) {
  if (s.pp != sched_.pp || s.num_stages() != S_ || s.microbatches != sched_.microbatches ||
      s.split_backward != sched_.split_backward || s.vshape != sched_.vshape || !slot_of_.empty())
    return false;
  for (int st = 0; st < S_; ++st)
    if (s.stage_rank(st) != sched_.stage_rank(st)) return false;
  if (!check_schedule(s).ok) return false;
  sched_ = std::move(s);
  return true;
}

int PipelineExecutor::tag(int kind, int m, int s) const { return (kind << 13) | ((s / sched_.pp) << 10) | m; }

int PipelineExecutor::acquire_slot(int m, int s) {
  const int key = m * S_ + s;
  auto it = slot_of_.find(key);
  if (it != slot_of_.end()) return it->second;
  // Slots are pooled per chunk (s / pp): a slot keeps the buffers of the units it ran, so reusing
  // it for the same chunk allocates nothing new.
  auto& pool = free_slots_[s / sched_.pp];
  int slot;
  if (!pool.empty()) {
    slot = pool.back();
    pool.pop_back();
  } else {
    slot = slots_made_++;
  }
  slot_of_[key] = slot;
  peak_slots_ = std::max(peak_slots_, ++slots_used_);
  return slot;
}

void PipelineExecutor::release_slot(int m, int s) {
  auto it = slot_of_.find(m * S_ + s);
  if (it == slot_of_.end()) return;
  free_slots_[s / sched_.pp].push_back(it->second);
  slot_of_.erase(it);
  --slots_used_;
}

PipelineStepStats PipelineExecutor::train_step(const std::vector<const int32_t*>& ids,
                                               const std::vector<const int32_t*>& targets, int64_t B, int64_t T,
                                               float dloss, StepComm* comm, const std::vector<int64_t>* lengths) {
  const int M = sched_.microbatches;
  if (static_cast<int>(ids.size()) != M || static_cast<int>(targets.size()) != M)
    throw std::invalid_argument("pipeline step needs one batch per micro-batch (" + std::to_string(M) + ")");
  if (lengths && static_cast<int>(lengths->size()) != M)
    throw std::invalid_argument("pipeline step needs one length per micro-batch (" + std::to_string(M) + ")");
  auto T_of = [&](int m) { return lengths ? (*lengths)[static_cast<size_t>(m)] : T; };
  // A stage boundary's rows of micro-batch m.
  auto NC_of = [&](int m) { return model_.residual_rows(B * T_of(m)) * model_.config().n_embd; };
  // The micro-batch of a message key (tag() below).
  auto mb_of = [&](int key) { return key & 1023; };
  PipelineStepStats st;
  st.f_ms.assign(static_cast<size_t>(S_), 0.0);
  st.b_ms.assign(static_cast<size_t>(S_), 0.0);
  st.w_ms.assign(static_cast<size_t>(S_), 0.0);
  st.f_cpu_ms = st.b_cpu_ms = st.w_cpu_ms = st.w_ms;
  peak_slots_ = slots_used_;
  // Messages in flight, by (kind, micro-batch, stage): receive buffers and handles, send buffers.
  struct Msg {
    Tensor buf;
    comm::WorkHandle work;
  };
  std::map<int, Msg> recvs, sends;
  static const char* trace_env = std::getenv("MESHTRAIN_PP_TRACE");
  const char* trace_path = model_.device() == Device::Meta ? nullptr : trace_env;  // not the dry run's step
  std::vector<TraceEvent> trace;
  std::vector<std::pair<const char*, std::pair<int, comm::WorkHandle>>> traced_msgs;
  auto rec = [&](const char* kind, int key, int64_t t0, int64_t t1, int64_t stage = 0) {
    if (trace_path) trace.push_back({kind, key, t0, t1, stage});
  };
  auto rec_msg = [&](const char* kind, int key, const comm::WorkHandle& w) {
    if (trace_path) traced_msgs.push_back({kind, {key, w}});
  };
  const int first_rank = sched_.stage_rank(0), last_rank = sched_.stage_rank(S_ - 1);
  auto t_start = Clock::now();
  auto wait_recv = [&](int key) -> const float* {
    auto it = recvs.find(key);
    if (it == recvs.end()) throw std::logic_error("pipeline: compute before its receive was posted");
    if (!it->second.work) return it->second.buf.f32();  // a hand-off between two stages of this rank
    auto t0 = Clock::now();
    it->second.work->wait();
    st.wait_ms += ms_between(t0, Clock::now());
    rec("wait", key, ns_of(t0), now_ns());
    return it->second.buf.f32();
  };
  // A copy of `src` (a stage boundary's rows) kept until its send completes.
  auto stash = [&](int key, const float* src) -> Msg& {
    const int64_t NC = NC_of(mb_of(key));
    const int64_t tt = now_ns();
    Msg& msg = sends[key];
    msg.buf = Tensor::empty({NC}, DType::F32, MemCategory::Comm);
    dev::copy(model_.device(), msg.buf.f32(), src, static_cast<size_t>(NC) * sizeof(float));
    rec("stash", key, tt, now_ns());
    return msg;
  };
  auto post_recv = [&](int key, int peer) {
    const int64_t NC = NC_of(mb_of(key));
    const int64_t tt = now_ns();
    Msg& msg = recvs[key];
    msg.buf = Tensor::empty({NC}, DType::F32, MemCategory::Comm);
    msg.work = pp_->recv(msg.buf.f32(), static_cast<size_t>(NC), DType::F32, peer, key);
    rec("precv", key, tt, now_ns());
    rec_msg("recv", key, msg.work);
  };
  // A hand-off between two stages on this rank (the turn of a V): kept as an arrived message.
  auto keep_local = [&](int key, const float* src) {
    const int64_t NC = NC_of(mb_of(key));
    Msg& msg = recvs[key];
    msg.buf = Tensor::empty({NC}, DType::F32, MemCategory::Comm);
    dev::copy(model_.device(), msg.buf.f32(), src, static_cast<size_t>(NC) * sizeof(float));
  };
  const bool split = sched_.split_backward;
  // The head's summed contribution to a tied embedding's gradient: sent by the last stage once its
  // last weight gradient is complete, received by the first stage before it needs it.
  auto send_tied_grad = [&]() {
    Tensor& g = model_.tied_replica_grad();
    Msg& msg = sends[tag(kTiedGrad, 0, 0)];
    msg.work = pp_->send(g.f32(), static_cast<size_t>(g.numel()), DType::F32, first_rank, tag(kTiedGrad, 0, 0));
    rec("tiedsend", 0, now_ns(), now_ns());
    rec_msg("send", tag(kTiedGrad, 0, 0), msg.work);
  };
  comm::WorkHandle tied_recv;  // split backward: posted with the first stage's last B
  auto post_tied_recv = [&]() {
    tied_recv = pp_->recv(tied_grad_in_.f32(), static_cast<size_t>(tied_grad_in_.numel()), DType::F32, last_rank,
                          tag(kTiedGrad, 0, 0));
    rec_msg("recv", tag(kTiedGrad, 0, 0), tied_recv);
  };
  auto recv_tied_grad = [&]() {
    if (!tied_recv) post_tied_recv();
    auto t0 = Clock::now();
    tied_recv->wait();
    tied_recv.reset();
    st.wait_ms += ms_between(t0, Clock::now());
    rec("tiedwait", tag(kTiedGrad, 0, 0), ns_of(t0), now_ns());
  };
  auto post_send = [&](int key, int peer) {
    Msg& msg = sends.at(key);
    const int64_t tt = now_ns();
    msg.work = pp_->send(msg.buf.f32(), static_cast<size_t>(msg.buf.numel()), DType::F32, peer, key);
    rec("psend", key, tt, now_ns());
    rec_msg("send", key, msg.work);
  };
  for (const PipeAction& a : sched_.per_rank[rank_]) {
    const int m = a.microbatch, s = a.stage;
    const auto [first, last] = part_.stages[s];
    switch (a.kind) {
      case PipeAction::Forward: {
        model_.select_slot(acquire_slot(m, s));
        const float* input = first == 0 ? nullptr : wait_recv(tag(kAct, m, s - 1));
        auto t0 = Clock::now();
        const double c0 = thread_cpu_ms();
        // Every stage gets the ids: with document masking each stage's blocks mask by them.
        const double loss = model_.forward_units(first, last, ids[m], last == head_unit_ ? targets[m] : nullptr, input,
                                                 B, T_of(m), true, dloss);
        st.loss_sum += lengths ? loss * static_cast<double>(T_of(m)) / static_cast<double>(T) : loss;
        const double ms = ms_between(t0, Clock::now());
        st.busy_ms += ms;
        st.f_ms[static_cast<size_t>(s)] += ms;
        st.f_cpu_ms[static_cast<size_t>(s)] += thread_cpu_ms() - c0;
        rec("F", m, ns_of(t0), now_ns(), s);
        if (first != 0) recvs.erase(tag(kAct, m, s - 1));
        if (s + 1 < S_ && sched_.stage_rank(s + 1) == rank_) keep_local(tag(kAct, m, s), model_.unit_output(last));
        break;
      }
      case PipeAction::SendAct: {
        model_.select_slot(acquire_slot(m, s));
        stash(tag(kAct, m, s), model_.unit_output(last));
        post_send(tag(kAct, m, s), a.peer);
        break;
      }
      case PipeAction::RecvAct:
        post_recv(tag(kAct, m, s), a.peer);
        break;
      case PipeAction::Backward: {
        model_.select_slot(acquire_slot(m, s));
        const float* dout = last == head_unit_ ? nullptr : wait_recv(tag(kGrad, m, s + 1));
        const bool last_mb = m == M - 1;
        strategy_->begin_microbatch(last_mb);  // only a stage's last micro-batch synchronises
        const bool tied_in = tied_split_ && first == 0 && last_mb;
        if (tied_in && !split) recv_tied_grad();
        if (tied_in && split) post_tied_recv();  // waited for before the embedding's W
        // The head's contribution to the tied embedding's gradient (received above, or with a
        // split backward before the weight gradients that add it).
        auto t0 = Clock::now();
        const double c0 = thread_cpu_ms();
        model_.backward_units(first, last, dout, tied_in ? tied_grad_in_.f32() : nullptr, split);
        const double ms = ms_between(t0, Clock::now());
        st.busy_ms += ms;
        st.b_ms[static_cast<size_t>(s)] += ms;
        st.b_cpu_ms[static_cast<size_t>(s)] += thread_cpu_ms() - c0;
        rec("B", m, ns_of(t0), now_ns(), s);
        if (last != head_unit_) recvs.erase(tag(kGrad, m, s + 1));
        if (tied_split_ && last == head_unit_ && last_mb && !split) send_tied_grad();
        if (first != 0) {
          if (sched_.stage_rank(s - 1) == rank_)
            keep_local(tag(kGrad, m, s), model_.input_grad());
          else
            stash(tag(kGrad, m, s), model_.input_grad());  // for SendGrad (the workspace is reused)
        }
        if (!split) release_slot(m, s);
        break;
      }
      case PipeAction::Weight: {
        model_.select_slot(acquire_slot(m, s));
        const bool last_mb = m == M - 1;
        strategy_->begin_microbatch(last_mb);  // the hooks fire here, when the unit's gradients are complete
        auto t0 = Clock::now();
        const double c0 = thread_cpu_ms();
        double wait_ms = 0, wait_cpu_ms = 0;
        // A tied embedding cut by the pipeline: the last stage sends the head's contribution as
        // soon as the head's weight gradient is complete (its W runs first), and the first stage
        // waits for it only before the embedding's W (its last), so the other units' W overlap
        // the transfer and the other rank's remaining work.
        std::function<void(int, bool)> around;
        if (tied_split_ && last_mb && (first == 0 || last == head_unit_))
          around = [&](int u, bool after) {
            if (u == 0 && !after) {
              auto w0 = Clock::now();
              const double wc0 = thread_cpu_ms();
              recv_tied_grad();
              wait_ms += ms_between(w0, Clock::now());
              wait_cpu_ms += thread_cpu_ms() - wc0;
            } else if (u == head_unit_ && after) {
              send_tied_grad();
            }
          };
        model_.backward_weights(first, last, around);
        const double ms = ms_between(t0, Clock::now()) - wait_ms;  // recv_tied_grad counts it as a wait
        st.busy_ms += ms;
        st.w_ms[static_cast<size_t>(s)] += ms;
        st.w_cpu_ms[static_cast<size_t>(s)] += thread_cpu_ms() - c0 - wait_cpu_ms;
        rec("W", m, ns_of(t0), now_ns(), s);
        release_slot(m, s);
        break;
      }
      case PipeAction::SendGrad:
        post_send(tag(kGrad, m, s), a.peer);
        break;
      case PipeAction::RecvGrad:
        post_recv(tag(kGrad, m, s), a.peer);
        break;
    }
  }
  {
    auto t0 = Clock::now();
    for (auto& [k, msg] : sends)
      if (msg.work) msg.work->wait();
    st.wait_ms += ms_between(t0, Clock::now());
  }
  st.span_ms = ms_between(t_start, Clock::now());
  st.peak_slots = peak_slots_;
  const int64_t t_finish = now_ns();
  strategy_->finish_backward(comm);
  if (trace_path) {
    rec("step", 0, ns_of(t_start), t_finish);
    rec("finish", 0, t_finish, now_ns());
    for (auto& [kind, km] : traced_msgs) {
      TraceEvent e{kind, km.first, 0, 0};
      km.second->times_ns(&e.issued, &e.started, &e.done);
      trace.push_back(e);
    }
    const std::string path = std::string(trace_path) + ".rank" + std::to_string(rank_);
    if (FILE* f = std::fopen(path.c_str(), "a")) {
      for (const TraceEvent& e : trace)
        std::fprintf(f, "%s %d %lld %lld %lld %lld %lld\n", e.kind, e.key, static_cast<long long>(e.t0),
                     static_cast<long long>(e.t1), static_cast<long long>(e.issued), static_cast<long long>(e.started),
                     static_cast<long long>(e.done));
      std::fprintf(f, "END\n");
      std::fclose(f);
    }
  }
  return st;
}

double PipelineExecutor::eval_forward(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T) {
  const int64_t NC = model_.residual_rows(B * T) * model_.config().n_embd;  // a stage boundary's rows
  Tensor in, out;  // stage boundaries' rows (none with one stage)
  if (S_ > 1) {
    in = Tensor::empty({NC}, DType::F32, MemCategory::Comm);
    out = Tensor::empty({NC}, DType::F32, MemCategory::Comm);
  }
  comm::WorkHandle pending;
  double loss = 0;
  model_.select_slot(0);
  for (int s = 0; s < S_; ++s) {
    if (sched_.stage_rank(s) != rank_) continue;
    const auto [first, last] = part_.stages[s];
    const bool local_in = first != 0 && sched_.stage_rank(s - 1) == rank_;  // the turn of a V
    if (local_in)
      dev::copy(model_.device(), in.f32(), model_.unit_output(first - 1), static_cast<size_t>(NC) * sizeof(float));
    else if (first != 0)
      pp_->recv(in.f32(), static_cast<size_t>(NC), DType::F32, sched_.stage_rank(s - 1), tag(kAct, 0, s - 1))->wait();
    loss = model_.forward_units(first, last, ids, last == head_unit_ ? targets : nullptr, first != 0 ? in.f32() : nullptr,
                                B, T, false);
    if (last != head_unit_ && sched_.stage_rank(s + 1) != rank_) {
      if (pending) pending->wait();
      dev::copy(model_.device(), out.f32(), model_.unit_output(last), static_cast<size_t>(NC) * sizeof(float));
      pending = pp_->send(out.f32(), static_cast<size_t>(NC), DType::F32, sched_.stage_rank(s + 1), tag(kAct, 0, s));
    }
  }
  if (pending) pending->wait();
  return sched_.stage_rank(S_ - 1) == rank_ ? loss : 0.0;
}

void PipelineExecutor::tied_weights_sync() {
  if (!tied_split_) return;
  const int first_rank = sched_.stage_rank(0), last_rank = sched_.stage_rank(S_ - 1);
  const DType cd = model_.compute_dtype();
  if (rank_ == first_rank) {
    // The token embedding is the first parameter of the embedding unit (gathered for this call
    // when the strategy shards parameters).
    const ParamInfo& p = model_.params()[0];
    strategy_->with_full_unit(0, [&](const void* unit) {
      pp_->send(unit, static_cast<size_t>(p.numel), cd, last_rank, tag(kTiedWeights, 0, 0))->wait();
    });
  } else if (rank_ == last_rank) {
    Tensor& w = model_.tied_replica();
    pp_->recv(w.raw(), static_cast<size_t>(w.numel()), cd, first_rank, tag(kTiedWeights, 0, 0))->wait();
  }
}

}  // namespace mt::parallel
