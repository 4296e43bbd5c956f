"""A decoder's attention maps (`mha-serving attention` on a trained decoder): causal (zero above the diagonal), rows
summing to 1, the weights the model really applies, each query head's own map under GQA; the PNG, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contract.attention_map import AttentionMapError
from contract.tokenizer import ByteTokenizer
from export import attention_map
from export.attention import cache_mask
from export.decoder import DecoderConfig, DecoderLM
from export.decoder_attention import decoder_attention_map, decoder_weights, kv_head_of
from export.lm_train import LMTrainConfig, export_trained_lm, train_lm

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXT = "def f(x): return x"
HEAD_PAIRS = [(4, 4), (4, 2), (4, 1), (2, 1)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer GQA decoder (4 query heads, 2 key/value heads) trained a few steps, exported with its checkpoint."""
    torch.set_num_threads(1)
    config = LMTrainConfig(heads=4, kv_heads=2, d_model=32, layers=2, max_len=40, steps=5, batch_size=4, log_every=5)
    result = train_lm(config, log=None)
    return export_trained_lm(result, tmp_path_factory.mktemp("lm")).folder


def _model(h: int, kv: int) -> DecoderLM:
    torch.manual_seed(h * 10 + kv)
    model = DecoderLM(DecoderConfig(d_model=32, heads=h, kv_heads=kv, layers=2, max_len=40)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(40.0)  # init std 0.02 gives near-uniform weights; make them peaked
    return model


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_maps_are_causal_and_rows_sum_to_one(h, kv):
    weights = decoder_weights(_model(h, kv), ByteTokenizer(40).encode(TEXT)).numpy()  # (layers, h, T, T)
    T = len(TEXT) + 1
    assert weights.shape == (2, h, T, T)
    above = np.triu(np.ones((T, T), dtype=bool), k=1)
    assert np.all(weights[..., above] == 0.0)  # no query sees a later token
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)
    assert weights.max() > 0.5  # peaked, so the checks mean something


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_maps_are_the_weights_the_model_applies(h, kv):
    """weights @ v (each query head over its group's value head), through the output projection, is the layer's
    cached-path output."""
    model = _model(h, kv)
    ids = ByteTokenizer(40).encode(TEXT)
    T = len(ids)
    weights = decoder_weights(model, ids)  # (layers, h, T, T)
    attn, block = model.blocks[0].attn, model.blocks[0]
    with torch.no_grad():
        x = block.ln_1(model.tok_emb(torch.tensor([ids])) + model.pos_emb(torch.arange(T)[None]))  # (1, T, D)
        mask = cache_mask(torch.ones(1, T, dtype=torch.int64), T)
        empty = torch.zeros(1, kv, 0, attn.head_dim)
        want, _, _ = attn.forward_cached(x, mask, empty, empty)  # (1, T, D)
        _, _, v = attn.qkv(x).split([attn.inner_dim, attn.kv_dim, attn.kv_dim], dim=2)
        v = v.view(1, T, kv, attn.head_dim).transpose(1, 2).repeat_interleave(h // kv, dim=1)  # (1, h, T, hs)
        y = (weights[0][None] @ v).transpose(1, 2).reshape(1, T, attn.inner_dim)
        torch.testing.assert_close(attn.out(y), want, atol=1e-5, rtol=1e-5)
    assert [kv_head_of(model, head) for head in range(h)] == [head // (h // kv) for head in range(h)]


def test_a_trained_folder_and_its_checkpoint_give_the_same_maps(trained):
    amap, model = decoder_attention_map(trained, TEXT)
    again, _ = decoder_attention_map(trained / "checkpoint.pt", TEXT, layer=1)
    assert amap.layers == (0, 1) and amap.weights.shape == (2, 4, len(TEXT) + 1, len(TEXT) + 1)
    assert amap.tokens[0] == "<bos>" and len(amap.tokens) == len(TEXT) + 1
    np.testing.assert_array_equal(again.weights[0], amap.weights[1])
    assert model.config.resolved_kv_heads == 2


def test_cli_writes_a_png_and_says_which_kv_head_each_query_head_shares(trained, tmp_path, capsys):
    out = tmp_path / "attn.png"
    assert attention_map.main(["--model", str(trained), "--text", TEXT, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    said = capsys.readouterr().out
    assert "2 layer(s) x 4 query head(s)" in said and "query heads 2 to a key/value head" in said


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer", "2"], "layer 2 is out of range"),
        (["--head", "4"], "head 4 is out of range"),
        (["--text", "x" * 40], "over the model's max_len=40"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(trained, extra, message, tmp_path, capsys):
    out = tmp_path / "attn.png"
    assert attention_map.main(["--model", str(trained), "--text", TEXT, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()


def test_an_untrained_decoder_folder_says_how_to_get_a_checkpoint(trained, tmp_path):
    folder = tmp_path / trained.name
    folder.mkdir()
    (folder / "config.json").write_text((trained / "config.json").read_text())  # as `export --decoder` leaves it
    with pytest.raises(AttentionMapError, match="mha-serving train --task docs-lm"):
        decoder_attention_map(folder, TEXT)
