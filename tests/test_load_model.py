"""load_model on bad checkpoint folders: each is a one-line KVLearnError naming the path and what is wrong."""

import os
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn.errors import KVLearnError
from kvlearn.hf import load_model


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 (GQA: 2 query heads, 1 KV head) written by save_pretrained."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("ckpt") / "good"
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def bad_copy(good, tmp_path, name, damage):
    path = tmp_path / name
    shutil.copytree(good, path)
    damage(path)
    return path


def one_line_error(path, *needles):
    with pytest.raises(KVLearnError) as info:
        load_model(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    return message


def test_good_checkpoint_loads(good_checkpoint):
    model = load_model(good_checkpoint)
    assert model.config.model_type == "qwen3" and not model.training


def test_truncated_weights(good_checkpoint, tmp_path):
    def truncate(path):
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])

    path = bad_copy(good_checkpoint, tmp_path, "truncated", truncate)
    one_line_error(path, str(path / "model.safetensors"), "incomplete metadata", "truncated or garbled")


def test_empty_weights(good_checkpoint, tmp_path):
    path = bad_copy(good_checkpoint, tmp_path, "empty", lambda p: (p / "model.safetensors").write_bytes(b""))
    one_line_error(path, "(0 bytes)", "header too small")


def test_garbled_weights(good_checkpoint, tmp_path):
    def garble(path):
        data = bytearray((path / "model.safetensors").read_bytes())
        data[8:40] = b"x" * 32  # the JSON header starts at byte 8
        (path / "model.safetensors").write_bytes(bytes(data))

    path = bad_copy(good_checkpoint, tmp_path, "garbled", garble)
    one_line_error(path, "invalid JSON in header", "expected a complete safetensors file")


def test_config_without_weights(good_checkpoint, tmp_path):
    path = bad_copy(good_checkpoint, tmp_path, "no_weights", lambda p: os.remove(p / "model.safetensors"))
    one_line_error(path, "has no weights", "model.safetensors")


def test_garbled_config(good_checkpoint, tmp_path):
    def garble(path):
        (path / "config.json").write_text('{"model_type": "qwen3", garbage')

    path = bad_copy(good_checkpoint, tmp_path, "bad_config", garble)
    one_line_error(path, str(path / "config.json"), "is not valid JSON (Expecting")


def test_missing_folder_and_config(tmp_path):
    one_line_error(tmp_path / "nowhere", "does not exist")
    one_line_error(tmp_path, "has no config.json")
