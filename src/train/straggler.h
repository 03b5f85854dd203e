// Stragglers and data stalls. Every step each rank splits its time into data wait (the step waiting
// for its batch from the loader), compute (the rest of the time its compute thread was busy) and
// exposed communication (the time it waited for collectives). Every log.straggler_every steps the
// ranks exchange their means over the steps since the last comparison (one all-gather of 4 floats
// per rank; nothing between comparisons) and a rank whose busy time (data wait + compute) exceeds the
// ranks' median by log.straggler_ratio and by log.straggler_min_ms is named a straggler, with the part
// that makes it slow ("data_wait" or "compute"). A rank's idle time at collectives (waiting for its
// peers) is estimated as the slowest rank's busy time minus its own, at most its exposed communication.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/process_group.h"

namespace mt {

// One rank's means over a comparison window, in ms per step.
struct RankTimes {
  double step = 0, data_wait = 0, compute = 0, exposed = 0;
  double busy() const { return data_wait + compute; }
};

struct Straggler {
  int rank = 0;
  std::string part;  // "data_wait" | "compute"
  double busy = 0, median_busy = 0;
};

double median(std::vector<double> v);
// The stragglers among `ranks` (slowest first): busy > ratio x median and busy - median > min_ms.
std::vector<Straggler> find_stragglers(const std::vector<RankTimes>& ranks, double ratio, double min_ms);
// Per rank: the estimated time blocked in collectives waiting for peers (see above).
std::vector<double> idle_at_collectives(const std::vector<RankTimes>& ranks);

class StragglerMonitor {
 public:
  // `g`: every rank of the job (null or size 1: a single rank compares nothing). Collective over g
  // when every > 0 and g has several ranks (the host names are exchanged once).
  StragglerMonitor(comm::ProcessGroup* g, const std::string& host, int64_t every, double ratio,
                   double min_ms, int64_t first_step);
  // Step `step` (0-based) took these times on this rank. On every `every`-th step (collective over
  // g) returns the step record's keys: straggler (null, {rank, host, part} or an array of them),
  // step_ms_per_rank, busy_ms_per_rank, data_wait_ms_per_rank, idle_ms_per_rank; and sets *line to
  // the log line naming the stragglers ("" when none). Otherwise returns null.
  nlohmann::json add(int64_t step, const RankTimes& t, std::string* line);

 private:
  comm::ProcessGroup* g_;
  int64_t every_ = 0, first_step_ = 0, window_start_ = 0;
  double ratio_ = 1.2, min_ms_ = 10;
  std::vector<std::string> hosts_;
  RankTimes sum_;
  int64_t n_ = 0;
};

}  // namespace mt
