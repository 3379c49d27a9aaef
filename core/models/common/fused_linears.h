#pragma once
// Linear layers that read one input tensor, run as one GEMM. Their weights (and biases) are laid
// end to end in one tensor, each parameter becoming a view of its rows, so state dicts, keys and
// gradients are unchanged. Inference only, and only while every parameter is still such a view:
// a move to another device or dtype gives them their own storage again, and intact() turns false.
// CrossKV (attention.h) and TimeProjections (resnet.h) are built on it.
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/models/common/layers.h"

namespace diffract::models {

class FusedLinears {
 public:
  using Member = std::pair<const void*, std::vector<LinearImpl*>>;  // an owner and its layers
  // Lays the members' layers end to end, in order. A member whose layers differ from the first
  // layer in input width or in having a bias is left out. Null when no member is left.
  static std::shared_ptr<FusedLinears> fuse(const std::vector<Member>& members);
  bool intact() const;
  int size() const { return static_cast<int>(owners_.size()); }
  bool has(const void* owner) const { return index_.count(owner) != 0; }
  // x [..., in] -> [..., sum of the layers' outputs]
  at::Tensor project(const at::Tensor& x) const;
  // The columns of `owner`'s layer `i` in project()'s result; undefined for a non-member.
  at::Tensor part(const at::Tensor& projected, const void* owner, int i) const;

 private:
  struct Entry {
    std::vector<LinearImpl*> layers;
    std::vector<std::int64_t> offsets;
  };
  std::vector<const void*> owners_;
  std::unordered_map<const void*, Entry> index_;
  at::Tensor weight_, bias_;  // [sum out, in], [sum out] or undefined
};

}  // namespace diffract::models
