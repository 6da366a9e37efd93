// Translation unit that owns the shared <torch/torch.h> precompiled header
// (see vlmopt_torch_pch in the top-level CMakeLists.txt); it defines nothing.
