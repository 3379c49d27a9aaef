// Precompiled for every core source: LibTorch's tensor and module headers cost ~10 s per
// translation unit otherwise. Never include this file directly.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn.h>
#include <nlohmann/json.hpp>
