// The meshtrain subcommands. Each takes argv with argv[0] = the command's own name and returns the
// process exit code (0 ok, 1 failure, 2 bad options). The libraries below export the functions these
// call; only this layer parses argv.
#pragma once
#include <string>

namespace mt::cli {

int dispatch(int argc, char** argv);  // argv[1] names the subcommand

// `meshtrain launch -n N [--hostfile F] [options] -- <subcommand and its arguments>`: prints the
// mpirun command line (comm::build_launch_plan) to stderr and execs it (returns only on error, or
// after printing with --dry-run).
int run_launch_command(int argc, char** argv);
// `meshtrain bench comm [options]`. argv may start at "bench" (then argv[1] must be "comm") or at
// "comm". Initialises the World itself when no one did.
int run_bench_comm_command(int argc, char** argv);
// `meshtrain bench attention [options]`: the attention kernels of a device timed per call.
int run_bench_attention_command(int argc, char** argv);
// `meshtrain plan ...`: 0 ok, 2 bad input (message on stderr naming the flag), 1 internal error or a
// failed --validate check.
int run_plan_command(int argc, char** argv);
std::string plan_help();
// `meshtrain schedule ...`: prints the table, the check, peak in-flight activations and the
// simulated bubble next to the formula. 0 if the check passes, 1 if not, 2 on bad flags or sizes.
int run_schedule_command(int argc, char** argv);
// `meshtrain plot --metrics FILE[,FILE...]`: one SVG of loss, throughput and exposed communication.
int run_plot_command(int argc, char** argv);
// `meshtrain sample`: text generated from a checkpoint or safetensors weights.
int run_sample_command(int argc, char** argv);
// `meshtrain export --checkpoint DIR --out DIR`: a checkpoint as a Hugging Face model directory
// (checkpoint/export.h). 0 ok, 2 bad options, 1 failure.
int run_export_command(int argc, char** argv);
// `meshtrain model-info (--hf-config FILE | --model PRESET)`: the model the engine builds.
int run_model_info_command(int argc, char** argv);
// `meshtrain check-ops`: the kernel registry's ops on a device against the CPU baseline
// (kernels/conformance/check.h). 0 all pass, 1 a case failed, 2 bad options or device.
int run_check_ops_command(int argc, char** argv);
// `meshtrain diagnose METRICS.jsonl...`: what limits each run and the change most likely to help.
int run_diagnose_command(int argc, char** argv);
// `meshtrain report METRICS.jsonl... --out report.html`: one self-contained HTML page of the runs.
int run_report_command(int argc, char** argv);
// `meshtrain compare --config FILE --a "OVERRIDES" --b "OVERRIDES"`: runs both, compares losses and
// gradient norms step by step. 0 equal within the precision's tolerance, 1 different, 2 bad options.
int run_compare_command(int argc, char** argv);
// `meshtrain train`: 0 ok, 2 config error, 1 any other failure (a multi-rank job is ended).
int run_train_command(int argc, char** argv);

}  // namespace mt::cli
