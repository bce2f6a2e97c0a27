"""What a transformers mask function means, read from its closures, and the block-diagonal ones as varlen offsets.

transformers builds each layer's mask from a mask function (``transformers.masking_utils``): its own causal,
sliding-window causal, chunked causal (Llama 4's ``attention_chunk_size``) and bidirectional functions, and, for
packed sequences (position ids that restart within a row, no 2D mask, no cache), that function on the positions
(``remap_positions_for_packed_sequence``) and-ed with the packed sequences' own (``packed_sequence_mask_function``).
``read_pattern`` recognises these by their identity and their closures' names; any other function (the user's,
image tokens' blocks, ...) is not recognised, and its mask is built dense.

Packed sequences and chunks are both block-diagonal causal structures over a row: ``cu_seqlens`` gives attnpp's
varlen call the offsets of every block of the (B * L) tokens (a row's start, each sequence's start, each chunk's
start), so no (L, L) mask is built and no block across sequences or chunks is computed.
"""
from typing import NamedTuple, Optional

import torch
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function


class Pattern(NamedTuple):
    """A mask function's meaning.

    Attributes:
        is_causal (bool): query i sees keys j <= i (else every key).
        window (int or None): sliding window of ``window`` tokens: query i sees keys j > i - window.
        chunk (int or None): chunked attention: query i sees keys of its own chunk of ``chunk`` tokens only.
        left_padding (Tensor or None): (B,) the chunks' offsets (transformers' ``chunked_overlay``).
        sequence_ids (Tensor or None): (B, L) packed sequences: which sequence of its row each token belongs to.
        positions (Tensor or None): (B, L) the packed tokens' position ids (where chunks restart).
    """
    is_causal: bool
    window: Optional[int] = None
    chunk: Optional[int] = None
    left_padding: Optional[torch.Tensor] = None
    sequence_ids: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None

    @property
    def blocks(self):
        """True when the mask is block-diagonal (packed sequences or chunks): varlen's, not a ``KeyLayout``'s."""
        return self.chunk is not None or self.sequence_ids is not None


def _closure(function):
    """The values of ``function``'s closure cells by name ({} for a function without)."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in cells))) if code is not None else {}


def _is(function, qualname):
    return getattr(function, "__qualname__", "") == qualname


def read_pattern(mask_function):
    """The ``Pattern`` of transformers' own mask functions; None for any other."""
    if mask_function is causal_mask_function:
        return Pattern(True)
    if mask_function is bidirectional_mask_function:
        return Pattern(False)
    if not _is(mask_function, "and_masks.<locals>.and_mask"):
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    if len(parts) != 2:
        return None
    first, second = parts
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function); chunked:
    # and_masks(chunked_overlay(chunk, left_padding), causal_mask_function)
    if second is causal_mask_function:
        if _is(first, "sliding_window_overlay.<locals>.inner_mask"):
            window = _closure(first).get("sliding_window")
            return Pattern(True, window=window) if isinstance(window, int) and window > 0 else None
        if _is(first, "chunked_overlay.<locals>.inner_mask"):
            cells = _closure(first)
            chunk, left = cells.get("chunk_size"), cells.get("left_padding")
            if isinstance(chunk, int) and chunk > 0 and isinstance(left, torch.Tensor):
                return Pattern(True, chunk=chunk, left_padding=left)
        return None
    # packed: and_masks(remap_positions_for_packed_sequence(base, position_ids), packed_sequence_mask_function(ids))
    if _is(first, "remap_positions_for_packed_sequence.<locals>.inner_mask") and \
            _is(second, "packed_sequence_mask_function.<locals>.inner_mask"):
        remap, packed = _closure(first), _closure(second)
        base = read_pattern(remap.get("mask_function"))
        ids, positions = packed.get("packed_sequence_mask"), remap.get("position_ids")
        if base is not None and base.sequence_ids is None and base.is_causal and \
                isinstance(ids, torch.Tensor) and isinstance(positions, torch.Tensor):
            return base._replace(sequence_ids=ids, positions=positions)
    return None


def cu_seqlens(pattern, batch_size, length):
    """The varlen offsets (blocks + 1,) int64 of a block-diagonal ``pattern`` over B rows of L tokens flattened
    (row b's token i is token b * L + i): a block starts at each row's start, where the sequence changes and where
    a chunk starts (a position, or without packing an index, that is a multiple of the chunk, after the row's
    left padding)."""
    B, L = batch_size, length
    starts = torch.zeros(B, L, dtype=torch.bool)
    starts[:, 0] = True
    if pattern.sequence_ids is not None:
        ids = pattern.sequence_ids.expand(B, L)
        starts[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    if pattern.chunk is not None:
        if pattern.positions is not None:
            where = pattern.positions.expand(B, L)
        else:
            where = torch.arange(L).expand(B, L)
        where = where - pattern.left_padding.reshape(-1, 1).to(where.dtype)
        starts |= where % pattern.chunk == 0
    first = starts.flatten().nonzero().flatten()
    return torch.cat([first, first.new_tensor([B * L])])


def block_offsets(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, padding):
    """``cu_seqlens`` of a block-diagonal ``pattern`` when varlen expresses it: a forward over the whole rows
    (no cache: L = S, both offsets 0) and, for chunks over a padded batch, each row's real tokens contiguous (left
    and right padding: the left padding's tokens, which the chunks start after, form blocks of their own, and a
    right padding's sees the real tokens before it but none sees it, so the real tokens' results are the dense
    mask's); else None (the mask is then built dense). ``padding``: the (B, S) bool mask of real tokens, or
    None. Not while torch.compile traces or on the meta device (the offsets are data)."""
    if torch.compiler.is_compiling() or q_length != kv_length or int(q_offset) != 0 or int(kv_offset) != 0:
        return None
    if pattern.sequence_ids is not None and pattern.sequence_ids.is_meta:
        return None
    if padding is not None:
        if padding.is_meta:
            return None
        idx = torch.arange(kv_length)
        left = pattern.left_padding.reshape(-1, 1) if pattern.left_padding is not None else 0
        inside = (idx >= left) & (idx < left + padding.sum(-1, keepdim=True))
        if not torch.equal(inside.expand_as(padding), padding.to(torch.bool)):
            return None
    return cu_seqlens(pattern, batch_size, q_length)
