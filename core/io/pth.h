#pragma once
#include <filesystem>

#include "core/io/weights.h"

namespace diffract::io {

// Reads a `torch.save` zip archive holding a state dict (an OrderedDict or dict of tensors,
// possibly under "state_dict"). The pickle is interpreted, never executed: only the opcodes
// and globals that state dicts use are understood (tensor and parameter rebuilds, typed
// storages, OrderedDict); anything else is skipped or reported. LibTorch's own unpickler
// (torch::pickle_load, 2.11) turns a top-level OrderedDict into None, so it cannot be used.
StateDict load_pth(const std::filesystem::path& path);

}  // namespace diffract::io
