"""A decoder's export: the folder's layout, a greedy loop written here (numpy and onnxruntime only) feeding `present`
back as `past` against re-running the whole sequence, a left-padded batch, onnxruntime-genai loading the folder as it
is, and the generation parity gate refusing a wrong graph without leaving a file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from contract.decoder_metadata import IN_PLACE_KERNEL, DecoderMetadata, metadata_from_props
from contract.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from export import decoder_export
from export.decoder import DecoderConfig, DecoderLM, FlatCache
from export.decoder_parity import GenerationParityError

# (4, 1) in the inner loop (`make test-fast`); every pair in `make test` (each export takes a few seconds)
HEAD_PAIRS = [pytest.param(4, 4, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow), (4, 1)]
LAYERS, D_MODEL, MAX_LEN = 2, 32, 64
NEW_TOKENS = 24


def _model(h: int, kv: int) -> DecoderLM:
    torch.manual_seed(10 * h + kv)
    model = DecoderLM(DecoderConfig(d_model=D_MODEL, heads=h, kv_heads=kv, layers=LAYERS, max_len=MAX_LEN))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # init std 0.02 makes every logit nearly equal; spread them so greedy choices mean something
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Callable[[int, int], Path]:
    """(h, kv_heads) -> the folder of that tiny decoder, exported through the normal path on first use."""
    out = tmp_path_factory.mktemp("decoders")
    folders: dict[tuple[int, int, bool], Path] = {}

    def folder(h: int, kv: int, in_place: bool = True) -> Path:
        if (h, kv, in_place) not in folders:
            model = _model(h, kv)
            where = out / ("in-place" if in_place else "concatenated")
            exported = decoder_export.export_decoder(model, model.config.metadata(), where, in_place=in_place)
            folders[(h, kv, in_place)] = exported.folder
        return folders[(h, kv, in_place)]

    return folder


def _session(folder: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def _empty_past(batch: int, kv: int, head_dim: int) -> dict[str, np.ndarray]:
    empty = np.zeros((batch, kv, 0, head_dim), np.float32)
    return {f"past_key_values.{i}.{kind}": empty for i in range(LAYERS) for kind in ("key", "value")}


def _positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def greedy_with_cache(session, ids: np.ndarray, mask: np.ndarray, kv: int, head_dim: int, steps: int):
    """Prefill with an empty past, then one token per step, each step's present fed back as past."""
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": _positions(mask)}
    past = _empty_past(len(ids), kv, head_dim)
    tokens, presents = [], []
    for _ in range(steps):
        logits, *present = session.run(None, {**feeds, **past})
        token = logits[:, -1].argmax(axis=-1)[:, None]  # (B, 1)
        tokens.append(token[:, 0])
        presents.append(present)
        past = dict(zip(past, present, strict=True))
        mask = np.concatenate([mask, np.ones_like(token)], axis=1)
        feeds = {"input_ids": token, "attention_mask": mask, "position_ids": _positions(mask)[:, -1:]}
    return np.stack(tokens, axis=1), presents


def greedy_without_cache(session, ids: np.ndarray, mask: np.ndarray, kv: int, head_dim: int, steps: int):
    """The whole sequence again at every step, past always empty."""
    tokens = []
    for _ in range(steps):
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": _positions(mask)}
        logits = session.run(["logits"], {**feeds, **_empty_past(len(ids), kv, head_dim)})[0]
        token = logits[:, -1].argmax(axis=-1)[:, None]
        tokens.append(token[:, 0])
        ids, mask = np.concatenate([ids, token], axis=1), np.concatenate([mask, np.ones_like(token)], axis=1)
    return np.stack(tokens, axis=1)


def test_the_folder_holds_the_layout_and_describes_itself(exported):
    folder = exported(4, 1)
    assert folder.name == "lm-h4-kv1-d32"
    names = {p.name for p in folder.iterdir()}
    assert {"model.onnx", "config.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    model = onnx.load(str(folder / "model.onnx"))
    meta = metadata_from_props({p.key: p.value for p in model.metadata_props})
    assert isinstance(meta, DecoderMetadata)
    assert (meta.heads, meta.kv_heads, meta.head_dim, meta.layers, meta.max_len) == (4, 1, 8, LAYERS, MAX_LEN)
    assert (meta.bos_id, meta.eos_id, meta.tokenizer) == (BOS_ID, EOS_ID, "byte-v1")
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    shapes.update(
        {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.output}
    )
    assert shapes["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert shapes["past_key_values.1.value"] == ["batch_size", 1, "past_sequence_length", 8]
    assert shapes["present.0.key"] == ["batch_size", 1, "total_sequence_length", 8]
    assert shapes["logits"] == ["batch_size", "sequence_length", 260]
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["model"]["type"] == "decoder" and genai["model"]["decoder"]["num_key_value_heads"] == 1
    config = json.loads((folder / "config.json").read_text())
    assert config["arch"] == "decoder" and config["parity"]["tokens"] >= 4 * 32
    # head_dim 8 is one ORT's GroupQueryAttention takes: the cache is written in place, as GenAI is told
    assert meta.attention_kernel == IN_PLACE_KERNEL and meta.cache_in_place
    assert genai["search"]["past_present_share_buffer"] is True
    assert {(o.domain or "ai.onnx", o.version) for o in model.opset_import} >= {("ai.onnx", 23)}


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_greedy_with_the_cache_equals_rerunning_the_whole_sequence(exported, h, kv):
    session, head_dim = _session(exported(h, kv)), D_MODEL // h
    ids = np.array([[BOS_ID, 80, 121, 116, 108, 114, 118]], np.int64)  # 7 tokens: not the traced 8
    mask = np.ones_like(ids)
    cached, presents = greedy_with_cache(session, ids, mask, kv, head_dim, NEW_TOKENS)
    assert cached.tolist() == greedy_without_cache(session, ids, mask, kv, head_dim, NEW_TOKENS).tolist()
    assert len(set(cached[0].tolist())) > 1  # not one token repeated: the comparison means something
    assert presents[-1][0].shape == (1, kv, 7 + NEW_TOKENS - 1, head_dim)  # kv_heads heads in the cache


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_a_left_padded_batch_generates_what_each_prompt_generates_alone_in_the_concatenating_graph(exported, h, kv):
    folder = exported(h, kv, in_place=False)
    assert metadata_from_props(dict(_session(folder).get_modelmeta().custom_metadata_map)).attention_kernel == (
        "onnx.Attention"
    )
    session, head_dim = _session(folder), D_MODEL // h
    prompts = [[BOS_ID, 70, 71], [BOS_ID, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]]
    width = max(len(p) for p in prompts)
    ids = np.array([[0] * (width - len(p)) + p for p in prompts], np.int64)
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], np.int64)
    batched, _ = greedy_with_cache(session, ids, mask, kv, head_dim, NEW_TOKENS)
    for row, prompt in enumerate(prompts):
        alone = np.array([prompt], np.int64)
        want, _ = greedy_with_cache(session, alone, np.ones_like(alone), kv, head_dim, NEW_TOKENS)
        assert batched[row].tolist() == want[0].tolist()


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_a_batch_aligned_from_column_0_generates_what_each_prompt_generates_alone_in_the_in_place_graph(
    exported, h, kv
):
    """The in-place graph's layout: each row's tokens from column 0, padding on the right, each row's new token
    written after its own (present as wide as the mask or the past)."""
    session, head_dim = _session(exported(h, kv)), D_MODEL // h
    prompts = [[BOS_ID, 70, 71], [BOS_ID, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99]]
    width = max(len(p) for p in prompts)
    ids = np.array([p + [0] * (width - len(p)) for p in prompts], np.int64)  # (B, T)
    lengths = np.array([len(p) for p in prompts])  # (B,)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int64)  # (B, T): ones first
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.tile(np.arange(width), (2, 1))}
    past, batched = _empty_past(2, kv, head_dim), []
    for step in range(NEW_TOKENS):
        logits, *present = session.run(None, {**feeds, **past})
        token = logits[np.arange(2), lengths - 1 if step == 0 else -1].argmax(axis=-1)  # (B,)
        batched.append(token)
        past = dict(zip(past, present, strict=True))
        mask = (np.arange(lengths.max() + 1)[None] <= lengths[:, None]).astype(np.int64)  # (B, W + 1)
        feeds = {"input_ids": token[:, None], "attention_mask": mask, "position_ids": lengths[:, None]}
        lengths = lengths + 1
    for row, prompt in enumerate(prompts):
        alone = np.array([prompt], np.int64)
        want, _ = greedy_with_cache(session, alone, np.ones_like(alone), kv, head_dim, NEW_TOKENS)
        assert np.stack(batched, axis=1)[row].tolist() == want[0].tolist()


def test_a_head_dim_the_in_place_kernel_cannot_take_exports_the_concatenating_graph(tmp_path):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(d_model=40, heads=4, kv_heads=2, layers=1, max_len=MAX_LEN)).eval()  # head_dim 10
    meta = decoder_export.export_decoder(model, model.config.metadata(), tmp_path).metadata
    assert meta.attention_kernel == "onnx.Attention" and not meta.cache_in_place
    genai = json.loads((tmp_path / meta.name / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is False


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_onnxruntime_genai_loads_the_folder_and_generates_the_same_tokens(exported, h, kv):
    og = pytest.importorskip("onnxruntime_genai")
    folder, head_dim = exported(h, kv), D_MODEL // h
    prompt = [BOS_ID, 80, 121, 116, 108, 114, 118]
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + NEW_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    theirs = []
    while not generator.is_done():
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    ids = np.array([prompt], np.int64)
    ours, _ = greedy_with_cache(_session(folder), ids, np.ones_like(ids), kv, head_dim, NEW_TOKENS)
    ours = ours[0].tolist()
    if EOS_ID in ours:  # genai stops at EOS, as its config says
        ours = ours[: ours.index(EOS_ID) + 1]
    assert theirs == ours


def test_onnxruntime_genai_reads_the_byte_tokenizer(exported):
    og = pytest.importorskip("onnxruntime_genai")
    tokenizer = og.Tokenizer(og.Model(str(exported(4, 1))))
    text = "def f(x):\n    return x  # é ✓"
    ids = [int(i) for i in tokenizer.encode(text)]
    assert [BOS_ID, *ids] == ByteTokenizer(MAX_LEN).encode(text)  # its encode adds no BOS: the caller prepends it
    assert tokenizer.decode(np.array([BOS_ID, *ids], np.int32)) == text


class _DropsTheCache(FlatCache):
    """A wrong graph: the cache it is given is zeroed, as if the export lost it."""

    def forward(self, input_ids, attention_mask, position_ids, past):
        return super().forward(input_ids, attention_mask, position_ids, tuple(t * 0 for t in past))


def _perturb_output(path: Path) -> None:
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if tensor.name.endswith("lm_head.weight"):
            values = onnx.numpy_helper.to_array(tensor)
            values = values + np.random.default_rng(0).normal(0.0, 1e-2, values.shape).astype(np.float32)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
            onnx.save(model, str(path))
            return
    raise AssertionError("no lm_head.weight initializer to perturb")


@pytest.mark.parametrize("fault", ["drops the cache", pytest.param("perturbed logits", marks=pytest.mark.slow)])
def test_the_gate_refuses_a_wrong_graph_with_the_measured_difference_and_writes_nothing(tmp_path, monkeypatch, fault):
    if fault == "drops the cache":
        monkeypatch.setattr(decoder_export, "FlatCache", _DropsTheCache)
    else:
        to_onnx = decoder_export._to_onnx
        monkeypatch.setattr(decoder_export, "_to_onnx", lambda *a: (to_onnx(*a), _perturb_output(a[2])))
    model = _model(4, 2)
    with pytest.raises(GenerationParityError) as err:
        decoder_export.export_decoder(model, model.config.metadata(), tmp_path)
    message = str(err.value)
    assert "lm-h4-kv2-d32" in message and "max abs" in message and "> atol" in message
    assert ("step 1" in message) if fault == "drops the cache" else ("prefill" in message)
    assert list(tmp_path.iterdir()) == []  # no folder, no staging left behind
