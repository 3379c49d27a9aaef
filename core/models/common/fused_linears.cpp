#include "core/models/common/fused_linears.h"

#include <ATen/ATen.h>

#include "core/models/common/fp8_linear.h"

namespace diffract::models {

namespace {

// Whether `parts` are views laid end to end from the start of `fused` (same dtype and device).
bool laid_end_to_end(const at::Tensor& fused, const std::vector<const at::Tensor*>& parts) {
  auto* base = static_cast<const char*>(fused.data_ptr());
  std::int64_t offset = 0;
  for (const auto* t : parts) {
    if (!t->defined() || t->data_ptr() != base + offset || t->scalar_type() != fused.scalar_type() ||
        t->device() != fused.device())
      return false;
    offset += t->numel() * static_cast<std::int64_t>(t->element_size());
  }
  return true;
}

// The parameters `parts` end to end in one new tensor (along dim 0), each becoming a view of it.
at::Tensor lay_end_to_end(const std::vector<at::Tensor*>& parts) {
  std::vector<at::Tensor> values;
  for (const auto* p : parts) values.push_back(*p);
  auto fused = at::cat(values, 0);
  std::int64_t row = 0;
  for (auto* p : parts) {
    const auto rows = p->size(0);
    p->set_data(fused.narrow(0, row, rows));
    row += rows;
  }
  return fused;
}

}  // namespace

std::shared_ptr<FusedLinears> FusedLinears::fuse(const std::vector<Member>& members) {
  auto group = std::make_shared<FusedLinears>();
  std::vector<at::Tensor*> weights, biases;
  std::int64_t offset = 0, width = -1;
  bool biased = false;
  for (const auto& [owner, layers] : members) {
    if (layers.empty() || group->has(owner)) continue;
    if (width < 0) width = layers.front()->weight.size(1), biased = layers.front()->bias.defined();
    bool fits = true;
    for (const auto* l : layers) fits = fits && l->weight.size(1) == width && l->bias.defined() == biased;
    if (!fits) continue;
    Entry e{layers, {}};
    for (auto* l : layers) {
      e.offsets.push_back(offset);
      offset += l->weight.size(0);
      weights.push_back(&l->weight);
      if (biased) biases.push_back(&l->bias);
    }
    group->owners_.push_back(owner);
    group->index_.emplace(owner, std::move(e));
  }
  if (group->owners_.empty()) return nullptr;
  at::NoGradGuard no_grad;
  group->weight_ = lay_end_to_end(weights);
  if (biased) group->bias_ = lay_end_to_end(biases);
  return group;
}

std::shared_ptr<FusedLinears> FusedLinears::fuse_below(
    torch::nn::Module& root, const std::function<std::optional<Member>(torch::nn::Module&)>& member) {
  // The root by reference (it need not be held by a shared_ptr), then what is below it.
  std::vector<Member> members;
  if (auto m = member(root)) members.push_back(std::move(*m));
  for (const auto& child : root.modules(/*include_self=*/false))
    if (auto m = member(*child)) members.push_back(std::move(*m));
  return fuse(members);
}

bool FusedLinears::intact() const {
  std::vector<const at::Tensor*> weights, biases;
  for (const auto* owner : owners_)
    for (const auto* l : index_.at(owner).layers) {
      weights.push_back(&l->weight);
      if (bias_.defined()) biases.push_back(&l->bias);
    }
  return laid_end_to_end(weight_, weights) && (!bias_.defined() || laid_end_to_end(bias_, biases));
}

at::Tensor FusedLinears::project(const at::Tensor& x) const {
  if (index_.at(owners_.front()).layers.front()->fp8) {
    auto y = fp8_linear(x, fp8_.get(), weight_, bias_);
    if (y.defined()) return y;
  }
  return linear(x, weight_, bias_);
}

void FusedLinears::project_into(at::Tensor& out, const at::Tensor& x) const {
  if (index_.at(owners_.front()).layers.front()->fp8) {
    if (auto y = fp8_linear(x, fp8_.get(), weight_, bias_); y.defined()) {
      out.copy_(y);
      return;
    }
  }
  linear_into(out, x, weight_, bias_);
}

at::Tensor FusedLinears::part(const at::Tensor& projected, const void* owner, int i) const {
  const auto it = index_.find(owner);
  if (it == index_.end() || i < 0 || i >= static_cast<int>(it->second.layers.size())) return {};
  return projected.narrow(-1, it->second.offsets[i], it->second.layers[i]->weight.size(0));
}

std::array<at::Tensor, 3> project_qkv(const FusedLinears* fused, const void* owner, LinearImpl& q, LinearImpl& k,
                                      LinearImpl& v, const at::Tensor& x) {
  if (fused && fused->intact()) {
    const auto all = fused->project(x);
    return {fused->part(all, owner, 0), fused->part(all, owner, 1), fused->part(all, owner, 2)};
  }
  return {q.forward(x), k.forward(x), v.forward(x)};
}

}  // namespace diffract::models
