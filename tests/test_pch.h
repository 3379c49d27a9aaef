#pragma once
#include <ATen/ATen.h>
#include <torch/nn.h>
#include <nlohmann/json.hpp>
#include <QtTest>
