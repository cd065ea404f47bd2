"""
The tiny Shakespeare text that both data/shakespeare*/prepare.py tokenize: a local copy if one
is named, else downloaded once into the script's folder.
"""
import os
import shutil
import urllib.request

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def read_text(input_path, download_dir):
    """The text of `input_path`, else of $SHAKESPEARE_INPUT (a named copy wins, so offline machines
    never touch the network), else of download_dir/input.txt, downloaded if missing."""
    path = input_path or os.environ.get("SHAKESPEARE_INPUT")
    if not path:
        path = os.path.join(download_dir, "input.txt")
        if not os.path.exists(path):
            print(f"downloading {URL}")
            try:  # into a temporary file first, so that a broken download never passes for the text
                with urllib.request.urlopen(URL, timeout=60) as r, open(path + ".tmp", "wb") as f:
                    shutil.copyfileobj(r, f)
            except OSError as e:  # URLError, timeouts, resets: most often no network
                raise SystemExit(f"error: cannot download {URL} ({getattr(e, 'reason', e)}); "
                                 "offline, pass --input PATH to a local copy of input.txt")
            os.replace(path + ".tmp", path)
    with open(path, "r", encoding="utf-8") as f:
        return f.read()
