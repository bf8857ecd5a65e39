"""relu_ext benchmark: every peer timed in the same run, interleaved, against a copy's bandwidth.

    python -m relu_ext.bench [--device cpu|cuda] [--dtypes float32,bfloat16]
                             [--sizes 65536,...] [--what kernels,family,small,memory,models,compiled]
                             [--models resnet18,...] [--compile-backend inductor]
                             [--model MODULE:CALLABLE --input-shape N,C,H,W]
                             [--impls torch,torch_out,compile,triton,seed,relu_ext,installed]
                             [--rounds N] [--budget S] [--max-spread F] [--quick]
                             [--malloc steady|as-is] [--cuda-unroll 1|2|4] [--cuda-waves 0..64]
                             [--out DIR] [--name NAME] [--no-files]

    python -m relu_ext.bench --quick                  a smoke run of the default sections
    python -m relu_ext.bench --model mypkg.models:build --input-shape 8,3,224,224
                                                      your model under the memory section's configurations

Sections (--what):
  kernels  per dtype and size: fwd (no grad), fwd (train: what a training
           forward writes), bwd (from what the forward saved), fwd+bwd
           (autograd.grad) and in-place, for every implementation, plus a
           copy_ into a preallocated buffer: the bandwidth ceiling.
  family   the same for the family's activations (relu6, leaky_relu, threshold,
           hardsigmoid): forward, training forward, backward, in place, vs torch.
  small    per call at 1K-64K elements, the fixed cost of a call: no-grad
           forward and fwd+bwd of the function (torch.relu / relu_ext.relu)
           and of the module (nn.ReLU / relu_ext.ReLU).
  memory   bytes saved for backward per element of one activation; and real
           models (torchvision resnet18, resnet50, vgg11, googlenet,
           densenet121, mobilenet_v2, a darknet-style CNN, transformers' T5
           with ReLU, OPT, BERT, GPT-2, Llama and Gemma (2 layers of 256,
           4x256 tokens), timm's vit_tiny_patch16_224 and mlp50 (50 x
           Linear(64, 64) -> ReLU, 128 rows: the hooks' own host time),
           random weights, training mode; --quick: resnet18 and T5 at toy
           sizes, and mlp50) under six
           configurations, nn.ReLU, install (relu_ext.install()),
           install+compact (and relu_ext.save_compact(recompute=False)),
           install+recompute (and relu_ext.save_compact()),
           nn.ReLU+compact, and sac nn.ReLU (what users pick instead in
           eager mode: op-level selective activation checkpointing, each
           block checkpointed, matmuls and attention saved; its held bytes
           counted from the allocator):
           bytes their autograd graph holds after forward (counted exactly
           from what the saved-tensor hooks keep), the peak of one training
           step (one fresh process per configuration) and its time
           (interleaved rounds), each vs nn.ReLU. --models picks some; a model
           whose package (torchvision, transformers) is missing is skipped, with
           a line saying so. --model MODULE:CALLABLE --input-shape N,C,H,W runs
           your own model instead (MODULE: a module name or a .py file;
           CALLABLE() returns the nn.Module, given a random input of that shape;
           with --model, --what defaults to memory).
  models   time of one training step (forward, loss, backward, SGD) of three
           small models (MLP, MLP with dropout, CNN with max-pool) with each
           activation.
  compiled (on request: not among the default sections, as compiling takes
           minutes) what users pick instead, on the memory section's real
           models: torch.compile (--compile-backend, default inductor), as
           they are and with relu_ext.convert()'s modules (an op the compiler
           does not fuse): held bytes, peak and step time, vs compiled
           nn.ReLU, and held bytes vs eager nn.ReLU with --what
           memory,compiled.

Implementations (--impls): torch (torch.relu / nn.ReLU), torch_out (torch.clamp
with out=, forward only), compile (torch.compile of F.relu), triton (a Triton
ReLU, CUDA only), seed (the tutorial autograd.Function: clamp, then
grad[x < 0] = 0), relu_ext, installed (PyTorch's own F.relu / nn.ReLU with
relu_ext.install() active around its blocks; small section). On CPU, seed and compile (2-25x slower than torch)
are timed up to 16M elements in the kernel section.

Timing: per dtype and size, every implementation of every case and the copy
run interleaved in --rounds rounds (one block of calls each per round, the
order shuffled each round), so load that comes and goes hits all alike. A figure is the
median over the rounds; "vs torch" (time / torch's time, <1: faster) and
"% of copy" are medians of the per-round ratios. CPU: torch.utils.benchmark's
Timer with torch's thread count; CUDA: triton.testing.do_bench (L2 flushed
before each call), or CUDA events. GB/s counts the bytes each implementation
must move at least (the relu_ext mask: 1 bit per element). By default
(--malloc steady) the process's glibc malloc reuses freed memory of every
size, as a caching allocator does: interleaving otherwise resets glibc's
adaptive thresholds, and whether a call pays page faults on its fresh output
would depend on what ran before it. --malloc as-is keeps glibc's defaults
(allocating ops of 32 MiB and more then page-fault on every call).

Trust: a figure whose rounds disagree (interquartile range above --max-spread
of the median) is marked ~; a row whose copy ran below half of the best copy
this run measured at that dtype and size is marked ! (the machine was busy).
The marks are in the tables, in the JSON ("marks") and hollow in the plot; a
busy machine (load average at least half the CPUs) is warned about at start.

Writes NAME.json (every figure, every round, and the environment) and NAME.png
(GB/s vs size per dtype and case, per-call time of small tensors, memory) into
--out DIR, by default relu_ext-bench-results/ in the current folder; NAME has
the device, the CPU or GPU, the date and the time, so a run never overwrites
another. --no-files: the tables only.
"""
