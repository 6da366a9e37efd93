// Export atomicity under SIGKILL (lib/bundle/export): a killed export leaves the
// target absent, the previous bundle, or a complete new bundle that verifies,
// and its staging directory is removed by the next export (cleanup rule in export.hpp).
//
// Also the "bundle export driver" case: with VLMOPT_EXPORT_FROM / VLMOPT_EXPORT_TO
// set it exports a min-max w8a8 bundle (VLMOPT_EXPORT_OUTLIERS outlier channels per
// layer, default 0); the kill test runs it in a child process, and
// tests/interop/bundle_transformers.py uses it to make bundles for transformers.
#include "bundle/export.hpp"
#include "bundle/manifest.hpp"
#include "bundle/verify.hpp"
#include "bundle_test_util.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>

namespace {

using namespace vlmopt;
using namespace vlmopt::testing;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// Forks and execs this test binary running the driver case; returns the child pid.
pid_t spawn_export(const fs::path& from, const fs::path& to, const std::string& dataset_hash) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setenv("VLMOPT_EXPORT_FROM", from.c_str(), 1);
    ::setenv("VLMOPT_EXPORT_TO", to.c_str(), 1);
    ::setenv("VLMOPT_EXPORT_DATASET_HASH", dataset_hash.c_str(), 1);
    const char* argv[] = {"vlmopt_tests", "--test-case=bundle export driver", "--no-colors=1", "--minimal=1", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

}  // namespace

TEST_CASE("bundle export driver") {
  const char* from = env("VLMOPT_EXPORT_FROM");
  const char* to = env("VLMOPT_EXPORT_TO");
  if (!from || !to) return;  // only when driven (kill test, interop script)
  PlanOptions po;
  if (const char* n = env("VLMOPT_EXPORT_OUTLIERS")) po.outliers_per_layer = std::atoi(n);
  bundle::ExportOptions o;
  o.source_model = from;
  o.out = to;
  o.dataset_hash = env("VLMOPT_EXPORT_DATASET_HASH") ? env("VLMOPT_EXPORT_DATASET_HASH") : "driver";
  o.step_options = {{"scheme", "w8a8"}, {"observer", "minmax"}, {"outliers_per_layer", po.outliers_per_layer}};
  bundle::export_bundle(o, minmax_plan(from, po));
}

TEST_CASE("export survives SIGKILL at any moment") {
  TempDir tmp;
  const auto src = fixture_dir("clip_llama_gqa_sharded");
  const auto previous = tmp / "previous";
  {  // a reference previous bundle (different dataset hash: distinguishable manifest)
    const pid_t pid = spawn_export(src, previous, "previous");
    const int status = wait_for(pid);
    REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  // How long one export takes in a child, to spread the kills over it.
  const auto start = std::chrono::steady_clock::now();
  const int first = wait_for(spawn_export(src, tmp / "timing", "new"));
  REQUIRE((WIFEXITED(first) && WEXITSTATUS(first) == 0));
  const auto full_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("one export in a child process: " << full_ms << " ms");
  const auto previous_manifest = read_bytes(previous / bundle::kManifestPath);
  const auto new_manifest_hashes = bundle::read_manifest(tmp / "timing").files;

  std::mt19937 rng(20261130);
  int absent = 0, old_kept = 0, complete = 0;
  constexpr int kRuns = 24;
  for (int run = 0; run < kRuns; ++run) {
    CAPTURE(run);
    const auto target = tmp / fmt::format("target{}", run);
    const bool with_previous = run % 2 == 0;
    if (with_previous) fs::copy(previous, target, fs::copy_options::recursive);
    // Delays over the whole run, startup included (most of it is loading the test binary).
    const auto delay = std::uniform_int_distribution<long>(0, full_ms + 50)(rng);
    const pid_t pid = spawn_export(src, target, "new");
    std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    ::kill(pid, SIGKILL);
    wait_for(pid);  // killed, or finished before the signal: both outcomes are checked below

    if (!fs::exists(target)) {
      CHECK_FALSE(with_previous);  // a previous bundle is never lost
      ++absent;
    } else {
      const auto r = bundle::verify_bundle(target);
      CHECK_MESSAGE(r.ok(), (r.problems.empty() ? std::string() : r.problems.front()));
      if (read_bytes(target / bundle::kManifestPath) == previous_manifest) {
        CHECK(with_previous);
        ++old_kept;
      } else {
        CHECK(bundle::read_manifest(target).files == new_manifest_hashes);  // the complete new bundle
        ++complete;
      }
    }
    // Leftovers of the killed run carry its (now dead) pid: the next export removes them.
    bundle::remove_stale_staging(target);
    for (const auto& e : fs::directory_iterator(tmp.path()))
      CHECK_MESSAGE(!e.path().filename().string().starts_with(bundle::staging_prefix(target)), e.path().string());
  }
  MESSAGE("after SIGKILL: " << absent << " absent, " << old_kept << " previous kept, " << complete << " complete");
  CHECK(absent + old_kept + complete == kRuns);
  // A later export over a killed run's target succeeds and verifies.
  bundle::ExportOptions o;
  o.source_model = src;
  o.out = tmp / "target0";
  bundle::export_bundle(o, minmax_plan(src));
  CHECK(bundle::verify_bundle(tmp / "target0").ok());
}
