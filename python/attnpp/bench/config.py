"""The benchmark's configuration: the sizes of the default run and of ``--quick``, the issues' targets, the pairs
each slow case times, and the environment that forces a CPU level (``--capability``)."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError:  # the library works without PyTorch; only this comparison needs it
    sys.exit('attnpp.bench compares attnpp with PyTorch, which is not installed: pip install ".[test]"')

MIB = 2.0 ** 20
# the half-precision dtypes of the cases that name one: NumPy's (ml_dtypes') and PyTorch's
HALVES = {"bfloat16": (np.dtype(ml_dtypes.bfloat16), torch.bfloat16), "float16": (np.dtype(np.float16), torch.float16)}
# issue 21's target ratio of the half-precision kernel cases at attnpp's CPU level: 1.5 with bfloat16 instructions
# (AVX512_BF16), 1.0 at avx2 and avx512 (the issue asks it at --capability avx2), none at the baseline
HALF_TARGETS = {"avx512_bf16": 1.5, "avx512": 1.0, "avx2": 1.0}
# issue 37's for their forward where it asks more: 1.3 at avx2 and at avx512 (AVX-512 without AVX512_BF16)
HALF_FORWARD_TARGETS = {"avx512": 1.3, "avx2": 1.3}
MEMORY_LIMIT_MIB = 256  # the bound on attnpp's temporaries in the memory case

# Sizes of the default run and of --quick (which only checks that every case kind runs).
SIZES = {
    False: dict(kernel=[((1, 12, 1024, 64), False), ((1, 12, 1024, 64), True), ((8, 12, 256, 64), False),
                        ((8, 12, 256, 64), True), ((1, 12, 4096, 64), True)],
                memory=(1, 12, 8192, 64), mha=(4, 512, 768, 12), article004=(30, 50, 512, 8),
                window=((1, 12, 4096, 64), 256), decode=(8, 32, 8, 128, 4096), varlen=(8, 37, 1024, 12, 64),
                steps=10000, repeats=10, min_sample=0.020, sgemm=2048,
                transformers=dict(model=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
                                  label="125M", prefill=(2048, 8192), window=(1024, 8192), decode=(2048, 64)),
                lce=(4096, 768, 50257), lce_article=(30, 5, 50257), lce_memory=(8192, 768, 50257),
                context_parallel=(1, 12, 16384, 64),
                causal_length=(((12, 64), (32, 128)), (2048, 4096, 8192, 16384, 32768)),
                decode_length=((1, 32, 8, 128), (4096, 8192, 16384, 32768)),
                fine_tune=dict(model=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                          num_attention_heads=12, num_key_value_heads=4), label="125M",
                               vocabs=(32000, 128256), rows=4, length=1024, steps=1)),
    True: dict(kernel=[((1, 2, 64, 16), False), ((2, 2, 32, 16), True)],
               memory=(1, 2, 256, 16), mha=(2, 16, 32, 4), article004=(2, 10, 64, 8),
               window=((1, 2, 128, 16), 16), decode=(2, 4, 2, 16, 64), varlen=(3, 5, 40, 2, 16),
               steps=9, repeats=3, min_sample=0.002, sgemm=256,
               transformers=dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
                                 label="tiny", prefill=(64, 128), window=(16, 128), decode=(64, 4)),
               lce=(64, 16, 500), lce_article=(30, 5, 500), lce_memory=(128, 16, 500),
               context_parallel=(1, 2, 256, 16),
               causal_length=(((2, 16), (4, 32)), (32, 64)), decode_length=((1, 4, 2, 16), (64, 128)),
               fine_tune=dict(model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2), label="tiny",
                              vocabs=(500,), rows=2, length=48, steps=1)),
}
# fine_tune: the Llama-like model's configuration (its embedding tied to the output projection, as Llama 3.2's),
# the vocabularies, B rows of L tokens a step (L no dimension of the model has: the dense masks are counted as
# the tensors with two dimensions of size L), the timed steps (after a warm-up) of each configuration;
# window: ((B, H, L, D), window); decode: (B, query heads, KV heads, D, cached tokens); varlen: (sequences, shortest,
# longest, H, D); transformers: the Llama-like model's configuration, prefill lengths, the Mistral-like model's
# (window, tokens), decode (prompt tokens, new tokens); causal_length: ((H, D) pairs, lengths L) at B = 1 (issue 37);
# decode_length: ((B, query heads, KV heads, D), cached tokens S) (issue 37)
TRANSFORMERS_PAIRS = 3  # a prefill of 8192 tokens takes seconds per call
TRANSFORMERS_TARGETS = {"prefill": 1.3, "window": 3.0}  # issue 22: attention time, sdpa's / attnpp's
# issue 38: tokens/s of attnpp with the fused loss against sdpa with transformers' loss, on padded micro-batches and
# on packed rows; the packed run's peak resident set at most this share of sdpa's, by vocabulary
FINE_TUNE = dict(speed={"attnpp fused": 1.1, "attnpp fused packed": 1.3}, memory={32000: 0.50, 128256: 0.35})
TRAINING_TARGET = 3.0  # issue 23: article 001's training at least 3 times as fast as PyTorch
MEMORY_PAIRS = 3  # the memory case takes seconds per call: 3 pairs are enough
# issue 24: 2 ranks of one thread against one process of two threads (attnpp both): at least 0.8 of its speed on
# the balanced cases; per rank at most 60% of the one process's memory (inputs included); zigzag's causal forward
# at most 60% of the non-causal forward's time
CONTEXT_PARALLEL = dict(ranks=2, pairs=3, speed=0.8, memory=0.6, zigzag=0.6)
SGEMM_SAMPLES = 5  # the sgemm is one reference figure, not a comparison: the median of 5 is stable enough
SGEMM_TARGET = 0.85  # issue 37's target: attnpp's attention forward at >= 85% of the same run's GEMM rate
# the multiply-add peak (measure.peak_gflops): steps a task of cpp/peak.cpp's loop (about 0.1 ms at AVX2 on a 3 GHz
# core), and the least a sample lasts, so that waking the threads is under 0.1% of it
PEAK_STEPS, PEAK_MIN_SAMPLE = 1 << 15, 0.1
# the forward's products alone (measure.forward_products_gflops): on the blocks of these head widths, this many steps
# a task (each about 0.35 ms at D = 64 on a 3 GHz core at AVX2: the refill of a task's inputs under 1% of it)
PRODUCT_HEAD_DIMS, PRODUCT_STEPS = (64, 128), 16

# --capability LEVEL: the environment that loads each library at that level. attnpp and PyTorch (ATen) share the
# level names; MKL (PyTorch's float products) and oneDNN (its bfloat16 products: torch.mm and the flash
# attention's GEMMs) have names of their own and would otherwise keep their own pick: uncapped, oneDNN multiplies
# bfloat16 with AVX512_BF16 at "avx2" too, and on a CPU without AVX-512 PyTorch takes its own bfloat16 GEMM instead.
# avx512 is attnpp's level without AVX512_BF16: oneDNN's AVX512_CORE.
# MKL takes its variable on Intel's CPUs only ("not available on non-Intel processors", its developer guide): on
# the 2-core EPYC its sgemm ran at 176 GFLOP/s under SSE4_2, as uncapped. OpenBLAS (NumPy's BLAS) takes a core type
# on every vendor's CPU (at Nehalem, SSE4.2: 66 GFLOP/s there): at a forced level its sgemm is the level's GEMM rate
# (report.gemm_products).
MKL_INSTRUCTIONS = {"default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}
ONEDNN_ISA = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE"}
OPENBLAS_CORETYPE = {"default": "Nehalem", "avx2": "Haswell", "avx512": "SkylakeX"}
# NumPy's sgemm, one of the limits, is measured at the core type of attnpp's level, whatever the environment says:
# some hosts set OPENBLAS_CORETYPE=Haswell for every process (an older OpenBLAS misread their CPU), and at the
# avx512_bf16 level of a 2-core AMD EPYC (Zen 5) that AVX2 sgemm made attnpp's forward 178% "of the limit"
# (measure.numpy_sgemm_gflops). avx512_bf16's float32 products are avx512's.
OPENBLAS_LEVEL_CORE = {**OPENBLAS_CORETYPE, "avx512_bf16": "SkylakeX"}
CAPABILITY_VARS = ("ATTNPP_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                   "OPENBLAS_CORETYPE")


def capability_env(level):
    """The environment variables that force ``level`` on attnpp, PyTorch, MKL, oneDNN and OpenBLAS (each reads its
    own at import). ValueError for a level without them (avx512_bf16, the top level: nothing to force there)."""
    if level not in MKL_INSTRUCTIONS:
        raise ValueError(f"capability_env: no level {level!r} to force; the levels: {', '.join(MKL_INSTRUCTIONS)}")
    return dict(zip(CAPABILITY_VARS, (level, level, MKL_INSTRUCTIONS[level], ONEDNN_ISA[level],
                                      OPENBLAS_CORETYPE[level])))
