"""
nanoGPT-style configuration: the script's globals are the config.

    python train.py config/train_shakespeare_char.py --batch_size=32 --compile=False

Arguments without '--' are config files, exec'd in order; '--key=value' then overrides one
global. Values are parsed as Python literals when they can be (else kept as strings) and
must keep the type of the default. Unknown keys, in a file or on the command line, are an error:
a typo must never silently train the wrong model.
"""
import sys
from ast import literal_eval


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def apply(config, argv):
    """Update the dict `config` (a script's globals) from config files and --key=value args."""
    known = {k for k, v in config.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
    for arg in argv:
        if not arg.startswith("--"):
            try:
                src = open(arg).read()
            except OSError as e:
                fail(f"cannot read config file {arg}: {e.strerror}")
            scope = {}
            exec(src, scope)
            for key, value in scope.items():
                if key.startswith("_") or not isinstance(value, (int, float, bool, str)):
                    continue  # imports and helpers a config file may define
                if key not in known:
                    fail(f"unknown config key '{key}' in {arg}")
                config[key] = value
            continue
        key, sep, text = arg[2:].partition("=")
        if not sep:
            fail(f"expected --key=value, got '{arg}'")
        if key not in known:
            fail(f"unknown config key '{key}'")
        try:
            value = literal_eval(text)
        except (SyntaxError, ValueError):
            value = text  # a bare string such as --device=cpu
        default = config[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            fail(f"--{key} expects {type(default).__name__}, got {text!r}")
        config[key] = value
