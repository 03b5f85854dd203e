// The communication layer (layer "comm" in docs/design.md): process groups over MPI, the device
// mesh and the launcher's mpirun command line. See docs/comm.md.
#pragma once
#include "comm/launch.h"
#include "comm/process_group.h"
#include "comm/world.h"
