// Conversion between safetensors tensors and torch::Tensor. Only translation
// units that already need torch include this.
#pragma once

#include "io/safetensors.hpp"

#include <torch/torch.h>

namespace vlmopt::io {

torch::ScalarType to_torch(DType dtype);
DType from_torch(torch::ScalarType type);  // throws for types safetensors cannot hold

// A CPU tensor with the contents of `info` (a copy: file data may be unaligned).
torch::Tensor load_tensor(const SafetensorsFile& file, const TensorInfo& info);
torch::Tensor load_tensor(const Checkpoint& ckpt, std::string_view name);

// Views a contiguous CPU tensor as bytes to write (the tensor must outlive the write).
TensorToWrite to_write(std::string name, const torch::Tensor& contiguous_cpu);

}  // namespace vlmopt::io
