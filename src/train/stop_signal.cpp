#include "train/stop_signal.h"

#include <signal.h>

#include "comm/process_group.h"

namespace mt {

namespace {

volatile sig_atomic_t g_signal = 0;

void on_signal(int sig) {
  if (g_signal != 0) {  // the second one: stop now
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_signal = sig;
}

}  // namespace

struct StopOnSignal::Saved {
  struct sigaction int_action {}, term_action{}, usr1_action{};
};

StopOnSignal::StopOnSignal() : saved_(std::make_unique<Saved>()) {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &saved_->int_action);
  sigaction(SIGTERM, &sa, &saved_->term_action);
  sigaction(SIGUSR1, &sa, &saved_->usr1_action);
}

StopOnSignal::~StopOnSignal() {
  sigaction(SIGINT, &saved_->int_action, nullptr);
  sigaction(SIGTERM, &saved_->term_action, nullptr);
  sigaction(SIGUSR1, &saved_->usr1_action, nullptr);
}

bool StopOnSignal::requested(comm::ProcessGroup* world) const {
  float f = g_signal != 0 ? 1.0f : 0.0f;
  if (world && world->size() > 1) world->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Max)->wait();
  return f > 0.0f;
}

const char* StopOnSignal::signal_name() {
  return g_signal == SIGTERM ? "SIGTERM" : g_signal == SIGUSR1 ? "SIGUSR1" : "SIGINT";
}

}  // namespace mt
