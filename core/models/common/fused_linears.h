#pragma once
// Linear layers that read one input tensor, run as one GEMM. Their weights (and biases) are laid
// end to end in one tensor, each parameter becoming a view of its rows, so state dicts, keys and
// gradients are unchanged. Inference only, and only while every parameter is still such a view:
// a move to another device or dtype gives them their own storage again, and intact() turns false.
// CrossKV (attention.h) and TimeProjections (resnet.h) are built on it, with FusedLinearsScope.
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include "core/models/common/fp8_linear.h"
#include "core/models/common/layers.h"

namespace diffract::models {

class FusedLinears {
 public:
  using Member = std::pair<const void*, std::vector<LinearImpl*>>;  // an owner and its layers
  // Lays the members' layers end to end, in order. A member whose layers differ from the first
  // layer in input width or in having a bias is left out. Null when no member is left.
  static std::shared_ptr<FusedLinears> fuse(const std::vector<Member>& members);
  // fuse() over every module below `root` (root included, in modules() order) that `member`
  // makes a member of.
  static std::shared_ptr<FusedLinears> fuse_below(torch::nn::Module& root,
                                                  const std::function<std::optional<Member>(torch::nn::Module&)>& member);
  bool intact() const;
  int size() const { return static_cast<int>(owners_.size()); }
  bool has(const void* owner) const { return index_.count(owner) != 0; }
  // x [..., in] -> [..., sum of the layers' outputs]; in fp8 where the first layer may
  // (allow_fp8) and the job wants it (fp8_linear.h), the e4m3 copy made of the fused weight.
  at::Tensor project(const at::Tensor& x) const;
  // project(x) written into `out` [..., sum of the outputs], a view (linear_into, layers.h).
  void project_into(at::Tensor& out, const at::Tensor& x) const;
  // The sum of the layers' output widths: project()'s last dimension.
  std::int64_t out_features() const { return weight_.size(0); }
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
  std::shared_ptr<Fp8WeightCache> fp8_ = std::make_shared<Fp8WeightCache>();
};

// q, k and v of `x` through an attention's three projections: the parts of one GEMM where `fused`
// holds them intact for `owner`, else each layer's own forward.
std::array<at::Tensor, 3> project_qkv(const FusedLinears* fused, const void* owner, LinearImpl& q, LinearImpl& k,
                                      LinearImpl& v, const at::Tensor& x);

// A FusedLinears behind a type of its own, the Tag of its FusedLinearsScope (CrossKV, TimeProjections).
class FusedLinearsGroup {
 public:
  bool intact() const { return linears_->intact(); }
  int size() const { return linears_->size(); }
  const FusedLinears* linears() const { return linears_.get(); }

 protected:
  // A G holding `linears`, or null for none.
  template <class G>
  static std::shared_ptr<G> holding(std::shared_ptr<FusedLinears> linears) {
    if (!linears) return nullptr;
    auto group = std::make_shared<G>();
    group->linears_ = std::move(linears);
    return group;
  }
  std::shared_ptr<FusedLinears> linears_;
};

// One forward's product of a FusedLinears, made from one input by the forward that owns the
// group, for the layers below it to look up by owner and by the identity of the tensor they are
// handed (not merely equal values: a caller passing a slice or a copy gets its own
// projections). Scopes nest per Tag on each thread and the innermost decides, so a forward
// without a group hides the outer ones. None while autograd records, or once the group's layout
// is no longer intact.
template <class Tag>
class FusedLinearsScope {
 public:
  // `prepare`, if given, maps the input before the GEMM (the time projections' SiLU).
  FusedLinearsScope(const FusedLinears* linears, const at::Tensor& input,
                    at::Tensor (*prepare)(const at::Tensor&) = nullptr)
      : previous_(innermost_) {
    innermost_ = this;
    if (!linears || !input.defined() || c10::GradMode::is_enabled() || !linears->intact()) return;
    linears_ = linears;
    input_ = input;
    projected_ = linears->project(prepare ? prepare(input) : input);
  }
  ~FusedLinearsScope() { innermost_ = previous_; }
  FusedLinearsScope(const FusedLinearsScope&) = delete;
  FusedLinearsScope& operator=(const FusedLinearsScope&) = delete;
  // The innermost scope's output of `owner`'s layer `i` for `input`, or undefined (no scope, not
  // a member, another input tensor).
  static at::Tensor lookup(const void* owner, const at::Tensor& input, int i) {
    const auto* scope = innermost_;
    if (!scope || !scope->linears_ || !input.is_same(scope->input_)) return {};
    return scope->linears_->part(scope->projected_, owner, i);
  }

 private:
  static inline thread_local const FusedLinearsScope* innermost_ = nullptr;
  const FusedLinearsScope* previous_;
  const FusedLinears* linears_ = nullptr;
  at::Tensor input_, projected_;
};

}  // namespace diffract::models
