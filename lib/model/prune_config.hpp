// prune.json (bundle file vlmopt/prune.json, schema in docs/bundle-format.md):
// the scoring rule, per-scenario pruning steps (layer + learned threshold or keep
// ratio), and the hardware-aware keep-ratio policy of design.md §7.
#pragma once

#include "model/prune_plan.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace vlmopt::model {

inline constexpr const char* kPruneFormat = "vlmopt.prune";
inline constexpr int kPruneVersion = 1;
inline constexpr const char* kPruneFile = "vlmopt/prune.json";  // relative to a bundle

// keep = max(floor, 1 - a * mem_pressure - b * l2_miss_rate): the most a step may keep
// (the cap), never below `floor`, which is also the least it keeps.
struct KeepPolicy {
  double floor = 0.3;
  double a = 0.6;
  double b = 0.2;
  BatchKeep batch_keep = BatchKeep::kPerSample;  // how a batch's samples share keep counts
  double cap(double mem_pressure, double l2_miss_rate) const;
};

// Measured or expected conditions of the target; 0 (the default) means "no pressure",
// so the cap is 1 and only the learned thresholds and the floor apply.
struct HardwareState {
  double mem_pressure = 0.0;  // [0,1] fraction of device memory in use by others
  double l2_miss_rate = 0.0;  // [0,1]
};

struct Scenario {
  std::vector<PruneStep> steps;
};

struct PruneConfig {
  PruneRule rule = PruneRule::kDual;
  KeepPolicy policy;
  HardwareState hardware;
  std::string default_scenario = "general";
  std::map<std::string, Scenario> scenarios;  // at least default_scenario
  uint64_t seed = 0;                          // kRandom
  nlohmann::json fit = nlohmann::json::object();  // how it was fitted (informational)

  // The runtime plan for `scenario` ("" = default_scenario). InputError for unknown names.
  PrunePlan plan(const std::string& scenario = "", const HardwareState* hardware = nullptr) const;
  nlohmann::json to_json() const;
};

// Validates everything (format, version, every field's type and range, unknown fields);
// InputError "<where>: <field>: expected X, got Y".
PruneConfig prune_config_from_json(const nlohmann::json& j, const std::string& where);
PruneConfig read_prune_config(const std::filesystem::path& path);
void write_prune_config(const std::filesystem::path& path, const PruneConfig& config);  // atomic

}  // namespace vlmopt::model
