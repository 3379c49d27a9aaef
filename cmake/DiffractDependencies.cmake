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
find_package(PNG REQUIRED)
# libjpeg (Debian libjpeg-dev) reads JPEG init images. Optional: without it only PNGs are read.
find_package(JPEG)
# OpenSSL's libcrypto (Debian libssl-dev) hashes LoRA files as A1111 does (its "Lora hashes"). Optional:
# without it the parameters text carries no hashes and PNGs' hashes are not looked up.
find_package(OpenSSL COMPONENTS Crypto)
find_package(ICU COMPONENTS uc)  # optional: without it the CLIP tokenizer accepts ASCII prompts only
if(NOT ICU_FOUND)
  message(WARNING "ICU not found: the CLIP tokenizer will reject non-ASCII prompts")
endif()

# SentencePiece (Debian libsentencepiece-dev) tokenizes T5's prompts. Optional: without it
# (the GPU machine) the core builds and SD3 runs with T5's part of the embedding zeros.
option(DIFFRACT_WITH_SENTENCEPIECE "Use SentencePiece for the T5 tokenizer when it is found" ON)
set(SentencePiece_FOUND OFF)
if(DIFFRACT_WITH_SENTENCEPIECE)
  find_path(SentencePiece_INCLUDE_DIR sentencepiece_processor.h)
  find_library(SentencePiece_LIBRARY sentencepiece)
  if(SentencePiece_INCLUDE_DIR AND SentencePiece_LIBRARY)
    set(SentencePiece_FOUND ON)
    add_library(SentencePiece::SentencePiece UNKNOWN IMPORTED)
    set_target_properties(SentencePiece::SentencePiece PROPERTIES IMPORTED_LOCATION "${SentencePiece_LIBRARY}"
                          INTERFACE_INCLUDE_DIRECTORIES "${SentencePiece_INCLUDE_DIR}")
  else()
    message(WARNING "SentencePiece not found (Debian: libsentencepiece-dev): SD3 will run without its T5 encoder")
  endif()
endif()

set(DIFFRACT_HAS_CUDA OFF)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(DIFFRACT_HAS_CUDA ON)
  find_package(NCCL)
endif()
message(STATUS "Diffract: CUDA ${DIFFRACT_HAS_CUDA}, NCCL ${NCCL_FOUND}, ICU ${ICU_FOUND}, SentencePiece ${SentencePiece_FOUND}, JPEG ${JPEG_FOUND}, OpenSSL ${OPENSSL_FOUND}")

if(DIFFRACT_BUILD_CLI)
  # CLI11 is header-only: without its CMake package (the GPU machine), its headers will do.
  find_package(CLI11 CONFIG QUIET)
  if(NOT CLI11_FOUND)
    find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
    add_library(CLI11::CLI11 INTERFACE IMPORTED)
    set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CLI11_INCLUDE_DIR}")
  endif()
endif()
if(DIFFRACT_BUILD_UI OR DIFFRACT_BUILD_TESTS)
  find_package(Qt6 REQUIRED COMPONENTS Core Gui Widgets Concurrent Test)
endif()
if(DIFFRACT_BUILD_UI)
  # The compare view's heatmap and metrics; the core stays free of OpenCV.
  find_package(OpenCV REQUIRED COMPONENTS core imgproc)
endif()
