// The communication layer (layer "comm" in DESIGN.md): process groups over MPI, the device mesh,
// the launcher and the collective benchmark. See docs/comm.md.
#pragma once
#include "comm/commands.h"
#include "comm/process_group.h"
#include "comm/world.h"
