"""Attention maps from the ONNX attention variant: equal to torch's weights, rows sum to 1 over unmasked keys, the PNG
grid is written, and bad input (layer, head, long text, no variant) is a one-line error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contract.attention_map import AttentionMapError, AttentionModel
from contract.metadata import ATTENTION_MASK, ATTENTION_WEIGHTS, INPUT_IDS
from contract.tokenizer import ByteTokenizer
from export import attention_map
from export.convert import export_model, exporter_versions
from export.model import AttentionOutputs, EncoderClassifier, EncoderConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXT = "a7b2c9d4:c"


@pytest.fixture(scope="module", params=[1, 4])
def exported(request, tmp_path_factory):
    """A 2-layer model with sharp (non-uniform) attention, exported with its attention variant."""
    torch.manual_seed(request.param)
    config = EncoderConfig(d_model=32, heads=request.param, layers=2, ff_dim=64, max_len=16, task="kv-compare")
    model = EncoderClassifier(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(40.0)  # init std 0.02 gives near-uniform weights; make them peaked
    out = tmp_path_factory.mktemp(f"attn-h{request.param}")
    result = export_model(model, config.metadata(exporter_versions()), out, attention_variant=AttentionOutputs(model))
    return model, result.folder


def test_onnx_weights_equal_torch_weights(exported):
    model, folder = exported
    amap = AttentionModel(folder).attention_map(TEXT)
    ids = torch.tensor([ByteTokenizer(16).encode(TEXT)])
    with torch.no_grad():
        _, expected = model.forward_with_attention(ids, torch.ones_like(ids))  # (1, layers, h, T, T)
    assert amap.weights.shape == (2, model.config.heads, len(TEXT) + 1, len(TEXT) + 1)
    assert amap.layers == (0, 1) and len(amap.tokens) == len(TEXT) + 1
    np.testing.assert_allclose(amap.weights, expected[0].numpy(), atol=1e-4)  # the parity gate's tolerance
    assert amap.weights.max() > 0.5  # not uniform: the comparison means something


def test_one_layer_is_that_layer_of_all(exported):
    _, folder = exported
    model = AttentionModel(folder)
    np.testing.assert_array_equal(model.attention_map(TEXT, layer=1).weights[0], model.attention_map(TEXT).weights[1])


def test_rows_sum_to_one_over_unmasked_keys_and_padding_gets_nothing(exported):
    _, folder = exported
    session = AttentionModel(folder).session
    ids, mask = ByteTokenizer(16).encode_batch([TEXT, "a1:b"])
    feed = {INPUT_IDS: np.array(ids, dtype=np.int64), ATTENTION_MASK: np.array(mask, dtype=np.int64)}
    (weights,) = session.run([ATTENTION_WEIGHTS], feed)  # (2, layers, h, T, T)
    keep = np.array(mask, dtype=bool)  # (2, T)
    for row in range(2):
        w = weights[row]  # (layers, h, T, T)
        np.testing.assert_allclose(w[..., keep[row]].sum(axis=-1), 1.0, atol=1e-5)
        assert np.all(w[..., ~keep[row]] == 0.0)


def test_cli_writes_a_png_grid(exported, tmp_path, capsys):
    _, folder = exported
    out = tmp_path / "attn.png"
    assert attention_map.main(["--model", str(folder), "--text", TEXT, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert "2 layer(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--layer", "2"], "layer 2 is out of range"),
        (["--layer", "-1"], "layer -1 is out of range"),
        (["--head", "4"], "head 4 is out of range"),
        (["--text", "x" * 16], "over the model's max_len=16"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero(exported, extra, message, tmp_path, capsys):
    _, folder = exported
    out = tmp_path / "attn.png"
    argv = ["--model", str(folder), "--text", TEXT, "--out", str(out), *extra]
    assert attention_map.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists()


def test_a_model_without_the_attention_variant_says_how_to_export_it(tiny_models_dir):
    with pytest.raises(AttentionMapError, match="mha-serving export --attention"):
        AttentionModel(tiny_models_dir / "mha-h2-d32")


def test_a_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(AttentionMapError, match="does not exist"):
        AttentionModel(tmp_path / "nope")
