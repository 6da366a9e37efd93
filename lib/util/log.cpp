#include "util/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace vlmopt::log {

void init(int verbosity) {
  auto logger = spdlog::stderr_color_mt("vlmopt");
  logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  spdlog::level::level_enum level = spdlog::level::info;
  if (verbosity < 0) level = spdlog::level::warn;
  if (verbosity == 1) level = spdlog::level::debug;
  if (verbosity >= 2) level = spdlog::level::trace;
  logger->set_level(level);
  spdlog::set_default_logger(logger);
}

}  // namespace vlmopt::log
