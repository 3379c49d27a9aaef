# Finds everything the targets link. Torch comes from the project venv's wheel:
# pass -DCMAKE_PREFIX_PATH=$(python -c 'import torch;print(torch.utils.cmake_prefix_path)').
if(NOT DIFFRACT_PYTHON AND EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  set(DIFFRACT_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH "" FORCE)
endif()
if(NOT Torch_DIR AND DIFFRACT_PYTHON)
  execute_process(COMMAND "${DIFFRACT_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
    # Without a system CUDA toolkit, scripts/setup.sh puts NVIDIA's PyPI one in the venv.
    get_filename_component(_venv_cuda "${_torch_prefix}/../../../nvidia/cu13" ABSOLUTE)
    if(NOT CUDAToolkit_ROOT AND NOT EXISTS /usr/local/cuda/bin/nvcc AND EXISTS "${_venv_cuda}/bin/nvcc")
      set(CUDAToolkit_ROOT "${_venv_cuda}")
    endif()
  endif()
endif()
find_package(Torch REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(ZLIB REQUIRED)
find_package(ICU COMPONENTS uc)  # optional: without it the CLIP tokenizer accepts ASCII prompts only
if(NOT ICU_FOUND)
  message(WARNING "ICU not found: the CLIP tokenizer will reject non-ASCII prompts")
endif()

set(DIFFRACT_HAS_CUDA OFF)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(DIFFRACT_HAS_CUDA ON)
  find_package(NCCL)
endif()
message(STATUS "Diffract: CUDA ${DIFFRACT_HAS_CUDA}, NCCL ${NCCL_FOUND}, ICU ${ICU_FOUND}")

if(DIFFRACT_BUILD_CLI)
  find_package(CLI11 REQUIRED)
endif()
if(DIFFRACT_BUILD_UI OR DIFFRACT_BUILD_TESTS)
  find_package(Qt6 REQUIRED COMPONENTS Core Gui Widgets Test)
endif()
