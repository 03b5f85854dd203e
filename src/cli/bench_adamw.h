// `meshtrain bench adamw [options]`: the CPU AdamW kernel's throughput on this machine (argv may
// start at "bench"). 0 ok, 2 bad arguments.
#pragma once

namespace mt::cli {
int run_bench_adamw_command(int argc, char** argv);
}
