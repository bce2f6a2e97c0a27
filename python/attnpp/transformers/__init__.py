"""attnpp in Hugging Face ``transformers`` models: ``attn_implementation="attnpp"``, and a lean training step.

::

    import attnpp.transformers  # registers "attnpp" with transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnpp")
    attnpp.transformers.apply(model)  # the fused loss in the training forward (or attnpp.transformers.from_pretrained)

Importing this package (which imports ``transformers``; ``import attnpp`` alone never does) calls ``register()``:
``"attnpp"`` joins transformers' ``AttentionInterface`` (the attention of every layer) and
``AttentionMaskInterface`` (the mask a model builds once per forward), as FlashAttention and FlexAttention do.
Every attention layer of a model then runs ``attnpp.torch``'s operators: attnpp's forward, and its backward under
autograd, in float32, float64, bfloat16 or float16, on the CPU. A model class whose attention does not go through
the interface (Falcon) is refused when it is built, with a ``ValueError`` naming the class.

The mask function does not build the dense (B, 1, L, S) mask that ``sdpa`` and ``eager`` get. It reads the mask
a model asks for and passes its structure on, as a ``KeyLayout``:

- causal attention becomes ``is_causal`` (key blocks above the diagonal are skipped), aligned to the query's
  position in the cache (the cache's offsets: prefill, decoding with ``DynamicCache``, a static cache's unused
  slots cut off);
- a sliding window of w tokens (Mistral, Gemma 2 and 3, gpt-oss, Qwen's windowed layers) becomes
  ``window=(w - 1, 0)``: the key blocks outside every row's window are skipped, so its cost follows L * w,
  not L * S;
- padding (the 2D ``attention_mask`` of a padded batch, left or right) becomes ``key_padding_mask`` (B, S),
  which combines with the causal mask and the window without an (L, S) array;
- a bidirectional (encoder) mask runs without a causal mask;
- packed sequences (position ids that restart within a row, no 2D mask and no cache: ``DataCollatorWithFlattening``,
  TRL's padding-free batches) and chunked attention (Llama 4's ``attention_chunk_size``) are block-diagonal: their
  blocks become the offsets ``cu_seqlens`` of ``scaled_dot_product_attention_varlen``, forward and backward, with
  the layers' window, soft-capping, sinks and grouped-query heads; no (L, L) mask is built and no block across
  sequences or chunks computed. (Chunks over a cache, or over a batch padded in the middle of a row, are built
  dense.)

Any other mask (a custom 4D mask from the user, image tokens' bidirectional blocks) is built dense by
transformers' own ``sdpa_mask`` and passed as ``attn_mask``: correct, without the block skipping. The attention
function maps the layer's arguments: ``scaling`` to ``scale``, ``softcap`` (Gemma 2) to ``softcap``, ``s_aux``
(gpt-oss's sinks, with their gradient) to ``sinks``, ``dropout`` to ``dropout_p``, T5's ``position_bias`` to a
float mask with its gradient; key/value heads fewer than the query's (GQA) are read as they are
(``enable_gqa``), never repeated; ``output_attentions=True`` returns the weights (computed only then). A query of
one token (a decoding step) takes attnpp's few-rows path (the heads of a group share key blocks).

``apply(model)`` makes a causal LM's training forward with labels compute its loss with attnpp's fused linear +
cross-entropy, without the (B, L, V) logits, and its RMSNorms and gated MLPs keep half of their activations for the
backward (recomputing the rest); ``revert(model)`` undoes it; ``from_pretrained`` and ``from_config``
load a model with ``"attnpp"`` and apply it.

The attention runs attnpp's registered operators (``attnpp.torch``): a model traces whole under
``torch.compile(model, fullgraph=True)``, and a model on the meta device propagates shapes.

Not supported, with a clear error rather than another implementation: tensors off the CPU (ValueError from
``attnpp.torch``), ``output_attentions=True`` and ``position_bias`` on packed sequences and chunks (ValueError).

Tested with transformers 5.24 on random-initialised Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, gpt-oss,
Phi-3, GPT-2, SmolLM3 and OLMo 2 configurations, Llama 4's chunked attention and T5
(``tests/test_transformers.py``, ``tests/test_transformers_training.py``).

Layout: ``_attention`` (the attention and mask functions, ``KeyLayout``, the registration), ``_packing`` (the
mask functions read, packed sequences and chunks as varlen offsets), ``_loss`` (``apply``, ``revert``, the
loaders), ``_activations`` (the RMSNorms and gated MLPs that ``apply`` patches).
"""
from ._attention import NAME, KeyLayout, attention_forward, attention_mask, register
from ._loss import TESTED, apply, from_config, from_pretrained, revert

__all__ = ["register", "attention_forward", "attention_mask", "KeyLayout", "NAME", "apply", "revert",
           "from_pretrained", "from_config", "TESTED"]

register()
