// The checkout's paths for the tests, compiled into this file alone (tests/CMakeLists.txt).
#include "test_support.hpp"

#ifndef VLMOPT_SOURCE_DIR
#error "VLMOPT_SOURCE_DIR must be defined by the build"
#endif
#ifndef VLMOPT_FIXTURES_DIR
#error "VLMOPT_FIXTURES_DIR must be defined by the build"
#endif

namespace vlmopt::testing {

fs::path source_dir() { return VLMOPT_SOURCE_DIR; }
fs::path fixtures_dir() { return VLMOPT_FIXTURES_DIR; }

}  // namespace vlmopt::testing
