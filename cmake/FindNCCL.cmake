# Finds NCCL: NCCL_ROOT, the torch wheel's nvidia/nccl next to it, or the CUDA toolkit.
# Wheels ship only libnccl.so.2, so the versioned name is accepted.
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT})
if(Torch_DIR)
  get_filename_component(_site "${Torch_DIR}/../../../.." ABSOLUTE)
  list(APPEND _nccl_hints "${_site}/nvidia/nccl" "${_site}/nvidia/cu13")
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include
          PATHS /usr/local/cuda/include /usr/include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
             PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
