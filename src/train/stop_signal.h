// Ctrl-C during training: the first SIGINT, SIGTERM or SIGUSR1 (`meshtrain launch` turns Ctrl-C
// into SIGUSR1 for mpirun, which passes it on to every rank) asks the run to stop after the
// current step; the ranks agree on the step, write the final checkpoint when checkpointing is on,
// and end normally. A second signal ends the process at once.
#pragma once
#include <memory>

namespace mt {

namespace comm {
class ProcessGroup;
}

class StopOnSignal {
 public:
  StopOnSignal();   // installs the handlers
  ~StopOnSignal();  // restores the previous ones
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // True once a signal arrived on any rank of `world` (a collective over it; null: this process
  // alone). Every rank must call it at the same point.
  bool requested(comm::ProcessGroup* world) const;
  // The signal's name ("SIGINT", "SIGTERM", "SIGUSR1"), for the message.
  static const char* signal_name();

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

}  // namespace mt
