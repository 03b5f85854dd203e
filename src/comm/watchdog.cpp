// The collective watchdog.
//
// One thread per process wakes every tick (timeout/10, between 10 ms and 1 s). It
//  - answers "where are you in group g?" queries from other ranks (on its own duplicate of the
//    world communicator, so it works across hosts and while the rank's main thread computes), and
//  - ends the job when an operation of any group has been running longer than MESHTRAIN_TIMEOUT_S:
//    it asks every other member of the group how many collectives of that group it has called,
//    names those that have not joined this one (or did not answer at all: dead or hung), dumps the
//    flight recorder and calls MPI_Abort.
#include <algorithm>
#include <chrono>
#include <list>

#include "comm/detail.h"

namespace mt::comm::detail {

namespace {

constexpr int kTagQuery = 11, kTagReply = 12;

struct Query {
  int32_t uid;
  int32_t pad;
  uint64_t seq;
};
struct Reply {
  int32_t uid;
  int32_t known;
  uint64_t issued, started, completed;
};

struct Watchdog {
  std::thread thr;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  MPI_Comm comm = MPI_COMM_NULL;
  std::list<std::pair<Reply, MPI_Request>> outgoing;  // replies being sent
  bool fired = false;
};

Watchdog& wd() {
  static Watchdog* w = new Watchdog();
  return *w;
}

void serve_queries(Watchdog& w) {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kTagQuery, w.comm, &flag, &st) != MPI_SUCCESS || !flag) break;
    Query q{};
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, kTagQuery, w.comm, MPI_STATUS_IGNORE) !=
        MPI_SUCCESS)
      break;
    Reply r{q.uid, 0, 0, 0, 0};
    if (auto g = find_group(q.uid)) {
      r.known = 1;
      r.issued = g->issued.load();
      r.started = g->started.load();
      r.completed = g->completed.load();
    }
    w.outgoing.emplace_back(r, MPI_REQUEST_NULL);
    auto& back = w.outgoing.back();
    if (MPI_Isend(&back.first, sizeof(Reply), MPI_BYTE, st.MPI_SOURCE, kTagReply, w.comm,
                  &back.second) != MPI_SUCCESS)
      w.outgoing.pop_back();
  }
  for (auto it = w.outgoing.begin(); it != w.outgoing.end();) {
    int done = 0;
    MPI_Test(&it->second, &done, MPI_STATUS_IGNORE);
    it = done ? w.outgoing.erase(it) : std::next(it);
  }
}

std::string rank_list(const std::vector<int>& v) {
  std::string s;
  for (int r : v) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

void handle_timeout(Watchdog& w, GroupImpl& g, const GroupImpl::Active& a, double tick_s) {
  const double secs = static_cast<double>(now_ns() - a.t_start) / 1e9;
  const bool p2p = is_p2p(a.d.kind);
  const int n = g.size;
  std::vector<Reply> replies(static_cast<size_t>(n));
  std::vector<int> got(static_cast<size_t>(n), 0);
  std::vector<Query> queries(static_cast<size_t>(n));
  std::vector<MPI_Request> sreq, rreq(static_cast<size_t>(n), MPI_REQUEST_NULL);
  for (int q = 0; q < n; ++q) {
    if (q == g.rank) continue;
    queries[q] = Query{g.uid, 0, a.d.seq};
    MPI_Request s;
    if (MPI_Isend(&queries[q], sizeof(Query), MPI_BYTE, g.granks[q], kTagQuery, w.comm, &s) ==
        MPI_SUCCESS)
      sreq.push_back(s);
    MPI_Irecv(&replies[q], sizeof(Reply), MPI_BYTE, g.granks[q], kTagReply, w.comm, &rreq[q]);
  }
  const int64_t deadline =
      now_ns() + static_cast<int64_t>(std::min(5.0, std::max(1.0, 3 * tick_s + 0.5)) * 1e9);
  int missing = n - 1;
  while (missing > 0 && now_ns() < deadline) {
    serve_queries(w);
    for (int q = 0; q < n; ++q) {
      if (q == g.rank || got[q]) continue;
      int done = 0;
      if (MPI_Test(&rreq[q], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
        got[q] = 1;
        --missing;
      }
    }
    if (missing) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<int> joined, not_joined_ranks;
  std::string not_joined, no_answer;
  joined.push_back(g.granks[g.rank]);
  for (int q = 0; q < n; ++q) {
    if (q == g.rank) continue;
    const int wr = g.granks[q];
    if (!got[q] || !replies[q].known) {
      no_answer += (no_answer.empty() ? "" : ", ") + std::to_string(wr);
      continue;
    }
    if (p2p) continue;
    if (replies[q].issued < a.d.seq) {
      not_joined += (not_joined.empty() ? "" : ", ") + std::to_string(wr) + " (last called #" +
                    std::to_string(replies[q].issued) + ")";
      not_joined_ranks.push_back(wr);
    } else {
      joined.push_back(wr);
    }
  }
  std::sort(joined.begin(), joined.end());
  char head[128];
  std::snprintf(head, sizeof head, " has not finished after %.1f s (MESHTRAIN_TIMEOUT_S=%g)", secs,
                config().timeout_s);
  std::string msg = "watchdog: ";
  if (p2p) {
    msg += describe(a.d, true, &g.granks) + " on group " + g.name + head;
    if (!no_answer.empty())
      msg += "; ranks that did not answer (dead or hung): " + no_answer;
    else
      msg += "; the peer is alive but has not posted the matching operation";
  } else {
    msg += "collective #" + std::to_string(a.d.seq) + " " + describe(a.d, true) + " of group " +
           g.name + " (ranks " + rank_list(g.granks) + ")" + head;
    if (!not_joined.empty()) msg += "; ranks that have not joined it: " + not_joined;
    if (!no_answer.empty())
      msg += "; ranks that did not answer (dead or hung): " + no_answer;
    if (not_joined.empty() && no_answer.empty())
      msg += "; every rank joined it (stuck inside MPI, or far too slow)";
    else
      msg += "; joined: " + rank_list(joined);
  }
  for (auto& r : rreq)
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  for (auto& s : sreq) MPI_Request_free(&s);
  report_fatal(msg, 1.0);
}

void watchdog_main() {
  Watchdog& w = wd();
  const double timeout = config().timeout_s;
  const double tick = std::min(1.0, std::max(0.01, timeout / 10));
  const int64_t limit = static_cast<int64_t>(timeout * 1e9);
  std::unique_lock<std::mutex> lk(w.mu);
  while (!w.stop) {
    w.cv.wait_for(lk, std::chrono::duration<double>(tick));
    if (w.stop) break;
    lk.unlock();
    if (w.comm != MPI_COMM_NULL) serve_queries(w);
    if (!w.fired && !job_failed()) {
      const int64_t now = now_ns();
      for (auto& g : live_groups()) {
        GroupImpl::Active oldest{};
        bool late = false;
        {
          std::lock_guard<std::mutex> al(g->act_mu);
          for (const auto& a : g->active) {
            if (now - a.t_start > limit && (!late || a.t_start < oldest.t_start)) {
              oldest = a;
              late = true;
            }
          }
        }
        if (late) {
          w.fired = true;
          handle_timeout(w, *g, oldest, tick);
          break;
        }
      }
    }
    lk.lock();
  }
}

}  // namespace

void watchdog_start(MPI_Comm wd_comm) {
  Watchdog& w = wd();
  if (config().timeout_s <= 0 || wd_comm == MPI_COMM_NULL) return;
  std::lock_guard<std::mutex> lk(w.mu);
  if (w.thr.joinable()) return;
  w.comm = wd_comm;
  w.stop = false;
  w.thr = std::thread(watchdog_main);
}

void watchdog_stop() {
  Watchdog& w = wd();
  {
    std::lock_guard<std::mutex> lk(w.mu);
    w.stop = true;
  }
  w.cv.notify_all();
  if (w.thr.joinable()) w.thr.join();
  for (auto& o : w.outgoing) MPI_Request_free(&o.second);
  w.outgoing.clear();
}

}  // namespace mt::comm::detail
