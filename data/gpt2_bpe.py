"""GPT-2's BPE through tiktoken, for the BPE prepare scripts and sample.py.

GPT2_BPE_DIR names a folder that holds GPT-2-format BPE files, vocab.bpe and encoder.json (as
OpenAI published them for GPT-2): set, the encoding is built from those two, and tiktoken neither
reads its cache nor fetches anything. Unset, it is tiktoken's 'gpt2', downloaded on first use
(offline, TIKTOKEN_CACHE_DIR names a folder that already holds its files).
"""
import json
import os

# GPT-2's pre-tokenizer pattern, as its encoder.py has it (tiktoken's 'gpt2' splits text the same way)
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"


def data_gym_bytes():
    """{character: byte} of GPT-2's files, which spell each byte as one printable character: the
    printable bytes but space as themselves, then the other 68 as chr(256), chr(257), ... The
    order is the byte tokens' rank order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def encoding_from_files(folder):
    """The tiktoken encoding of folder/vocab.bpe (the merges, in rank order after the 256 byte
    tokens) and folder/encoder.json (every token's id, which must agree with those ranks)."""
    import tiktoken
    to_byte = data_gym_bytes()
    try:
        with open(os.path.join(folder, "vocab.bpe"), encoding="utf-8") as f:
            merges = [line.split() for line in f.read().split("\n")[1:] if line]  # (line 1: '#version: 0.2')
        with open(os.path.join(folder, "encoder.json"), encoding="utf-8") as f:
            encoder = json.load(f)
        ranks = {bytes([b]): i for i, b in enumerate(to_byte.values())}
        for rank, (first, second) in enumerate(merges, start=len(ranks)):
            ranks[bytes(to_byte[c] for c in first + second)] = rank
        ids = {bytes(to_byte[c] for c in token): i for token, i in encoder.items()
               if token not in (ENDOFTEXT, "<|startoftext|>")}
    except OSError as e:
        raise SystemExit(f"error: GPT2_BPE_DIR: cannot read {e.filename}: {e.strerror}")
    except (ValueError, KeyError) as e:  # (bad JSON or UTF-8, a line that is not one merge, a byte not spelled GPT-2's way)
        raise SystemExit(f"error: GPT2_BPE_DIR: {folder} does not hold GPT-2-format vocab.bpe and encoder.json "
                         f"({type(e).__name__}: {' '.join(str(e).split())})")
    # tiktoken merges by rank: ids that disagree with the merges' order would encode differently from GPT-2
    if ids != ranks:
        raise SystemExit(f"error: GPT2_BPE_DIR: {folder}/encoder.json does not match vocab.bpe: its ids are not "
                         "the 256 byte tokens' then the merges' ranks")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: encoder.get(ENDOFTEXT, len(ranks))})


def gpt2_encoding():
    """GPT-2's BPE: from $GPT2_BPE_DIR's files where it is set, else tiktoken's 'gpt2'; a one-line
    exit where the files can be neither read nor fetched."""
    folder = os.environ.get("GPT2_BPE_DIR")
    if folder:
        return encoding_from_files(folder)
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken downloads the files on first use: most often no network
        raise SystemExit(f"error: cannot load GPT-2's BPE files for tiktoken ({type(e).__name__}); offline, "
                         "set TIKTOKEN_CACHE_DIR to a folder that holds them, or GPT2_BPE_DIR to one that holds "
                         "vocab.bpe and encoder.json")
