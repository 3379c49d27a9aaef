#pragma once
#include "core/io/weights.h"

namespace diffract::io {

// Checkpoint key layouts that differ from our module names, mapped in one place.

// transformers 5 saves CLIPTextModel without the "text_model." prefix that every earlier
// export (and every SD checkpoint) has; our module keeps the historic names.
StateDict map_clip_text_keys(StateDict weights);

}  // namespace diffract::io
