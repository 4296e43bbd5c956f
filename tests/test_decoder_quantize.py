"""Precision variants of decoders: an int8 (and fp16) folder beside the fp32 one with its metadata and files, greedy
tokens through a cache loop written here agreeing with fp32's at the share the gate measured, the gate refusing
without writing anything, and `mha-serving quantize` refusing bad inputs in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import export_tiny_model

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import MetadataError
from export import onnx_file
from export.decoder_quantize import (
    NEW_TOKENS,
    DecoderGateSettings,
    gate_text,
    make_decoder_variant,
)
from export.quantize import GateError
from export.quantize_cli import main

FP32_FILES = {"model.onnx", "config.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"}


# (query heads, key/value heads): multi-query in the inner loop (`make test-fast`), multi-head in `make test`
HEAD_PAIRS = [(4, 1), pytest.param((4, 4), marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=HEAD_PAIRS, ids=lambda pair: f"h{pair[0]}-kv{pair[1]}")
def trained(request, tmp_path_factory) -> Path:
    """A tiny decoder trained 40 steps on docs-lm (a few seconds), exported with its training record."""
    from export.docs_corpus import load_corpus
    from export.lm_train import LMTrainConfig, export_trained_lm, train_lm

    heads, kv_heads = request.param
    config = LMTrainConfig(
        heads=heads, kv_heads=kv_heads, d_model=32, layers=1, max_len=48, steps=40, batch_size=16, lr=1e-2
    )
    result = train_lm(config, log=None, corpus=load_corpus())
    return export_trained_lm(result, tmp_path_factory.mktemp("trained")).folder


@pytest.fixture(scope="module")
def int8(trained):
    return make_decoder_variant(trained, "int8")  # beside the fp32 folder


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])


def _types(path: Path) -> dict[str, int]:
    graph = onnx.load(str(path / "model.onnx")).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}


def test_the_int8_variant_is_a_sibling_folder_with_its_metadata_and_the_fp32_files(trained, int8):
    assert int8.name == f"{trained.name}-int8" and int8.folder == trained.parent / int8.name
    names = {p.name for p in int8.folder.iterdir()}
    assert names == FP32_FILES | {"training.json"}  # not checkpoint.pt: those are the fp32 weights
    meta = onnx_file.read_any_metadata(int8.folder / "model.onnx")
    assert isinstance(meta, DecoderMetadata)
    assert (meta.name, meta.precision, meta.quantized_from) == (int8.name, "int8", trained.name)
    source = onnx_file.read_any_metadata(trained / "model.onnx")
    assert (meta.heads, meta.kv_heads, meta.task) == (source.heads, source.kv_heads, "docs-lm")
    assert meta.quantization["op_types"] == ["MatMul"] and meta.quantization["mode"] == "dynamic"
    assert meta.quantization["gate"]["agreement"] == int8.gate.agreement
    config = json.loads((int8.folder / "config.json").read_text())
    assert config["precision"] == "int8" and config["quantized_from"] == trained.name and config["params"] > 0
    for file_name in ("genai_config.json", "tokenizer.json"):  # the same tensors' names, heads and dtypes
        assert (int8.folder / file_name).read_bytes() == (trained / file_name).read_bytes()
    ops = {node.op_type for node in onnx.load(str(int8.folder / "model.onnx")).graph.node}
    assert {"MatMulInteger", "GroupQueryAttention"} <= ops  # MatMuls in int8, attention as it was
    assert _types(int8.folder) == _types(trained)  # int64 ids, mask and positions; float32 logits and cache
    assert int8.file_bytes < 0.85 * int8.source_bytes  # the tied embedding table (most of a tiny model) stays fp32
    gate = int8.gate
    assert gate.tokens >= 8000 and gate.prompts == 8 and gate.new_tokens == NEW_TOKENS
    assert gate.perplexity_ratio <= 1.02 and gate.agreement >= 0.95
    assert gate.fp32_perplexity < 40  # trained: far below uniform (260)


def test_int8_greedy_tokens_agree_with_fp32_at_the_measured_share(trained, int8):
    """Each decoder with its own cache (present fed back as past), both fed the fp32 decoder's tokens."""
    meta = onnx_file.read_any_metadata(trained / "model.onnx")
    _, prompts, _ = gate_text(meta, DecoderGateSettings())
    sessions = [_session(trained), _session(int8.folder)]
    empty = np.zeros((len(prompts), meta.kv_heads, 0, meta.head_dim), np.float32)
    pasts = [{f"past_key_values.{i}.{k}": empty for i in range(meta.layers) for k in ("key", "value")}] * 2
    ids, total, same = prompts, prompts.shape[1], 0
    for _ in range(NEW_TOKENS):
        mask = np.ones((len(ids), total), np.int64)
        positions = np.tile(np.arange(total - ids.shape[1], total), (len(ids), 1))
        chosen = []
        for i, session in enumerate(sessions):
            logits, *present = session.run(
                None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **pasts[i]}
            )
            pasts[i] = dict(zip(pasts[i], present, strict=True))
            chosen.append(logits[:, -1].argmax(axis=-1))
        same += int((chosen[0] == chosen[1]).sum())
        ids, total = chosen[0][:, None], total + 1
    assert same / (NEW_TOKENS * len(prompts)) == pytest.approx(int8.gate.agreement, abs=1 / (NEW_TOKENS * len(prompts)))


def test_the_gate_refuses_an_impossible_bound_and_writes_nothing(trained, tmp_path, capsys):
    with pytest.raises(GateError, match=r"perplexity [\d.]+ is [\d.]+ x fp32's [\d.]+ \(> 0\.5\)") as failed:
        make_decoder_variant(trained, "int8", tmp_path, gate=DecoderGateSettings(max_perplexity_ratio=0.5))
    assert "greedy-token agreement" in str(failed.value) and "not written" in str(failed.value)
    assert "\n" not in str(failed.value) and list(tmp_path.iterdir()) == []
    code = main(["--model", str(trained), "--out", str(tmp_path), "--max-perplexity-ratio", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "failed the quality gate" in err
    assert list(tmp_path.iterdir()) == []


def test_an_fp16_decoder_keeps_its_inputs_outputs_and_cache_in_their_types(trained, tmp_path):
    variant = make_decoder_variant(trained, "fp16", tmp_path)
    model = onnx.load(str(variant.folder / "model.onnx"))
    assert onnx.TensorProto.FLOAT16 in {t.data_type for t in model.graph.initializer}
    assert _types(variant.folder) == _types(trained)
    assert variant.meta.precision == "fp16" and variant.gate.agreement >= 0.95
    assert variant.gate.gpu_gate == "passed" or variant.gate.gpu_gate.startswith("not run: ")


@pytest.mark.gpu
def test_an_fp16_decoder_passes_its_gate_on_the_gpu(trained, tmp_path):
    variant = make_decoder_variant(trained, "fp16", tmp_path)
    assert (variant.gate.gpu_gate, variant.gate.device) == ("passed", "gpu")


def test_the_cli_writes_a_decoder_variant_and_skips_it_when_it_exists(trained, tmp_path, capsys):
    assert main(["--model", str(trained), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{trained.name}-int8: passed the gate (perplexity" in out and "of fp32)" in out
    assert main(["--model", str(trained), "--out", str(tmp_path)]) == 0
    assert "exists, skipped" in capsys.readouterr().out


def test_onnxruntime_genai_loads_the_int8_folder_as_it_is(int8):
    og = pytest.importorskip("onnxruntime_genai")
    meta = int8.meta
    prompt = [meta.bos_id, 80, 121, 116, 104, 111, 110]
    params = og.GeneratorParams(model := og.Model(str(int8.folder)))
    params.set_search_options(max_length=len(prompt) + 24, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    theirs = []
    while not generator.is_done():
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    sess = _session(int8.folder)
    empty = np.zeros((1, meta.kv_heads, 0, meta.head_dim), np.float32)
    past = {name: empty for name in meta.input_names[3:]}
    ours = ids = np.array([prompt], np.int64)
    for _ in range(24):
        total = ours.shape[1]
        positions = np.arange(total - ids.shape[1], total)[None]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total), np.int64), "position_ids": positions}
        logits, *present = sess.run(None, {**feeds, **past})
        past = dict(zip(past, present, strict=True))
        ids = logits[:, -1:].argmax(axis=-1)
        ours = np.concatenate([ours, ids], axis=1)
    mine = ours[0, len(prompt) :].tolist()
    if meta.eos_id in mine:  # genai stops at EOS, as its config says
        mine = mine[: mine.index(meta.eos_id) + 1]
    assert theirs == mine


def test_bad_inputs_are_one_line_and_exit_2(trained, int8, tmp_path, capsys):
    classifier = export_tiny_model(tmp_path, heads=2).folder
    for argv, message in (
        (["--model", str(classifier), "--max-perplexity-ratio", "1.1"], "applies to decoders; mha-h2-d32 is a"),
        (
            ["--model", str(trained), "--min-agreement", "0.9"],
            f"--min-agreement applies to classifiers; {trained.name}",
        ),
        (["--model", str(trained), "--mode", "static"], "--mode static applies to classifiers"),
        (["--model", str(int8.folder)], f"already int8: make variants from its fp32 source {trained.name!r}"),
        (["--model", str(trained), "--prompts", "0"], "prompts must be >= 1"),
        (["--model", str(trained), "--min-token-agreement", "1.5"], "min_token_agreement must be in [0, 1]"),
        (["--model", str(tmp_path / "nothing")], "no model.onnx"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mha-h2-d32"]


def test_decoder_metadata_names_the_source_of_a_variant():
    base = dict(name="lm-h4-kv1-d32", heads=4, kv_heads=1, head_dim=8, d_model=32, layers=1, vocab_size=260)
    base.update(max_len=48, bos_id=1, eos_id=2, pad_id=0)
    variant = DecoderMetadata(**base, precision="int8", quantized_from="lm-h4-kv1-d32", quantization={"mode": "x"})
    assert DecoderMetadata.from_props(variant.to_props()) == variant
    assert DecoderMetadata.from_props(DecoderMetadata(**base).to_props()).quantized_from == ""
    for precision, source in (("int8", ""), ("fp32", "lm-h4-kv1-d32")):
        with pytest.raises(MetadataError, match="quantized_from"):
            DecoderMetadata(**base, precision=precision, quantized_from=source)
