// `vlmopt verify`: checks a bundle without loading the model (design.md §5).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace vlmopt::bundle {

struct VerifyResult {
  std::vector<std::string> problems;  // in check order; each names the file and what is wrong
  bool ok() const { return problems.empty(); }
  nlohmann::json to_json() const;     // {"ok": bool, "problems": [...]}
};

// Checks, in order: the manifest (schema, version); every listed file present with
// its size and sha256; no unlisted files; config.json's quantization_config schema;
// safetensors headers of model.safetensors (or its shards) and vlmopt/outliers.safetensors;
// quantized tensors' dtypes and shapes consistent with the config; vlmopt/mp_cache.bin
// valid (quant::read_mp_cache), naming quantized layers, its outlier masks matching the
// FP16 columns of vlmopt/outliers.safetensors. Problems with the
// bundle's content are collected, not thrown. A missing or unreadable manifest is
// one problem and stops the checks that need it.
VerifyResult verify_bundle(const std::filesystem::path& bundle);

}  // namespace vlmopt::bundle
