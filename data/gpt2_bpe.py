"""GPT-2's BPE through tiktoken, for the BPE prepare scripts and sample.py."""


def gpt2_encoding():
    """tiktoken's 'gpt2' encoding; a one-line exit where its files can be neither read nor fetched."""
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken downloads the files on first use: most often no network
        raise SystemExit(f"error: cannot load GPT-2's BPE files for tiktoken ({type(e).__name__}); offline, "
                         "set TIKTOKEN_CACHE_DIR to a folder that holds them")
