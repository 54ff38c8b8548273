"""Defaults derived from a real target: captured layer ids, their warnings, the mask token."""

import json
import logging

import pytest
from transformers import Qwen3Config

from dflash_ipc.config.schema import ModelConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import MASK, build_tiny_tokenizer
from dflash_ipc.errors import ConfigError
from dflash_ipc.hf.layer_ids import captured_layer_ids, layer_id_warnings
from dflash_ipc.target.defaults import derive_mask_token_id, fill_layer_ids, warn_beyond_positions
from test_support_table import write_chats


def test_layer_ids_follow_the_paper_and_stay_distinct_for_shallow_targets():
    assert captured_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert captured_layer_ids(48, 5) == [1, 12, 23, 34, 45]  # Qwen3-30B-A3B
    assert captured_layer_ids(4, 2) == [1, 2]  # the tiny target (the paper's range gives [1, 1])
    assert captured_layer_ids(3, 2) == [0, 1]  # the last layer only when nothing else is left
    assert captured_layer_ids(2, 2) == [0, 1]
    assert captured_layer_ids(4, 1) == [2]
    with pytest.raises(ConfigError, match="cannot choose that many distinct captured layers"):
        captured_layer_ids(3, 5)


def test_given_ids_that_look_wrong_for_the_depth_are_named():
    assert layer_id_warnings([1, 9, 17, 25, 33], 36, 5) == []
    assert layer_id_warnings([1, 2], 4, 2) == []  # a shallow target: nothing to say
    assert layer_id_warnings([1, 2], 4, 5) == []  # more drafter layers than target layers: given ids stand
    [small] = layer_id_warnings([1, 2], 36, 5)
    assert "first half of the target's 36 layers" in small and "[1, 9, 17, 25, 33]" in small
    [last] = layer_id_warnings([1, 9, 17, 25, 35], 36, 5)
    assert "last layer 35" in last and "after the final norm" in last
    [order] = layer_id_warnings([17, 1, 9, 25, 33], 36, 5)
    assert "not increasing" in order


def test_fill_layer_ids_derives_when_unset_and_warns_when_given(caplog):
    target = Qwen3Config(num_hidden_layers=30)
    model = ModelConfig(num_layers=5)
    fill_layer_ids(model, target)
    assert model.target_layer_ids == [1, 8, 14, 20, 27]
    caplog.set_level(logging.WARNING)
    given = ModelConfig(num_layers=5, target_layer_ids=[1, 2])  # the tiny default's ids, a 30-layer target
    fill_layer_ids(given, target)
    assert given.target_layer_ids == [1, 2] and "first half of the target's 30 layers" in caplog.text
    with pytest.raises(ConfigError, match=r"reach beyond the target's 30 layers \(allowed: 0..29\)"):
        fill_layer_ids(ModelConfig(target_layer_ids=[1, 30]), target)


def _tokenizer_dir(tmp_path, *, mask: bool, vocab_size: int | None = None):
    """The tiny tokenizer (optionally without its mask token) and a config of `vocab_size` rows."""
    tok = build_tiny_tokenizer()
    if not mask:
        tok.mask_token = None
    out = tmp_path / "target"
    tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(Qwen3Config(vocab_size=vocab_size or len(tok)).to_dict()))
    return str(out), tok


def test_the_mask_token_is_the_tokenizers_else_the_first_spare_row(tmp_path):
    with_mask, tok = _tokenizer_dir(tmp_path / "a", mask=True)
    assert derive_mask_token_id(with_mask, vocab_size=1024) == tok.convert_tokens_to_ids(MASK)
    without, tok = _tokenizer_dir(tmp_path / "b", mask=False)
    assert derive_mask_token_id(without, vocab_size=1024) == len(tok) == 1009  # Qwen3's 151,669 case


def test_no_mask_token_and_no_spare_row_lists_unused_special_tokens(tmp_path):
    target, tok = _tokenizer_dir(tmp_path, mask=False)
    data = str(tmp_path / "data")
    prepare_dataset(target, write_chats(tmp_path / "chats.jsonl", num_chats=3), data, max_length=128, progress=False)
    with pytest.raises(ConfigError) as err:
        derive_mask_token_id(target, vocab_size=len(tok), dataset=TokenDataset(data))
    message = str(err.value)
    assert "has no mask token and its embedding has no spare row (1009 rows" in message
    # <|im_start|> and <|im_end|> frame every turn of the data; the others never occur (<|mask|>
    # is still a special token of the vocabulary, only no longer the tokenizer's mask token)
    assert "3 of the tokenizer's 5 special tokens never occur" in message
    assert "0 '<|endoftext|>', 3 '<|mask|>', 4 '<|unk|>'." in message
    assert "'<|im_start|>'" not in message.split("Candidates:")[1]


def test_longer_data_than_the_target_knows_is_warned(caplog):
    caplog.set_level(logging.WARNING)
    warn_beyond_positions(32768, Qwen3Config(max_position_embeddings=40960))
    assert caplog.text == ""
    warn_beyond_positions(65536, Qwen3Config(max_position_embeddings=40960))
    assert "exceeds the target's max_position_embeddings=40960" in caplog.text
