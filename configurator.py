"""
nanoGPT-style configuration: the script's globals are the config.

    python train.py config/train_shakespeare_char.py --batch_size=32 --compile=False

Arguments without '--' are config files, exec'd in order; then each '--key=value' overrides one
global, wherever it stands on the command line (an override before a file is not undone by it).
Command-line values are parsed as Python literals when they can be (else kept as strings); a
setting whose default is a string takes the text as it is (--out_dir=123 is the folder '123').
Every value, from a file or the command line, must have the type of the script's default (an
int is taken where a float is expected; a bool is not an int). Unknown keys are an error too: a
typo must never silently train the wrong model.
"""
import argparse
import json
import os
import re
import sys
import time
import traceback
import types
from ast import literal_eval


def report_error(msg):
    """The one `error:` line of bad input; under torchrun also in its failure report (each node's)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": msg, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every process meets the same error
        print(f"error: {msg}", file=sys.stderr, flush=True)
    else:  # torchrun stops every process once one exits: let the first, which prints, get there first
        time.sleep(30)  # (ranks start seconds apart on a loaded machine; torchrun ends this wait anyway)


def fail(msg):
    report_error(msg)
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse as every tool here answers: --help shows the docstring as written and each flag's
    default, and bad input is one `error:` line, exit 2 (as fail)."""

    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):
            # a default of None means "not given": the help text says what that does
            return action.help if action.default is None else super()._get_help_string(action)

    def __init__(self, **kwargs):
        super().__init__(formatter_class=self.Formatter, **kwargs)

    def error(self, message):
        fail(f"{self.prog}: {message}")


def device_problem(device):
    """Why this torch cannot run on `device`, in one line, or None: it takes cpu, and cuda or cuda:N
    with CUDA present."""
    import torch  # (here: the tools that use only ArgumentParser and fail start without torch)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return f"unknown device '{device}' (choose cpu, cuda or cuda:N)"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"device={device} but this torch has no CUDA device (use --device=cpu)"
    return None


def check_device(device):
    """Fail in one line unless this torch can run on `device`."""
    problem = device_problem(device)
    if problem:
        fail(problem)


def typed(value, default, what):
    """`value` with the type of `default`, or fail naming `what` was given the wrong type."""
    if isinstance(default, float) and type(value) is int:
        value = float(value)
    if type(value) is not type(default):
        fail(f"{what} expects {type(default).__name__}, got {value!r}")
    return value


def run_file(path):
    """The names a config file defines; a file that cannot be read or run fails in one line."""
    try:
        with open(path, "rb") as f:
            src = f.read()
    except OSError as e:
        fail(f"cannot read config file {path}: {e.strerror}")
    scope = {}
    try:
        exec(compile(src, path, "exec"), scope)
    except SyntaxError as e:
        fail(f"config file {path} is not valid Python: {e.msg} (line {e.lineno})")
    except Exception as e:
        # the innermost line of the file itself, not of whatever it called
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        where = f" at line {lines[-1]}" if lines else ""
        reason = str(e).splitlines()[0] if str(e) else ""
        fail(f"config file {path} raised {type(e).__name__}{where}: {reason}")
    return scope


def apply(config, argv):
    """Update the dict `config` (a script's globals) from config files and --key=value args; returns
    the settings (its public ints, floats, bools and strings) as they now are."""
    defaults = {k: v for k, v in config.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
    if "-h" in argv or "--help" in argv:
        print(f"usage: {os.path.basename(sys.argv[0])} [config files] [--key=value ...]; "
              "the settings and their defaults:")
        for key, value in defaults.items():
            print(f"  --{key}={value!r}" if isinstance(value, str) else f"  --{key}={value}")
        raise SystemExit(0)
    for arg in argv:  # the form first: `--max_iters 10` would otherwise fail as a config file named 10
        flag = arg.startswith("--")
        if (flag and "=" not in arg) or (not flag and "=" in arg and not os.path.exists(arg)):
            fail(f"expected --key=value, got '{arg}'")
    for arg in [a for a in argv if not a.startswith("--")]:
        for key, value in run_file(arg).items():
            if key in defaults:
                config[key] = typed(value, defaults[key], f"{key} in {arg}")
            elif not (key.startswith("_") or isinstance(value, types.ModuleType) or callable(value)):
                fail(f"unknown config key '{key}' in {arg}")
            # else: an import or helper the file uses, not a setting
    for arg in [a for a in argv if a.startswith("--")]:
        key, _, text = arg[2:].partition("=")
        if key not in defaults:
            fail(f"unknown config key '{key}'")
        try:
            value = literal_eval(text)
        except (SyntaxError, ValueError):
            value = text  # a bare string such as --device=cpu
        if isinstance(defaults[key], str) and not isinstance(value, str):
            value = text  # --out_dir=123, --wandb_run_name=2024: the text is the string
        config[key] = typed(value, defaults[key], f"--{key}")
    return {key: config[key] for key in defaults}
