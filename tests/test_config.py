"""Configuration: config files are type-checked like --key=value arguments, a broken config file
is one line naming it, and config/train_gpt2.py trains what its header says at the world sizes
the README and scripts/slurm.sh launch. Almost everything runs configurator.apply in-process
against train.py's real defaults; two cases go through train.py to show the exit end to end."""
import re
import sys

import pytest
import torch

from conftest import REPO, one_error_line, run_train

sys.path.insert(0, str(REPO))
import configurator  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

GPT2 = REPO / "config" / "train_gpt2.py"


@pytest.fixture(scope="module")
def defaults():
    """train.py's globals just before it applies the configuration: the defaults every key is
    checked against (running train.py's own lines, so the test cannot drift from them)."""
    head, marker, _ = (REPO / "train.py").read_text().partition("config = configurator.apply(globals()")
    assert marker, "train.py no longer calls config = configurator.apply(globals(), ...)"
    scope = {"__name__": "train_defaults"}
    exec(compile(head, "train.py", "exec"), scope)
    return scope


def parse(defaults, *argv):
    config = dict(defaults)
    configurator.apply(config, [str(a) for a in argv])
    return config


def parse_error(defaults, capsys, *argv):
    """The single 'error:' line that configuration fails with (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(defaults, *argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_help_lists_every_setting_with_its_default(defaults, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(defaults, "--max_iters=3", "--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("usage:"), out[0]
    settings = {k for k, v in defaults.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
    assert {line.split("=")[0].strip() for line in out[1:]} == {f"--{k}" for k in settings}
    # the defaults, not the override before --help
    assert f"  --max_iters={defaults['max_iters']}" in out and f"  --dist_backend='{defaults['dist_backend']}'" in out


def write(tmp_path, text):
    cfg = tmp_path / "cfg.py"
    cfg.write_text(text)
    return cfg


@pytest.mark.parametrize("text,words", [
    ("max_iters = 1.5\n", ["max_iters", "int", "1.5"]),
    ("max_iters = 'abc'\n", ["max_iters", "int", "'abc'"]),
    ("max_iters = True\n", ["max_iters", "int", "True"]),  # a bool is not an int
    ("compile = 1\n", ["compile", "bool", "1"]),
    ("learning_rate = '3e-4'\n", ["learning_rate", "float", "'3e-4'"]),
    ("batch_size = None\n", ["batch_size", "int", "None"]),  # (not skipped silently)
    ("dataset = ['a']\n", ["dataset", "str"]),
])
def test_config_file_values_are_type_checked(defaults, capsys, tmp_path, text, words):
    cfg = write(tmp_path, text)
    line = parse_error(defaults, capsys, cfg, "--max_iters=5")
    assert str(cfg) in line
    for w in words:
        assert w in line


def test_an_int_is_taken_where_a_float_is_expected(defaults, tmp_path):
    config = parse(defaults, write(tmp_path, "learning_rate = 3\nmax_iters = 7\n"), "--min_lr=0")
    assert type(config["learning_rate"]) is float and config["learning_rate"] == 3.0
    assert type(config["min_lr"]) is float and config["min_lr"] == 0.0
    assert type(config["max_iters"]) is int and config["max_iters"] == 7


def test_the_command_line_overrides_a_file_value_of_the_right_type(defaults, tmp_path):
    assert parse(defaults, write(tmp_path, "max_iters = 100\n"), "--max_iters=5")["max_iters"] == 5


def test_an_override_before_a_config_file_still_wins(defaults, tmp_path):
    """Files first, then overrides, wherever they stand: the file silently undid it before."""
    config = parse(defaults, "--max_iters=5", write(tmp_path, "max_iters = 100\nbatch_size = 3\n"))
    assert config["max_iters"] == 5 and config["batch_size"] == 3


def test_a_string_setting_takes_text_that_looks_like_a_number(defaults):
    config = parse(defaults, "--out_dir=123", "--wandb_run_name=2024", "--dataset='quoted'")
    assert (config["out_dir"], config["wandb_run_name"], config["dataset"]) == ("123", "2024", "quoted")
    assert parse(defaults, "--wandb_run_name=True", "--out_dir=None")["wandb_run_name"] == "True"


@pytest.mark.parametrize("argv,words", [
    (["--learning_rate=True"], ["--learning_rate", "float", "True"]),  # a bool is no number, not even 1.0
    (["CFG:learning_rate = False\n"], ["learning_rate", "float", "False"]),
    (["--out_dir"], ["expected --key=value", "'--out_dir'"]),  # not an empty out_dir
    (["--compile"], ["expected --key=value", "'--compile'"]),
    (["--max_iters", "10"], ["expected --key=value", "'--max_iters'"]),  # (not: no config file named 10)
    (["max_iters=10"], ["expected --key=value", "'max_iters=10'"]),
])
def test_a_bool_is_no_float_and_an_override_needs_its_value(defaults, capsys, tmp_path, argv, words):
    argv = [write(tmp_path, a[4:]) if a.startswith("CFG:") else a for a in argv]
    line = parse_error(defaults, capsys, *argv)
    assert all(w in line for w in words), line


def test_a_config_file_error_names_the_innermost_line_of_the_file(defaults, capsys, tmp_path):
    cfg = write(tmp_path, "def steps():\n    return 1 // 0\n\nmax_iters = steps()\n")
    line = parse_error(defaults, capsys, cfg)
    assert "ZeroDivisionError at line 2" in line, line


@pytest.mark.parametrize("text,words", [
    ("this is not python\n", ["NameError", "line 1"]),  # parses as `this is (not python)`
    ("x = (\n", ["not valid Python", "line 1"]),
    ("max_iters = 10\n\nraise ValueError('first\\nsecond')\n", ["ValueError", "line 3", "first"]),
    ("max_iters = 10 // 0\n", ["ZeroDivisionError", "line 1"]),
])
def test_a_broken_config_file_is_one_line_naming_it(defaults, capsys, tmp_path, text, words):
    cfg = write(tmp_path, text)
    line = parse_error(defaults, capsys, cfg)
    assert str(cfg) in line
    for w in words:
        assert w in line


def test_a_missing_config_file_is_one_line_naming_it(defaults, capsys, tmp_path):
    assert str(tmp_path / "nope.py") in parse_error(defaults, capsys, tmp_path / "nope.py")


@pytest.mark.parametrize("text", ["foo = 1\n", "foo = [1, 2]\n", "foo = None\n"])
def test_an_unknown_key_in_a_file_is_an_error(defaults, capsys, tmp_path, text):
    assert "unknown config key 'foo'" in parse_error(defaults, capsys, write(tmp_path, text))


def test_readme_settings_table_lists_every_setting(defaults):
    """README's settings table is where users look a key up: each of train.py's settings has a row."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Settings"):text.index("\n## ", text.index("## Settings") + 1)]
    listed = {key for row in table.splitlines() if row.startswith("| `") for key in re.findall(r"`(\w+)`", row.split("|")[1])}
    settings = {k for k, v in defaults.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
    assert settings - listed == set() and listed - settings == set()


@pytest.mark.parametrize("key", ["shared_memory", "malloc_mmap_threshold_mb", "malloc_trim", "compile_per_block"])
def test_a_removed_setting_is_refused_like_any_unknown_key(defaults, capsys, key):
    """Settings that served one machine's tuning are gone: an old command line naming one stops at once."""
    assert parse_error(defaults, capsys, f"--{key}=1") == f"error: unknown config key '{key}'"


def test_imports_helpers_and_private_names_in_a_file_are_not_settings(defaults, tmp_path):
    text = "import math\n_base = 4\ndef half(x):\n    return x / 2\nlearning_rate = half(math.sqrt(_base)) * 1e-3\n"
    assert parse(defaults, write(tmp_path, text))["learning_rate"] == 1e-3


@pytest.mark.parametrize("text,words", [
    ("max_iters = 1.5\n", ["max_iters", "int"]),
    ("this is not python\n", ["NameError"]),
])
def test_train_py_exits_with_one_line_on_a_bad_config_file(tmp_path, text, words):
    cfg = write(tmp_path, text)
    res = run_train(tmp_path / "out", None, cfg)
    line = one_error_line(res)
    assert "Traceback" not in res.stderr, res.describe()
    assert str(cfg) in line and all(w in line for w in words)
    assert not (tmp_path / "out").exists()  # stopped before touching anything


# ---------------------------------------------------------------------------------------------
# the shipped configs


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.py")), ids=lambda p: p.name)
def test_every_shipped_config_passes_the_type_checks(defaults, path):
    parse(defaults, path)


def test_train_gpt2_trains_the_model_and_data_its_header_names(defaults):
    config = parse(defaults, GPT2)
    header = GPT2.read_text().split("\n\n")[0]
    assert config["dataset"] == "openwebtext" and "OpenWebText" in header
    assert (REPO / "data" / "openwebtext" / "prepare.py").exists()
    assert "python data/openwebtext/prepare.py" in header
    shape = {k: config[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    assert shape == dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    assert "12 layers, 12 heads, 768 wide, 1024 tokens" in header
    # no meta.pkl in that dataset, so train.py uses GPT-2's padded vocabulary
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape, vocab_size=50304, bias=config["bias"]))
    assert round(model.get_num_params(non_embedding=False) / 1e6) == 124 and "124M" in header


def test_train_gpt2_schedule_is_a_warmup_then_a_decay_over_the_run(defaults):
    c = parse(defaults, GPT2)
    assert c["decay_lr"] and 0 < c["warmup_iters"] < c["lr_decay_iters"] <= c["max_iters"]
    assert 0 < c["min_lr"] < c["learning_rate"] <= 1e-3
    tokens = c["batch_size"] * c["block_size"] * c["gradient_accumulation_steps"]
    assert 0.45e6 <= tokens <= 0.55e6  # ~0.5M tokens per step, as GPT-2/3 small


# the README's one-node (8), two-node (16, HSDP over 2) and scripts/slurm.sh's (32, HSDP over 4) runs
@pytest.mark.parametrize("world,replicas", [(8, 1), (16, 2), (32, 4)])
def test_train_gpt2_accumulation_splits_over_the_documented_world_sizes(defaults, world, replicas):
    c = parse(defaults, GPT2, "--dist_backend=custom_fsdp", f"--replicate_degree={replicas}")
    assert c["gradient_accumulation_steps"] % world == 0 and world % c["replicate_degree"] == 0


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("model_*.py")), ids=lambda p: p.name)
def test_model_configs_stack_on_train_gpt2(defaults, path):
    base, stacked = parse(defaults, GPT2), parse(defaults, GPT2, path)
    assert stacked["n_embd"] > base["n_embd"] and stacked["n_embd"] % stacked["n_head"] == 0
    # the shape changes (a longer context too), the data and the batch do not
    for k in ("dataset", "batch_size", "gradient_accumulation_steps"):
        assert stacked[k] == base[k]
    assert stacked["block_size"] >= base["block_size"]
    assert f"config/train_gpt2.py config/{path.name}" in path.read_text()


@pytest.mark.parametrize("device", ["cuda:", "cuda:x", "cpu:0", "gpu"])
def test_a_malformed_device_is_unknown_wherever_cuda_is(device, capsys):
    with pytest.raises(SystemExit) as exit_info:
        configurator.check_device(device)
    assert exit_info.value.code == 2
    assert f"unknown device '{device}' (choose cpu, cuda or cuda:N)" in capsys.readouterr().err
