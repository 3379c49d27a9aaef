#pragma once
#include <string>

#include "core/io/weights.h"

namespace diffract::io {

// Checkpoint key layouts that differ from our module names, mapped in one place.

// transformers 5 saves CLIPTextModel without the "text_model." prefix that every earlier
// export (and every SD checkpoint) has; our module keeps the historic names.
StateDict map_clip_text_keys(StateDict weights);

// madebyollin/taesd's original TAESD files hold one nn.Sequential per part, keyed "0.weight",
// "1.conv.0.weight", ...; diffusers' AutoencoderTiny (our module names) keys the same layers
// encoder.layers.N.* / decoder.layers.N.*, where a decoder index is one less than the
// original's (the original decoder's layer 0 is the parameter-free Clamp, which diffusers
// folds into forward). `part` is "encoder" or "decoder": which file the weights came from.
// Keys already in diffusers' layout pass unchanged; a decoder key at index 0 is an error.
StateDict map_taesd_keys(StateDict weights, const std::string& part);

// transformers ties T5's encoder.embed_tokens.weight to shared.weight: exports hold both, or
// only one of them. Our T5Encoder has shared.weight alone.
StateDict map_t5_encoder_keys(StateDict weights);

}  // namespace diffract::io
