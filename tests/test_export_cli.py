"""`mha-serving export`: end to end with its table, the config file, `--model` factories, and every bad input's
exit status and one-line message."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from contract.metadata import ATTENTION_MODEL_FILE, CONFIG_FILE, MODEL_FILE
from export import cli

MHA_SERVING = Path(sys.executable).parent / "mha-serving"
SMALL_FLAGS = ["--d-model", "16", "--layers", "1", "--ff-dim", "32", "--max-len", "12"]

FACTORIES = """
import torch
from torch import nn

from export.attention import MultiHeadAttention
from export.model import EncoderClassifier, EncoderConfig


def build(config):
    return EncoderClassifier(config)


def fixed():
    return EncoderClassifier(EncoderConfig(heads=2, d_model=8, layers=2, ff_dim=16, max_len=8, num_classes=3,
                                           labels=("a", "b", "c")))


def raises(config):
    raise RuntimeError("weights file not found\\nsecond line")


def not_a_module(config):
    return {"model": 1}


def without_our_layer():
    return nn.Linear(4, 2)


class PerToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(260, 8)
        self.attn = MultiHeadAttention(8, 2)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        x, _ = self.attn(self.emb(input_ids), attention_mask)
        return self.head(x)  # (B, T, 2): the contract wants (B, 2)


class DataDependent(PerToken):
    def forward(self, input_ids, attention_mask):
        x, _ = self.attn(self.emb(input_ids), attention_mask)
        if attention_mask.sum() > 3:  # torch.export cannot trace this; it prints the graph to stderr when it fails
            x = -x
        return self.head(x.mean(dim=1))


def two_arguments(config, other):
    return None
"""


@pytest.fixture
def factories(tmp_path, monkeypatch) -> str:
    """A user's module of factories in the current directory (as a user would run the CLI); returns its name."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the current directory on it
    yield name
    sys.modules.pop(name, None)


def _run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _model_folders(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


@pytest.mark.slow
def test_cli_end_to_end_exports_each_head_count_and_prints_progress_and_table(tmp_path):
    out = tmp_path / "models"
    argv = [str(MHA_SERVING), "export", "--heads", "1,2", *SMALL_FLAGS, "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the exporter's warnings and log lines are silenced
    lines = proc.stdout.splitlines()
    for i, name in enumerate(["mha-h1-d16", "mha-h2-d16"], start=1):
        assert any(line.startswith(f"[{i}/2] {name}: exporting (h={i}, head_dim={16 // i}") for line in lines)
        assert any(line.startswith(f"[{i}/2] {name}: passed the parity gate") and line.endswith(" s") for line in lines)
        assert sorted(p.name for p in (out / name).iterdir()) == [CONFIG_FILE, MODEL_FILE]
    header = next(i for i, line in enumerate(lines) if line.startswith("name "))
    assert lines[header].split() == ["name", "h", "head_dim", "params", "file", "size", "max", "diff", "seconds"]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [row[:3] for row in rows] == [["mha-h1-d16", "1", "16"], ["mha-h2-d16", "2", "8"]]
    for row, name in zip(rows, ["mha-h1-d16", "mha-h2-d16"], strict=True):
        params = json.loads((out / name / CONFIG_FILE).read_text())["params"]
        assert row[3] == f"{params:,}"
        assert float(row[6]) <= 1e-4 and float(row[7]) > 0
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0
    assert "mha-h1-d16: exists" in again.stdout and "0 exported" in again.stdout


@pytest.mark.slow
def test_config_file_sets_the_keys_and_flags_override_it(tmp_path, capsys, factories):
    config = tmp_path / "export.yaml"
    config.write_text("heads: [1, 4]\nd-model: 16\nlayers: 2\nff_dim: 32\nmax_len: 10\nlabels: [neg, neu, pos]\n")
    out = tmp_path / "models"
    argv = ["--config", config, "--heads", "2", "--model", f"{factories}:build", "--out", out, "--seed", "3"]
    code, stdout, err = _run_cli(argv, capsys)
    assert (code, err) == (0, "")
    assert _model_folders(out) == ["mha-h2-d16"]
    saved = json.loads((out / "mha-h2-d16" / CONFIG_FILE).read_text())
    assert (saved["heads"], saved["head_dim"], saved["layers"], saved["ff_dim"]) == (2, 8, 2, 32)
    assert (saved["max_len"], saved["labels"], saved["num_classes"]) == (10, ["neg", "neu", "pos"], 3)
    assert "mha-h2-d16" in stdout.splitlines()[-2]


def test_json_config_file_with_the_flag_names_parses_to_the_same_settings(tmp_path):
    config = tmp_path / "export.json"
    config.write_text(json.dumps({"heads": "1,2", "d-model": 64, "head_dim": 40, "attention": True, "out": "m"}))
    settings = cli.parse_settings(["--config", str(config), "--layers", "3"])
    assert (settings.heads, settings.d_model, settings.head_dim, settings.layers) == ((1, 2), 64, 40, 3)
    assert settings.attention is True and settings.out == Path("m") and settings.force is False


@pytest.mark.slow
def test_a_factory_without_arguments_is_exported_once_with_its_attention_variant(tmp_path, capsys, factories):
    out = tmp_path / "models"
    code, stdout, err = _run_cli(["--model", f"{factories}:fixed", "--attention", "--out", out], capsys)
    assert (code, err) == (0, "")
    assert _model_folders(out) == ["mha-h2-d8"]
    assert sorted(p.name for p in (out / "mha-h2-d8").iterdir()) == [CONFIG_FILE, ATTENTION_MODEL_FILE, MODEL_FILE]
    saved = json.loads((out / "mha-h2-d8" / CONFIG_FILE).read_text())
    assert (saved["layers"], saved["max_len"], saved["labels"]) == (2, 8, ["a", "b", "c"])
    assert "[1/1] mha-h2-d8: passed the parity gate" in stdout


USAGE_ERRORS = [
    (["--heads", "3", "--d-model", "32"], ["d_model=32", "h=3", "head_dim"]),
    (["--heads", "0"], ["h=0", ">= 1"]),
    (["--heads", "2,-4"], ["h=-4"]),
    (["--heads", "2,x"], ["heads", "'2,x'"]),
    (["--heads", ""], ["heads"]),
    (["--heads", "2,2"], ["twice"]),
    (["--d-model", "abc"], ["--d-model", "'abc'"]),
    (["--layers", "0"], ["layers", "0"]),
    (["--max-len", "1"], ["max_len", "1"]),
    (["--labels", "a,b", "--num-classes", "3"], ["--num-classes 3", "2 --labels"]),
    (["--model", "{factories}:fixed", "--labels", "a,b", "--num-classes", "3"], ["--num-classes 3", "2 --labels"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["--model", "json"], ["package.module:factory"]),
    (["--model", "no_such_package_xyz.models:build"], ["no module named 'no_such_package_xyz'"]),
    (["--model", "json:no_such_factory"], ["json has no attribute 'no_such_factory'"]),
    (["--model", "json:__doc__"], ["not a callable"]),
    (["--model", "{factories}:two_arguments"], ["one argument"]),
    (["--model", "{factories}:fixed", "--heads", "2"], ["--heads has no effect"]),
    (["--config", "{tmp}/missing.yaml"], ["cannot read config file"]),
    (["--config", "{tmp}/bad.yaml"], ["not valid yaml"]),
    (["--config", "{tmp}/bad.json"], ["not valid json"]),
    (["--config", "{tmp}/list.yaml"], ["must hold a mapping"]),
    (["--config", "{tmp}/unknown.yaml"], ["unknown key 'hedas'"]),
    (["--config", "{tmp}/wrong-type.yaml"], ["ff_dim must be an integer", "'four'"]),
]
EXPORT_ERRORS = [
    (["--out", "{tmp}/a-file/models"], ["cannot write to output folder", "a-file"]),
    (["--model", "{factories}:raises"], ["raised RuntimeError: weights file not found"]),
    (["--model", "{factories}:not_a_module"], ["object of type dict, not a torch.nn.Module"]),
    (["--model", "{factories}:without_our_layer"], ["without an export.attention.MultiHeadAttention"]),
    (["--model", "{factories}:PerToken"], ["mha-h2-d8", "(1, 1, 2)", "contract wants (1, 2)"]),
    (["--model", "{factories}:PerToken", "--attention"], ["has no forward_with_attention"]),
    (["--model", "{factories}:DataDependent"], ["torch.onnx.export failed for mha-h2-d8", "data-dependent"]),
]


def _write_bad_configs(tmp: Path) -> None:
    (tmp / "bad.yaml").write_text("heads: [1, 2\n")
    (tmp / "bad.json").write_text("{'heads': 1}")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "unknown.yaml").write_text("hedas: [1, 2]\n")
    (tmp / "wrong-type.yaml").write_text("ff_dim: four\n")
    (tmp / "a-file").write_text("a file, not a folder")


@pytest.mark.parametrize(
    ("argv", "words", "code"),
    [(argv, words, 2) for argv, words in USAGE_ERRORS] + [(argv, words, 1) for argv, words in EXPORT_ERRORS],
    ids=[" ".join(argv) for argv, _ in USAGE_ERRORS + EXPORT_ERRORS],
)
def test_bad_input_is_one_line_on_stderr_with_its_exit_status_and_no_model_folder(
    tmp_path, capsys, factories, argv, words, code
):
    _write_bad_configs(tmp_path)
    out = tmp_path / "models"
    argv = [a.format(tmp=tmp_path, factories=factories) for a in argv]
    for flag, value in [("--out", out), ("--d-model", 16), ("--max-len", 8), ("--layers", 1)]:  # small and quick
        if flag not in argv:
            argv += [flag, str(value)]
    got, stdout, err = _run_cli(argv, capsys)
    assert got == code
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("mha-serving export: ")
    for word in words:
        assert word in err
    assert "Traceback" not in stdout + err
    assert _model_folders(out) == []


_WITHOUT_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
from service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_torch_help_works_and_an_export_says_which_extra_to_install(tmp_path):
    run = [sys.executable, "-c", _WITHOUT_TORCH, "export"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "--heads" in shown.stdout
    refused = subprocess.run([*run, "--heads", "2", "--out", str(tmp_path / "m")], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "'torch' is not installed" in refused.stderr
    assert "pip install -e '.[export]'" in refused.stderr
    assert not (tmp_path / "m").exists()
