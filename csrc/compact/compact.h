// save_compact's native side: compaction by a bitmap and the BatchNorm
// replay: the kernels (compact_cpu.cpp, replay_cpu.cpp; on CUDA cuda_host.cpp,
// which launches cuda.cu's) that their ops (schema and CPU / CUDA wrappers:
// ops.cpp; autograd kernels: autograd.cpp) call.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "activations/activations.h"
#include "core/checks.h"

namespace relu_ext {

// The compaction ops' checks of a tensor they compact (float, dense) and of its
// mask (ops.cpp); `op` names the caller in the error.
void check_compactable(const at::Tensor& t, const char* op, const char* arg);
void check_compaction_mask(const at::Tensor& mask, const at::Tensor& t, const char* op);

// Compaction by a bitmap (compact_cpu.cpp), on dense tensors in memory order,
// elements of 2, 4 or 8 bytes moved as integers. compact: the elements whose
// bit is set, and in *missed the number of the others that are not +0 (bits
// all zero), which expand cannot restore; expand: the inverse into `out`
// (bits unset become +0); nonzero_mask: the bitmap of elements whose bits are
// not all zero.
at::Tensor compact_cpu(const at::Tensor& y, const uint8_t* mask, int64_t* missed);
// Compaction in two steps, so that the host need not wait for the count in
// between (save_compact's pack hook reads it through its deferred result): the
// count (compact_count: on the CPU the total, kept_count_cpu; on CUDA each
// tile's inclusive sum, compact_count_cuda), then compact_into, which fills
// `values` sized by the total and returns compact's missed, which is nonzero
// where values' size is not the total (on the CPU 1, nothing written; on
// CUDA nothing written past values).
int64_t kept_count_cpu(const uint8_t* mask, int64_t n);
// compact at once (save_compact's pack hook on the CPU): y by `mask` where that
// restores it (missed nothing), else by y's own nonzero_mask; (values, the
// mask used, whether it is `mask`). The checks are the caller's
// (check_compactable, check_compaction_mask).
std::tuple<at::Tensor, at::Tensor, bool> compact_now_cpu(const at::Tensor& y, const std::optional<at::Tensor>& mask);
int64_t compact_into_cpu(const at::Tensor& y, const uint8_t* mask, const at::Tensor& values);
void expand_cpu(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out);
void nonzero_mask_cpu(const at::Tensor& y, uint8_t* mask);
// A tensor of +0 and at most one other bit pattern (CPU dropout's noise: 0
// and 1 / (1 - p)): binary_mask writes its nonzero_mask and that pattern into
// `value` (a scalar of y's dtype; +0 when there is none), and returns false,
// the mask then unfinished, when y has a second nonzero pattern;
// binary_expand is the inverse into `out`.
bool binary_mask_cpu(const at::Tensor& y, uint8_t* mask, const at::Tensor& value);
void binary_expand_cpu(const uint8_t* mask, const at::Tensor& value, const at::Tensor& out);
// Whether a and b (CPU, the same sizes and dtype, any strides) hold the same
// bits (compact_cpu.cpp; save_compact's check that a concatenation begins
// with the one before it). torch.equal compares numbers (NaN != NaN), one
// element at a time; this compares memory, a contiguous run at a time.
bool same_bits_cpu(const at::Tensor& a, const at::Tensor& b);
// The sum of a dense CPU tensor's bytes as 64-bit words from its first element
// (the last word zero-padded), modulo 2**64 (compact_cpu.cpp): a fingerprint
// that a change of one element's bits always changes, the same however the
// sum is split (save_compact's check of a remade tensor's rebuild).
int64_t bits_sum_cpu(const at::Tensor& t);


#ifdef WITH_CUDA
// Compaction as the CPU's above, on y's device and current stream. compact
// sets `missed` to an int64 scalar tensor on the device (not read back: the
// one host sync is for the size of values); compact_count gives the
// inclusive sum of each tile's kept elements (its last entry the total; one
// entry, 0, for an empty y) and compact_into, with them, fills values and
// returns `missed` (see compact_into_cpu) without a sync; expand with `check`
// compares the mask's total with values' size on the host (a sync), without
// reads no element past values either way; nonzero_mask's mask must be
// 4-byte aligned (a fresh allocation is).
at::Tensor compact_cuda(const at::Tensor& y, const uint8_t* mask, at::Tensor& missed);
at::Tensor compact_count_cuda(const at::Tensor& y, const uint8_t* mask);
at::Tensor compact_into_cuda(const at::Tensor& y, const uint8_t* mask, const at::Tensor& ends, const at::Tensor& values);
void expand_cuda(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out, bool check);
void nonzero_mask_cuda(const at::Tensor& y, uint8_t* mask);
#endif

// BatchNorm -> activation replay (replay_cpu.cpp; save_compact's recipes).
// bn_terms_cpu: PyTorch's CPU BatchNorm terms per channel into alpha / beta
// (opmath, `var` being save_invstd in training, running_var in eval).
// bn_act_cpu: act(BN(x)) for a dense x with its channels in dimension 1, or,
// given x2 (laid out as x), act(BN(x) + BN2(x2)) (the residual add); `act`
// "relu" or a trait's kName with its arguments; written into y, or with
// `verify` compared with y bit for bit (y unchanged; returns whether equal).
void bn_terms_cpu(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                  const at::Tensor& mean, const at::Tensor& var, bool training, double eps, const at::Tensor& alpha,
                  const at::Tensor& beta);
bool bn_act_cpu(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x2,
                const at::Tensor& alpha2, const at::Tensor& beta2, const std::string& act, c10::ArrayRef<double> args,
                const at::Tensor& y, bool verify);


#ifdef WITH_CUDA
// The CUDA replay (cuda_host.cpp): bn_act_cpu's contract with PyTorch's CUDA
// transform and terms (bn_terms on CUDA: alpha = [weight; invstd], beta =
// [mean; bias], 2 x C); with `differ` (an int32 scalar on x's device), the
// comparison sets it to 1 where an element differs, else y is written.
void bn_act_cuda(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x2,
                 const at::Tensor& alpha2, const at::Tensor& beta2, const std::string& act, c10::ArrayRef<double> args,
                 const at::Tensor& y, const at::Tensor& differ);
#endif

// Typed handles to the ops through the dispatcher: the autograd kernels call
// the CPU / CUDA kernels through them, and relu_ext._C's host entries
// (module.cpp) the ops themselves, without Python's op-call machinery.
using CompactFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&);
using ExpandFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef);
using CheckedExpandFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, bool);
using CompactCountFn = at::Tensor(const at::Tensor&, const at::Tensor&);
using CompactIntoFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using NonzeroMaskFn = at::Tensor(const at::Tensor&);
using BinaryMaskFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&);
using BnTermsFn = std::tuple<at::Tensor, at::Tensor>(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                     const at::Tensor&, const at::Tensor&, bool, double, at::ScalarType);
using OptTensor = std::optional<at::Tensor>;
using BnActVerifyFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                 at::ArrayRef<double>, const at::Tensor&, const OptTensor&, const OptTensor&,
                                 const OptTensor&);
using BnActRebuildFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                  at::ArrayRef<double>, const OptTensor&, const OptTensor&, const OptTensor&);

RELU_EXT_OP_HANDLE(compact_op, "compact", CompactFn)
RELU_EXT_OP_HANDLE(compact_count_op, "compact_count", CompactCountFn)
RELU_EXT_OP_HANDLE(compact_into_op, "compact_into", CompactIntoFn)
RELU_EXT_OP_HANDLE(expand_op, "expand", CheckedExpandFn)
RELU_EXT_OP_HANDLE(nonzero_mask_op, "nonzero_mask", NonzeroMaskFn)
RELU_EXT_OP_HANDLE(binary_mask_op, "binary_mask", BinaryMaskFn)
RELU_EXT_OP_HANDLE(binary_expand_op, "binary_expand", ExpandFn)
RELU_EXT_OP_HANDLE(bn_terms_op, "bn_terms", BnTermsFn)
RELU_EXT_OP_HANDLE(bn_act_verify_op, "bn_act_verify", BnActVerifyFn)
RELU_EXT_OP_HANDLE(bn_act_rebuild_op, "bn_act_rebuild", BnActRebuildFn)

}  // namespace relu_ext
