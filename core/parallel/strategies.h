#pragma once
// Every strategy and the registry that makes them, in one include (tests, the GPU checks).
#include "core/parallel/asyncdiff.h"
#include "core/parallel/cfg_parallel.h"
#include "core/parallel/data_parallel.h"
#include "core/parallel/step_caches.h"
#include "core/parallel/sequence_parallel.h"
#include "core/parallel/distrifusion.h"
#include "core/parallel/driffusion.h"
#include "core/parallel/hybrid_cfg.h"
#include "core/parallel/pipefusion.h"
#include "core/parallel/registry.h"
#include "core/parallel/step_skip.h"
#include "core/parallel/strategy.h"
