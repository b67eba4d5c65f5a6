// The tensors a transfer reads, as the copy engine walks them: in order.
//
// A list of thousands of tensors from Python costs tens of nanoseconds a tensor to
// convert (pybind11's list caster), which delays the first DMA by the whole list's
// conversion if it all happens before the engine starts. A source made with a
// `Fill` converts on demand, a batch at a time, so the engine can queue the
// first group's copy while the rest of the list is still Python objects.
// A source made from a std::vector borrows it, fully converted.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace offload {

class TensorSource {
 public:
  // Appends tensors to `into` until it holds at least `upto` (at most size()).
  using Fill = std::function<void(std::vector<at::Tensor>& into, size_t upto)>;

  explicit TensorSource(const std::vector<at::Tensor>& tensors)
      : size_(tensors.size()), items_(&tensors) {}

  TensorSource(size_t size, Fill fill) : size_(size), fill_(std::move(fill)), items_(&owned_) {
    owned_.reserve(size);  // references handed out stay valid while it fills
  }

  // A source that owns `tensors` (converted already), for work that outlives its caller.
  static std::unique_ptr<TensorSource> owning(std::vector<at::Tensor> tensors) {
    auto source = std::make_unique<TensorSource>(tensors.size(), Fill());
    source->owned_ = std::move(tensors);
    return source;
  }

  TensorSource(const TensorSource&) = delete;
  TensorSource& operator=(const TensorSource&) = delete;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  const at::Tensor& operator[](size_t i) {
    if (i >= items_->size()) fill_to(i + 1);
    return (*items_)[i];
  }

  // The tensors converted so far (all of them once the engine walked the list).
  const std::vector<at::Tensor>& converted() const { return *items_; }

  // Converts what is left. A source whose Fill reads Python objects must be
  // complete before the list it borrows can go (the call that made it returns).
  void convert_all() {
    if (size_ > 0) (*this)[size_ - 1];
  }

  // Every tensor, converted; moved out of a source that owns them (no reference
  // count changes), after which the source is spent.
  std::vector<at::Tensor> take() {
    convert_all();
    if (items_ != &owned_) return *items_;
    return std::move(owned_);
  }

 private:
  static constexpr size_t kBatch = 256;
  // The first batch is small: the first group's copy waits for it, and it needs
  // only a few tensors.
  static constexpr size_t kFirstBatch = 16;

  void fill_to(size_t upto) {
    TORCH_CHECK_INDEX(upto <= size_, "offload: tensor ", upto - 1, " of a list of ", size_);
    const size_t batch = owned_.empty() ? kFirstBatch : kBatch;
    fill_(owned_, std::min(size_, std::max(upto, owned_.size() + batch)));
  }

  size_t size_;
  Fill fill_;
  std::vector<at::Tensor> owned_;
  const std::vector<at::Tensor>* items_;
};

}  // namespace offload
