// The interface through which parallel strategies attach to the model (see Transformer::set_hooks).
#pragma once
#include <cstdint>

namespace mt {

// How parallel strategies attach to the model: called around every unit, and as parts of a
// unit's gradient become ready. Default implementations do nothing (and take nothing over).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void pre_forward(int unit) {}
  virtual void post_forward(int unit) {}
  virtual void pre_backward(int unit) {}
  virtual void post_backward(int unit) {}
  // A split backward (zero-bubble schedules): pre_backward(unit) opens the unit's input gradient
  // (B), which records where its weight gradients go; pre_weights(unit) opens its weight gradients
  // (W), run later (other micro-batches' B and W of the unit may come between), and
  // post_backward(unit) follows the W (not the B).
  virtual void pre_weights(int unit) {}
  // Parameter `param` (an index into params()) whose gradient is a lookup's - token rows added at
  // token ids (the token embedding): returning true takes those rows over. The backward then does
  // not add them into the gradient but hands them to sparse_grad (n token ids, [n, width] rows,
  // valid until the next backward) right before its unit's post_backward; the hook adds them.
  // Asked at every forward and backward of the unit (the model offers it only where the
  // parameter's dense gradient from elsewhere is complete before that: can_hand_sparse_grad).
  virtual bool takes_sparse_grad(int param) { return false; }
  virtual void sparse_grad(int param, const int32_t* ids, const float* rows, int64_t n) {}
  // Rows of parameter `param`'s gradient per grad_ready call (0: none). A unit that computes a
  // parameter's gradient by rows (the head's tied weight gradient, while the lookup's part is
  // taken over) calls grad_ready(param, first_row, end_row) as each run of rows is final, so the
  // hook can reduce them while the rest of backward runs.
  virtual int64_t grad_ready_rows(int param) { return 0; }
  virtual void grad_ready(int param, int64_t first_row, int64_t end_row) {}
};

}  // namespace mt
