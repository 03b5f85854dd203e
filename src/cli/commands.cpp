#include "cli/commands.h"

#include "cli/bench_adamw.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cli/data_commands.h"
#include "kernels/backend.h"
#include "runtime/strings.h"
#include "train/trainer.h"

namespace mt::cli {

static void print_usage(FILE* f) {
  std::fprintf(f,
               "usage: meshtrain <command> [options]\n\n"
               "commands:\n"
               "  train     train a model (single process, or one rank of an mpirun job)\n"
               "  prepare   turn a text file into train.bin / val.bin token shards\n"
               "  tokenize  print the token ids of a text\n"
               "  sample    generate text from a checkpoint\n"
               "  export    write a checkpoint as a Hugging Face model directory (config.json, safetensors)\n"
               "  model-info  the model the engine builds from a Hugging Face config.json or a preset\n"
               "  plot      draw loss, throughput and exposed communication from metrics files (SVG)\n"
               "  report    one self-contained HTML page of one or more runs' metrics\n"
               "  diagnose  what limits a run (communication, memory, compute, data, a straggler) and what helps\n"
               "  compare   run a config under two settings and compare losses and gradient norms per step\n"
               "  launch    run a subcommand on N ranks of this machine through mpirun\n"
               "  bench     benchmarks (`meshtrain bench comm`; `meshtrain bench adamw`: the CPU AdamW kernel's rate;\n"
               "            `meshtrain bench attention`: the attention kernels timed per call;\n"
               "            `meshtrain bench --cpu-isa`: the CPU's instruction-set level the kernels run at, capped by\n"
               "            MESHTRAIN_CPU_ISA)\n"
               "  schedule  print and check a pipeline schedule\n"
               "  plan      rank parallel layouts for a model and cluster\n"
               "  check-ops  check every kernel of a device (cpu, cuda) against the CPU baseline\n\n"
               "`meshtrain <command> --help` describes each command.\n");
}

int dispatch(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_usage(argc < 2 ? stderr : stdout);
    if (argc < 2) std::fprintf(stderr, "\nmeshtrain: no command given; to start, run: bash scripts/quickstart.sh\n");
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  // Each subcommand sees argv[0] = its own name.
  int sub_argc = argc - 1;
  char** sub_argv = argv + 1;
  if (cmd == "train") return run_train_command(sub_argc, sub_argv);
  if (cmd == "sample") return run_sample_command(sub_argc, sub_argv);
  if (cmd == "export") return run_export_command(sub_argc, sub_argv);
  if (cmd == "model-info") return run_model_info_command(sub_argc, sub_argv);
  if (cmd == "prepare") return run_prepare_command(sub_argc, sub_argv);
  if (cmd == "tokenize") return run_tokenize_command(sub_argc, sub_argv);
  if (cmd == "plot") return run_plot_command(sub_argc, sub_argv);
  if (cmd == "report") return run_report_command(sub_argc, sub_argv);
  if (cmd == "diagnose") return run_diagnose_command(sub_argc, sub_argv);
  if (cmd == "compare") return run_compare_command(sub_argc, sub_argv);
  if (cmd == "plan") return run_plan_command(sub_argc, sub_argv);
  if (cmd == "schedule") return run_schedule_command(sub_argc, sub_argv);
  if (cmd == "launch") return run_launch_command(sub_argc, sub_argv);
  if (cmd == "check-ops") return run_check_ops_command(sub_argc, sub_argv);
  if (cmd == "bench" && argc == 3 && !std::strcmp(argv[2], "--cpu-isa")) {
    try {
      std::printf("%s\n", kernels::describe(Device::CPU).c_str());
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 2;
    }
  }
  if (cmd == "bench" && argc >= 3 && !std::strcmp(argv[2], "adamw")) return run_bench_adamw_command(sub_argc, sub_argv);
  if (cmd == "bench" && argc >= 3 && !std::strcmp(argv[2], "attention"))
    return run_bench_attention_command(sub_argc, sub_argv);
  if (cmd == "bench") return run_bench_comm_command(sub_argc, sub_argv);
  const std::string near = closest_name(cmd, {"train", "prepare", "tokenize", "sample", "export", "model-info", "plot",
                                               "launch", "bench", "schedule", "plan", "check-ops"});
  if (!near.empty())
    std::fprintf(stderr, "meshtrain: unknown command '%s' (did you mean '%s'?)\n", cmd.c_str(), near.c_str());
  else
    std::fprintf(stderr, "meshtrain: unknown command '%s' (run 'meshtrain --help' for the commands)\n", cmd.c_str());
  return 2;
}

}  // namespace mt::cli
