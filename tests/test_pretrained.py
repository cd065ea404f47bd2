"""init_from=gpt2: OpenAI's GPT-2 through Hugging Face transformers, here a tiny random GPT-2 in
a local transformers cache (read offline, as from_pretrained('gpt2') reads a real download).
The converted model computes what transformers computes, and every backend starts training
from exactly those weights."""
import sys

import pytest
import torch

from conftest import REPO, TINY, launch, one_error_line, run_train, write_tiny_bpe

sys.path.insert(0, str(REPO))
from model import GPT, from_hf_gpt2  # noqa: E402
import checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")  # (in requirements.txt; CI installs it)

POSITIONS = 64  # more than the runs' block_size (32): train.py keeps the first 32 position embeddings


def tiny_hf_gpt2(vocab_size=50257):  # GPT-2's vocabulary, so that sample.py's BPE prompts fit
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=POSITIONS, vocab_size=vocab_size,
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """A transformers cache holding the tiny model under the name 'gpt2'; env for the runs."""
    cache = tmp_path_factory.mktemp("hf_cache")
    revision = "0" * 40
    tiny_hf_gpt2().save_pretrained(cache / "models--gpt2" / "snapshots" / revision)
    (cache / "models--gpt2" / "refs").mkdir()
    (cache / "models--gpt2" / "refs" / "main").write_text(revision)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_converted_model_computes_what_transformers_computes():
    """Same weights, different kernels (Conv1D's addmm against Linear): equal to float32 rounding."""
    hf = tiny_hf_gpt2()
    config, state = from_hf_gpt2(hf)
    gpt = GPT(config).eval()
    gpt.load_state_dict(state)  # strict: every parameter, every shape
    idx = torch.randint(0, config.vocab_size, (2, POSITIONS))
    with torch.no_grad():
        ours = gpt(idx, idx)[0]  # (with targets: the logits of every position)
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight


@pytest.mark.parametrize("backend,nproc", [("ddp", None), ("fsdp", 2), ("custom_fsdp", 2)])
def test_training_starts_from_the_pretrained_weights(backend, nproc, hf_cache, char_data, tmp_path):
    """With learning rate 0 the first checkpoint holds exactly the pretrained weights, assembled
    from each rank's shards under the sharded backends."""
    res = run_train(tmp_path, nproc, f"--data_dir={char_data}", *TINY, "--init_from=gpt2", f"--dist_backend={backend}",
                    "--max_iters=1", "--eval_interval=1", "--learning_rate=0.0", "--decay_lr=False", env=hf_cache)
    assert res.returncode == 0, res.describe()
    config, state = from_hf_gpt2(tiny_hf_gpt2())
    config.block_size = 32
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:32]
    saved = GPT(config)
    checkpoint.load_model_only(str(tmp_path / "ckpt-0000001"), saved)
    for name, p in saved.named_parameters():
        assert torch.equal(p, state[name]), name


def test_sample_continues_a_prompt_with_the_pretrained_model(hf_cache, tmp_path):
    """The prompt goes through GPT-2's BPE, here a tiny one in GPT2_BPE_DIR (its ids are GPT-2's
    first 268); tiktoken's own files are neither cached nor reachable."""
    env = {**hf_cache, "GPT2_BPE_DIR": str(write_tiny_bpe(tmp_path / "bpe")), "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"),
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    res = launch([sys.executable, REPO / "sample.py", "--init_from=gpt2", "--device=cpu", "--num_samples=1",
                  "--max_new_tokens=5", "--start=To be or not"], timeout=300, env=env)
    assert res.returncode == 0 and res.stdout.startswith("To be or not"), res.describe()


@pytest.mark.parametrize("setting,named", [("--block_size=128", "larger than gpt2's 64 positions"),
                                           ("--init_from=gpt3", "unknown init_from 'gpt3' (choose scratch, resume, gpt2,")])
def test_impossible_pretrained_settings_are_refused(setting, named, hf_cache, char_data, tmp_path):
    res = run_train(tmp_path / "o", None, f"--data_dir={char_data}", *TINY, "--init_from=gpt2", setting, env=hf_cache)
    assert named in one_error_line(res)


def test_a_model_not_in_the_cache_offline_is_one_line(hf_cache, char_data, tmp_path):
    res = run_train(tmp_path / "o", None, f"--data_dir={char_data}", *TINY, "--init_from=gpt2-medium", env=hf_cache)
    line = one_error_line(res)
    assert line.startswith("error: init_from=gpt2-medium: ") and "HF_HUB_OFFLINE=1" in line, line


def test_a_new_run_from_gpt2_refuses_an_out_dir_with_checkpoints(hf_cache, char_data, tmp_path):
    """As a new run from scratch does: its first save would prune the other run's checkpoints."""
    args = [f"--data_dir={char_data}", *TINY, "--init_from=gpt2", "--max_iters=1", "--eval_interval=1"]
    assert run_train(tmp_path, None, *args, env=hf_cache).returncode == 0
    assert "holds another run's checkpoints" in one_error_line(run_train(tmp_path, None, *args, env=hf_cache))


def test_eval_only_evaluates_gpt2_and_trains_nothing(hf_cache, char_data, tmp_path):
    res = run_train(tmp_path, None, f"--data_dir={char_data}", *TINY, "--init_from=gpt2", "--eval_only=True",
                    env=hf_cache)
    assert res.returncode == 0 and "step 0: train loss" in res.stdout, res.describe()
    assert not list(tmp_path.glob("ckpt-*")) and "iter 0:" not in res.stdout


def test_a_run_from_gpt2_resumes_and_restarts_with_gpt2s_shape(hf_cache, char_data, tmp_path):
    """The config's own shape (train.py's defaults here: 4 layers, 128 wide, no bias) is not the
    tiny GPT-2's (2 layers, 32 wide, bias): the checkpoint says which model it is."""
    args = [f"--data_dir={char_data}", "--block_size=32", "--batch_size=4", "--eval_iters=2", "--compile=False",
            "--dtype=float32", "--eval_interval=2"]
    first = run_train(tmp_path, None, *args, "--init_from=gpt2", "--max_iters=2", env=hf_cache)
    assert first.returncode == 0, first.describe()
    assert "2 layers, 2 heads, 32 wide, with biases: this run's n_layer, n_head, n_embd and bias do not apply" \
        in first.stdout, first.describe()
    restarted = run_train(tmp_path, None, *args, "--init_from=gpt2", "--max_iters=4",
                          env={**hf_cache, "TORCHELASTIC_RESTART_COUNT": "1"})  # as torchrun restarts it
    assert restarted.returncode == 0 and "resumed from" in restarted.stdout, restarted.describe()
    resumed = run_train(tmp_path, None, *args, "--init_from=resume", "--max_iters=6", env=hf_cache)
    assert resumed.returncode == 0 and (tmp_path / "ckpt-0000006").exists(), resumed.describe()


def test_sample_names_its_choices_for_an_unknown_init_from():
    res = launch([sys.executable, REPO / "sample.py", "--init_from=scratch", "--device=cpu"], timeout=120)
    assert "unknown init_from 'scratch' (choose resume, gpt2," in one_error_line(res)
