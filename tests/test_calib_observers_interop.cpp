// Observers against live references (torch.ao, compressed-tensors, a NumPy KL
// implementation). tests/interop/observers_parity.py writes the activations and
// the references, then runs this file with VLMOPT_OBSERVER_REFERENCE=<file>;
// without that variable the test only says so.
//
// Reference file: tensors "<case>/<comparison>/scale" (float32) and
// ".../zero_point" (int32, already in int8 terms: torch.ao quint8 zero points
// minus 128), "<case>/kl/amax" and "<case>/percentile/amax" (float32 [1]),
// "<case>/kl/hist" (int64) and "<case>/kl/exponent" (int64 [1]) unless the case is
// all zeros; metadata
// "activations" = path of the activations file, whose tensor "<case>" holds the
// batches along dim 0, observed in order. With VLMOPT_OBSERVER_OUTPUT set, the
// C++ results are written there under the same names for the script to compare.
#include "calib/observers.hpp"
#include "io/safetensors.hpp"
#include "io/torch_bridge.hpp"
#include "quant/qparams.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

namespace {

using namespace vlmopt;
using calib::ObserverKind;
using calib::ObserverTarget;
using quant::Convention;
using quant::QuantType;
using quant::Strategy;

struct Comparison {
  const char* name;
  ObserverKind kind;
  Strategy strategy;
  ObserverTarget target;
  int bits;
  bool symmetric;
  QuantType type;
  Convention convention;
  int64_t group_size = 0;
};

// What each reference name means on the C++ side (see observers_parity.py for the Python side).
const Comparison kComparisons[] = {
    {"ao_minmax_tensor_sym", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 8, true,
     QuantType::kInt, Convention::kTorchAo},
    {"ao_minmax_tensor_affine", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 8, false,
     QuantType::kInt, Convention::kTorchAo},
    {"ao_minmax_channel_sym", ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kActivation, 8, true,
     QuantType::kInt, Convention::kTorchAo},
    {"ao_moving_tensor_sym", ObserverKind::kMovingAverage, Strategy::kTensor, ObserverTarget::kActivation, 8, true,
     QuantType::kInt, Convention::kTorchAo},
    {"ao_moving_tensor_affine", ObserverKind::kMovingAverage, Strategy::kTensor, ObserverTarget::kActivation, 8,
     false, QuantType::kInt, Convention::kTorchAo},
    {"ao_minmax_wchannel_sym", ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kWeight, 8, true,
     QuantType::kInt, Convention::kTorchAo},
    {"ct_tensor_sym", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 8, true,
     QuantType::kInt, Convention::kCompressedTensors},
    {"ct_tensor_affine", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 8, false,
     QuantType::kInt, Convention::kCompressedTensors},
    {"ct_tensor_int4_sym", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 4, true,
     QuantType::kInt, Convention::kCompressedTensors},
    {"ct_tensor_fp8", ObserverKind::kMinMax, Strategy::kTensor, ObserverTarget::kActivation, 8, true,
     QuantType::kFloat, Convention::kCompressedTensors},
    {"ct_wchannel_sym", ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kWeight, 8, true,
     QuantType::kInt, Convention::kCompressedTensors},
    {"ct_wchannel_affine", ObserverKind::kMinMax, Strategy::kChannel, ObserverTarget::kWeight, 8, false,
     QuantType::kInt, Convention::kCompressedTensors},
    {"ct_wgroup_int4_sym", ObserverKind::kMinMax, Strategy::kGroup, ObserverTarget::kWeight, 4, true,
     QuantType::kInt, Convention::kCompressedTensors, 32},
    {"ct_wgroup_int4_affine", ObserverKind::kMinMax, Strategy::kGroup, ObserverTarget::kWeight, 4, false,
     QuantType::kInt, Convention::kCompressedTensors, 32},
    {"kl", ObserverKind::kEntropy, Strategy::kTensor, ObserverTarget::kActivation, 8, true, QuantType::kInt,
     Convention::kCompressedTensors},
    {"percentile", ObserverKind::kPercentile, Strategy::kTensor, ObserverTarget::kActivation, 8, true,
     QuantType::kInt, Convention::kCompressedTensors},
};

bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.contiguous().cpu();
  const auto cb = b.contiguous().cpu();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

}  // namespace

TEST_CASE("observers match torch.ao, compressed-tensors and the NumPy KL reference bit for bit") {
  const char* reference_env = std::getenv("VLMOPT_OBSERVER_REFERENCE");
  if (reference_env == nullptr || *reference_env == '\0') {
    MESSAGE("VLMOPT_OBSERVER_REFERENCE is not set: run tests/interop/observers_parity.py for this comparison");
    return;
  }
  const auto reference = io::SafetensorsFile::open(reference_env);
  const auto activations = io::SafetensorsFile::open(reference->metadata().at("activations"));
  const char* output_env = std::getenv("VLMOPT_OBSERVER_OUTPUT");

  std::deque<torch::Tensor> outputs;  // kept alive until written
  std::vector<io::TensorToWrite> to_write;
  const auto record = [&](const std::string& name, const torch::Tensor& t) {
    outputs.push_back(t.contiguous().cpu());
    to_write.push_back(io::to_write(name, outputs.back()));
  };

  int compared = 0;
  for (const io::TensorInfo& info : activations->tensors()) {
    const std::string case_name = info.name;
    const torch::Tensor batches = io::load_tensor(*activations, info);
    for (const Comparison& c : kComparisons) {
      const std::string prefix = case_name + "/" + c.name;
      const bool is_histogram = c.kind == ObserverKind::kEntropy || c.kind == ObserverKind::kPercentile;
      if (reference->find(prefix + (is_histogram ? "/amax" : "/scale")) == nullptr) continue;
      CAPTURE(prefix);
      calib::ObserverOptions options;
      options.kind = c.kind;
      options.args.num_bits = c.bits;
      options.args.symmetric = c.symmetric;
      options.args.type = c.type;
      options.args.strategy = c.strategy;
      options.args.group_size = c.group_size;
      options.convention = c.convention;
      options.target = c.target;
      auto observer = calib::make_observer(options);
      for (int64_t b = 0; b < batches.size(0); ++b) observer->observe(batches[b]);
      ++compared;

      if (is_histogram) {
        const torch::Tensor amax = observer->amax();
        record(prefix + "/amax", amax);
        const torch::Tensor want = io::load_tensor(*reference, reference->at(prefix + "/amax"));
        CHECK_MESSAGE(bit_equal(amax, want), prefix << ": amax " << amax.item<float>() << ", reference "
                                                    << want.item<float>());
        if (c.kind == ObserverKind::kEntropy && reference->find(prefix + "/hist") != nullptr) {
          const auto histogram = observer->histogram();
          REQUIRE(histogram.has_value());
          record(prefix + "/hist", histogram->counts);
          record(prefix + "/exponent", torch::tensor({static_cast<int64_t>(histogram->width_exponent)}));
          const torch::Tensor want_exponent = io::load_tensor(*reference, reference->at(prefix + "/exponent"));
          CHECK(histogram->width_exponent == want_exponent.item<int64_t>());
          CHECK(bit_equal(histogram->counts, io::load_tensor(*reference, reference->at(prefix + "/hist"))));
        }
        continue;
      }
      const quant::QParams qp = observer->qparams();
      record(prefix + "/scale", qp.scale);
      record(prefix + "/zero_point", qp.zero_point);
      const torch::Tensor want_scale = io::load_tensor(*reference, reference->at(prefix + "/scale"));
      const torch::Tensor want_zp = io::load_tensor(*reference, reference->at(prefix + "/zero_point"));
      CHECK_MESSAGE(bit_equal(qp.scale, want_scale),
                    prefix << ": max |scale diff| "
                           << (qp.scale.sizes() == want_scale.sizes()
                                   ? (qp.scale - want_scale).abs().max().item<float>()
                                   : -1.0f));
      CHECK_MESSAGE(bit_equal(qp.zero_point, want_zp), prefix << ": zero points differ");
    }
  }
  MESSAGE("compared " << compared << " observer results with the references");
  CHECK(compared >= 20);
  if (output_env != nullptr && *output_env != '\0') io::write_safetensors(output_env, std::move(to_write));
}
