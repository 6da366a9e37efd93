// Logging goes to stderr (results go to stdout). Verbosity: -q warn, default info, -v debug.
#pragma once

#include <spdlog/spdlog.h>

namespace vlmopt::log {

// verbosity: -1 quiet, 0 normal, 1 verbose, 2+ trace.
void init(int verbosity);

}  // namespace vlmopt::log
