# libtorch comes from the PyPI torch wheel: ask the interpreter where its CMake
# config lives unless the user pointed Torch_DIR somewhere else.
find_package(Python3 REQUIRED COMPONENTS Interpreter)
if(NOT Torch_DIR)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import torch, sys; sys.stdout.write(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE VLMOPT_TORCH_PREFIX RESULT_VARIABLE _torch_rc ERROR_QUIET)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR "vlmopt: cannot import torch with ${Python3_EXECUTABLE}; run scripts/setup.sh")
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${VLMOPT_TORCH_PREFIX})
endif()
# No GPU on build machines: tell Caffe2's CMake which architectures to target
# instead of letting it probe for installed GPUs.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;8.9;9.0")
endif()
find_package(Torch REQUIRED)
# Torch's exported flags target: keep its include dirs SYSTEM so -Wall stays ours.
add_library(vlmopt_torch INTERFACE)
add_library(vlmopt::torch ALIAS vlmopt_torch)
target_link_libraries(vlmopt_torch INTERFACE ${TORCH_LIBRARIES})
# The CUDA wheel finds its own NVIDIA libraries (site-packages/nvidia/*/lib)
# through $ORIGIN run paths; the linker and our executables must see the same
# ones, not whatever the CUDA toolkit or ldconfig offers first (e.g. an older NCCL).
get_filename_component(_torch_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
file(GLOB VLMOPT_NVIDIA_WHEEL_LIBDIRS LIST_DIRECTORIES true "${_torch_site}/nvidia/*/lib")
if(VLMOPT_NVIDIA_WHEEL_LIBDIRS)
  list(JOIN VLMOPT_NVIDIA_WHEEL_LIBDIRS ":" _nv_path)
  target_link_options(vlmopt_torch INTERFACE "LINKER:-rpath-link,${_nv_path}" "LINKER:-rpath,${_nv_path}")
endif()
# The wheel ships fmt 12 headers in its include root, which would shadow
# Debian's fmt 9 that spdlog is built against. Put a directory holding only
# links to Debian's fmt and spdlog ahead of torch's include root, so our code and
# spdlog agree on one fmt (inline namespaces keep the two fmt ABIs apart).
set(VLMOPT_FMT_FIRST ${CMAKE_BINARY_DIR}/fmt-first)
file(MAKE_DIRECTORY ${VLMOPT_FMT_FIRST})
foreach(_hdr fmt spdlog)
  if(NOT EXISTS ${VLMOPT_FMT_FIRST}/${_hdr})
    file(CREATE_LINK /usr/include/${_hdr} ${VLMOPT_FMT_FIRST}/${_hdr} SYMBOLIC)
  endif()
endforeach()
target_include_directories(vlmopt_torch SYSTEM INTERFACE ${VLMOPT_FMT_FIRST} ${TORCH_INCLUDE_DIRS})
# The wheels export copies of libstdc++'s std::filesystem functions that their toolchain linked
# in statically. With the torch libraries ahead of libstdc++ among an executable's libraries, our
# std::filesystem calls bind to those copies, and torch 2.11's remove_all() jumps to a null
# pointer (every TempDir in the tests and `vlmopt pipeline` crashed with torch 2.11 on a GPU
# machine). libstdc++ first among the needed libraries makes the dynamic linker find its own
# definitions first; --no-as-needed keeps the entry, which no object has asked for yet there.
target_link_options(vlmopt_torch INTERFACE "LINKER:--push-state,--no-as-needed" "-lstdc++" "LINKER:--pop-state")
