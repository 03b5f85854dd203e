// A small stand-in for the meshtrain binary, for the tests that run whole jobs:
//   comm_tool bench comm [...]   the collective benchmark
//   comm_tool launch [...]       the launcher (it re-runs this program under mpirun)
//   comm_tool hello              every rank prints its place; rank 0 (or MESHTRAIN_LOG_RANKS) more
//   comm_tool ops                a few collectives (for MESHTRAIN_DEBUG=trace)
//   comm_tool desync             rank 2 calls all_gather(bf16, 1024) as collective #4 of group dp
//                                while the others call all_reduce(f32, 4096)
//   comm_tool stall              rank 2 computes for 60 s while the others enter all_reduce #4
//   comm_tool kill               rank 1 is killed (SIGKILL) while the others enter all_reduce #4
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "comm/comm.h"

using namespace mt;
using namespace mt::comm;

static int failure_modes(const std::string& mode, int argc, char** argv) {
  World& w = World::init(&argc, &argv);
  DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", -1}});
  auto dp = mesh.group("dp");
  std::vector<float> a(4096, 1.0f);
  std::vector<bf16> b(1024 * dp->size());
  try {
    for (int i = 0; i < 3; ++i) dp->all_reduce(a.data(), a.size(), DType::F32)->wait();
    const int r = w.rank();
    if (mode == "ops") {
      dp->all_gather(b.data(), b.data(), 1024, DType::BF16)->wait();
      dp->barrier()->wait();
    } else if (mode == "desync" && r == 2) {
      dp->all_gather(b.data(), b.data(), 1024, DType::BF16)->wait();
    } else if (mode == "stall" && r == 2) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
    } else if (mode == "kill" && r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      raise(SIGKILL);
    } else {
      dp->all_reduce(a.data(), a.size(), DType::F32)->wait();
    }
  } catch (const CommError& e) {
    std::fprintf(stderr, "comm_tool rank %d caught CommError: %s\n", w.rank(), e.what());
    return 3;
  }
  w.finalize();
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: comm_tool bench|launch|hello|ops|desync|stall|kill ...\n");
    return 2;
  }
  std::string mode = argv[1];
  if (mode == "bench") return mt::cli::run_bench_comm_command(argc - 1, argv + 1);
  if (mode == "launch") return mt::cli::run_launch_command(argc - 1, argv + 1);
  if (mode == "hello") {
    World& w = World::init(&argc, &argv);
    const char* omp = std::getenv("OMP_NUM_THREADS");
    const char* tun = std::getenv("GLIBC_TUNABLES");
    std::printf("hello from rank %d of %d (local %d of %d) OMP_NUM_THREADS=%s GLIBC_TUNABLES=%s\n",
                w.rank(), w.size(), w.local_rank(), w.local_size(), omp ? omp : "-",
                tun ? tun : "-");
    std::fflush(stdout);
    w.world()->barrier()->wait();
    log_printf(stdout, "printer %d\n", w.rank());
    w.finalize();
    return 0;
  }
  if (mode == "ops" || mode == "desync" || mode == "stall" || mode == "kill")
    return failure_modes(mode, argc, argv);
  std::fprintf(stderr, "comm_tool: unknown mode '%s'\n", mode.c_str());
  return 2;
}
