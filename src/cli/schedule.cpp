// `meshtrain schedule`: builds, prints, checks and times a pipeline schedule (parallel/layout/pipeline_schedule.h).
#include <climits>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "parallel/layout/pipeline_schedule.h"

namespace mt::cli {

using namespace mt::parallel;

namespace {

const char* kScheduleHelp =
    "usage: meshtrain schedule --pp P --microbatches M [--schedule NAME] [--virtual-stages V]\n"
    "                          [--comm eager|batched] [--show-comm] [--list] [--no-table]\n"
    "                          [--t-fwd X] [--t-bwd Y] [--t-comm Z] [--costs F,B,W]\n"
    "\n"
    "Builds a pipeline-parallel schedule, prints it as a table (one column per rank, one row\n"
    "per time slot), checks it and compares its simulated bubble with the formula.\n"
    "\n"
    "options:\n"
    "  --pp P                pipeline ranks (>= 1)\n"
    "  --microbatches M      micro-batches per step (>= 1)\n"
    "  --schedule NAME       gpipe | 1f1b | interleaved_1f1b | zb1p | zbv (default 1f1b)\n"
    "                          gpipe: all forwards, then all backwards\n"
    "                          1f1b: PipeDream-flush / Megatron (warm-up, one forward one\n"
    "                                backward, cool-down); at most pp micro-batches in flight\n"
    "                          interleaved_1f1b: Megatron interleaved, V stages per rank;\n"
    "                                needs M to be a multiple of P\n"
    "                          zb1p: zero bubble ZB-H1: each backward split into B (input\n"
    "                                gradient) and a later W (weight gradient) that fills\n"
    "                                the cool-down; at most P micro-batches in flight\n"
    "                          zbv: zero bubble V: two stages per rank (rank r: stages r and\n"
    "                                2P-1-r), split backward; at most P micro-batches' worth\n"
    "  --virtual-stages V    stages per rank for interleaved_1f1b (default 2; must be 1 for\n"
    "                        the others). Rank r owns stages r, r+P, r+2P, ...\n"
    "  --comm PLACEMENT      where sends/receives go (default eager): eager = each send right\n"
    "                        after its compute, each receive right before its consumer;\n"
    "                        batched = Megatron's one batch per step, deadlock-free even with\n"
    "                        rendezvous sends (changes only interleaved_1f1b)\n"
    "  --show-comm           also print the sends/receives each rank posts between slots\n"
    "  --list                also print every rank's action list in order\n"
    "  --no-table            do not print the table\n"
    "  --t-fwd X             forward time of one micro-batch through one rank's layers\n"
    "                        (default 1); a virtual stage takes X/V\n"
    "  --t-bwd Y             backward time, same units (default 2); a split backward's B and W\n"
    "                        take Y/2 each\n"
    "  --t-comm Z            latency of one send (default 0); sends do not block the sender\n"
    "  --costs F,B,W         zb1p / zbv: one micro-batch's forward, input gradient and weight\n"
    "                        gradient on one stage (e.g. measured: a run's pp_stage_ms); the\n"
    "                        schedule is built for them (zb1p: list-scheduled under its memory\n"
    "                        limit instead of the fixed ZB-H1 order) and the bubble simulated\n"
    "                        with them (t_fwd = V*F, t_bwd = V*(B+W); not with --t-fwd/--t-bwd)\n"
    "  --help                this text\n"
    "\n"
    "Table entries: F3.1 / B3.1 = forward / backward of micro-batch 3 on stage 1 (both from 0),\n"
    "W3.1 = its weight gradient (zb1p, zbv); '.' = idle. In the table every F, B and W takes one slot. Communication rows\n"
    "(--show-comm, marked ':') list sA3.1>2 = send the activation of F3.1 to rank 2, rA3.1<1 =\n"
    "receive it from rank 1, sG/rG the same for the gradient of B3.1.\n"
    "\n"
    "The check proves the schedule complete (one forward and one backward per micro-batch and\n"
    "stage, on the stage's rank), every send matched by a receive, dependencies in order, and no\n"
    "deadlock when sends are asynchronous and receives block; it also reports whether it is\n"
    "deadlock-free with rendezvous sends posted in batches (batch_isend_irecv).\n"
    "\n"
    "exit status: 0 check passed, 1 check failed, 2 bad options or sizes\n"
    "\n"
    "example: meshtrain schedule --pp 4 --microbatches 8 --schedule interleaved_1f1b --virtual-stages 2\n";

int bad_usage(const std::string& msg) {
  std::fprintf(stderr, "meshtrain schedule: %s\n(see meshtrain schedule --help)\n", msg.c_str());
  return 2;
}

}  // namespace

int run_schedule_command(int argc, char** argv) {
  if (cli_support::wants_help(argc, argv)) {
    std::fputs(kScheduleHelp, stdout);
    return 0;
  }
  ArgParser ap({"pp", "microbatches", "schedule", "virtual-stages", "t-fwd", "t-bwd", "t-comm", "comm", "costs"},
               {"show-comm", "list", "no-table", "help"});
  std::string name;
  int pp = 0, m = 0, v = 1;
  double tf = 1, tb = 2, tc = 0, w_share = 0.5;
  StageCosts costs;
  CommPlacement placement = CommPlacement::Eager;
  try {
    ap.parse(argc, argv, 1);
    if (!ap.positional().empty()) return bad_usage("unexpected argument '" + ap.positional().front() + "'");
    if (!ap.rest().empty()) return bad_usage("unexpected arguments after --");
    if (!ap.has("pp")) return bad_usage("--pp is required");
    if (!ap.has("microbatches")) return bad_usage("--microbatches is required");
    auto as_int = [&](const char* flag, long long def) {
      const long long x = ap.get_int(flag, def);
      if (x < INT_MIN || x > INT_MAX) throw ArgError(std::string("option --") + flag + " is out of range");
      return static_cast<int>(x);
    };
    name = ap.get("schedule", to_string(PipelineSchedule::OneFOneB));
    pp = as_int("pp", 0);
    m = as_int("microbatches", 0);
    const bool interleaved = try_parse_pipeline_schedule(name) == PipelineSchedule::Interleaved;
    const bool vshape = try_parse_pipeline_schedule(name) == PipelineSchedule::ZeroBubbleV;
    v = as_int("virtual-stages", interleaved || vshape ? 2 : 1);
    if (!parse_placement(ap.get("comm", "eager"), &placement))
      return bad_usage("--comm must be eager or batched, got '" + ap.get("comm") + "'");
    tf = ap.get_double("t-fwd", 1.0);
    tb = ap.get_double("t-bwd", 2.0);
    tc = ap.get_double("t-comm", 0.0);
    if (!(tf > 0) || !(tb > 0) || !(tc >= 0) || !std::isfinite(tf) || !std::isfinite(tb) ||
        !std::isfinite(tc))
      return bad_usage("--t-fwd and --t-bwd must be > 0 and --t-comm >= 0");
    if (ap.has("costs")) {
      if (ap.has("t-fwd") || ap.has("t-bwd")) return bad_usage("--costs sets the times: leave out --t-fwd and --t-bwd");
      double x[3];
      char tail = 0;
      const std::string cs = ap.get("costs");
      if (std::sscanf(cs.c_str(), "%lf,%lf,%lf%c", &x[0], &x[1], &x[2], &tail) != 3 || !(x[0] > 0 && x[1] > 0 && x[2] > 0) ||
          !std::isfinite(x[0] + x[1] + x[2]))
        return bad_usage("--costs must be three positive numbers F,B,W, got '" + cs + "'");
      costs = {x[0], x[1], x[2]};
      tf = v * x[0];
      tb = v * (x[1] + x[2]);
      w_share = x[2] / (x[1] + x[2]);
    }
  } catch (const ArgError& e) {
    return bad_usage(e.what());
  }
  PipeSchedule s;
  try {
    s = make_schedule(name, pp, m, v, placement, costs);
  } catch (const std::invalid_argument& e) {
    return bad_usage(e.what());
  }

  std::printf(
      "pipeline schedule %s: pp=%d, microbatches=%d, virtual stages per rank=%d (%d stages), "
      "%s send/recv placement\n\n",
      s.name.c_str(), s.pp, s.microbatches, s.virtual_stages, s.num_stages(), placement_name(placement));
  if (!ap.flag("no-table")) {
    std::printf(
        "F<m>.<s> / B<m>.<s> = forward / backward of micro-batch m on stage s%s; '.' = idle; one slot per\n"
        "forward or backward of a stage%s\n\n",
        s.split_backward ? " (B: input gradient), W<m>.<s> = its weight gradient" : "",
        ap.flag("show-comm") ? "; ':' rows = sends (sA/sG m.s>peer) and receives (rA/rG m.s<peer)" : "");
    std::fputs(format_schedule(s, ap.flag("show-comm")).c_str(), stdout);
    std::printf("\n");
  }
  if (ap.flag("list")) {
    std::fputs(format_actions(s).c_str(), stdout);
    std::printf("\n");
  }
  const ScheduleCheck c = check_schedule(s);
  std::printf("check: %s\n", c.message.c_str());
  for (size_t i = 1; i < c.problems.size(); ++i) std::printf("  %s\n", c.problems[i].c_str());
  std::printf("rendezvous sends (batched isend/irecv): %s\n",
              c.rendezvous_safe ? "also deadlock-free" : c.rendezvous_message.c_str());
  std::printf("peak activations in flight (forward done, %s not yet), per rank:",
              s.split_backward ? "weight gradient" : "backward");
  for (int r = 0; r < s.pp; ++r) std::printf(" %d", c.peak_in_flight.empty() ? 0 : c.peak_in_flight[r]);
  if (s.virtual_stages > 1)
    std::printf(
        "\n  (counted in (micro-batch, stage) pairs; each holds 1/%d of a rank's layers, so in "
        "micro-batches:",
        s.virtual_stages);
  if (s.virtual_stages > 1) {
    for (int r = 0; r < s.pp; ++r)
      std::printf(" %.2f", static_cast<double>(c.peak_in_flight[r]) / s.virtual_stages);
    std::printf(")");
  }
  std::printf("\n");
  const Timeline t = simulate_timeline(s, tf, tb, tc, w_share);
  const BubbleFormula f = bubble_formula(s);
  char wbuf[64] = "";
  if (s.split_backward) std::snprintf(wbuf, sizeof wbuf, " of which W %g", w_share * tb);
  if (t.completed) {
    std::printf(
        "bubble (t_fwd=%g, t_bwd=%g%s, t_comm=%g): simulated %.2f%% of the step idle (idle/compute %.4f), "
        "step time %g\n",
        tf, tb, wbuf, tc, 100.0 * t.bubble_fraction, t.bubble_relative, t.makespan);
    std::printf("formula %s: %.2f%% (relative %.4f)\n", f.text.c_str(), 100.0 * f.fraction, f.relative);
    std::printf("idle per rank:");
    for (int r = 0; r < s.pp; ++r) std::printf(" %g", t.idle[r]);
    std::printf("\n");
  } else {
    std::printf("bubble: not simulated, %s\n", t.message.c_str());
  }
  return c.ok ? 0 : 1;
}

}  // namespace mt::cli
