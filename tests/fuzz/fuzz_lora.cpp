// LoRA files (io::resolve_lora): the safetensors header, the key kinds of every format it reads
// (kohya / A1111, LyCORIS LoCon / LoHa / LoKr, diffusers / PEFT with its adapter metadata), the
// underscored names matched against a model's modules, and each layer's tensors checked against
// its module's weight. The model is a small fixed one with a module of each kind a LoRA patches;
// make_seeds.py writes LoRAs for it in each format. resolve_lora takes a path ending in
// .safetensors: a link of that name to the in-memory input.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "core/io/lora_file.h"
#include "core/util/error.h"
#include "fuzz_file.h"

namespace {

const diffract::io::LoraModelModules& model() {
  static const auto m = [] {
    diffract::io::LoraModelModules m;
    auto& unet = m.components["unet"];
    unet["conv_in"] = {8, 4, 3, 3};
    unet["down_blocks.0.resnets.0.conv1"] = {8, 8, 3, 3};
    unet["down_blocks.0.resnets.0.time_emb_proj"] = {8, 32};
    unet["down_blocks.0.attentions.0.proj_in"] = {8, 8};
    for (const char* p : {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "ff.net.2"})
      unet[std::string("down_blocks.0.attentions.0.transformer_blocks.0.") + p] = {8, 8};
    unet["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"] = {8, 16};
    unet["down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj"] = {64, 8};
    unet["mid_block.attentions.0.transformer_blocks.0.attn1.to_q"] = {8, 8};
    unet["up_blocks.1.attentions.0.proj_out"] = {8, 8};
    for (const char* te : {"text_encoder", "text_encoder_2"}) {
      auto& t = m.components[te];
      for (const char* p : {"q_proj", "k_proj", "v_proj", "out_proj"})
        t[std::string("text_model.encoder.layers.0.self_attn.") + p] = {16, 16};
      t["text_model.encoder.layers.0.mlp.fc1"] = {32, 16};
      t["text_model.encoder.layers.0.mlp.fc2"] = {16, 32};
    }
    auto& tr = m.components["transformer"];
    for (const char* p : {"attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.to_out.0"})
      tr[std::string("transformer_blocks.0.") + p] = {8, 8};
    tr["transformer_blocks.0.ff.net.0.proj"] = {32, 8};
    return m;
  }();
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  diffract::fuzz::MemoryFile file(data, size);
  if (!file.ok()) return 0;
  static const auto link =
      std::filesystem::temp_directory_path() / ("fuzz-lora-" + std::to_string(::getpid()) + ".safetensors");
  std::error_code ec;
  std::filesystem::remove(link, ec);
  std::filesystem::create_symlink(file.path(), link, ec);
  if (ec) return 0;
  static const bool verbose = std::getenv("DIFFRACT_FUZZ_VERBOSE") != nullptr;  // what each input resolved to
  try {
    const auto r = diffract::io::resolve_lora(link, model());
    double sum = 0;
    for (const auto& layer : r.layers) sum += static_cast<double>(layer.rank()) + layer.scale(0.8);
    if (verbose)
      std::fprintf(stderr, "%s: %zu layers, %zu unmatched, scale sum %g\n", r.format.c_str(), r.layers.size(),
                   r.unmatched.size(), sum);
  } catch (const diffract::Error& e) {
    if (verbose) std::fprintf(stderr, "error: %.300s\n", e.what());
  }
  std::filesystem::remove(link, ec);
  return 0;
}
