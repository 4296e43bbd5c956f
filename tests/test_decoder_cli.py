"""`mha-serving export --decoder` and `mha-serving train --task docs-lm` from the command line: an untrained decoder's
folder, and every bad input as one line on stderr with a non-zero exit status and no model folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main

MHA_SERVING = Path(sys.executable).parent / "mha-serving"
SMALL = ["--d-model", "16", "--layers", "1", "--max-len", "40"]

BAD_INPUTS = [
    (["export", "--decoder", "--heads", "4", "--kv-heads", "3", *SMALL], "kv_heads=3 does not divide h=4"),
    (["export", "--decoder", "--heads", "4,8", "--kv-heads", "8", *SMALL], "kv_heads=8 does not divide h=4"),
    (["export", "--decoder", "--heads", "4", "--d-model", "16", "--max-len", "20"], "--max-len 20 is below 37"),
    (["export", "--decoder", "--heads", "4", "--attention", *SMALL], "--attention does not apply to --decoder"),
    (["export", "--heads", "4", "--kv-heads", "2", *SMALL], "--kv-heads needs --decoder"),
    (["export", "--decoder", "--heads", "4", "--kv-heads", "0", *SMALL], "kv_heads must be an integer >= 1"),
    (["train", "--task", "docs-lm", "--heads", "4", "--kv-heads", "3", *SMALL], "kv_heads=3 does not divide h=4"),
    (["train", "--task", "docs-lm", "--heads", "4", "--d-model", "16", "--max-len", "8"], "--max-len 8 is below 37"),
    (
        ["train", "--task", "docs-lm", "--heads", "2", "--d-model", "16", "--max-len", "60000"],
        "validation split of docs-lm holds",
    ),
    (["train", "--task", "docs-lm", "--heads", "2", "--val-fraction", "1.5", *SMALL], "--val-fraction must be"),
    (["train", "--task", "kv-compare", "--kv-heads", "2"], "--kv-heads applies to --task docs-lm only"),
]


@pytest.fixture
def keep_torch_threads():
    """`train` sets torch's thread count for its run; in process, give the session's back after."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("argv", "words"), BAD_INPUTS, ids=[" ".join(argv) for argv, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, capsys, keep_torch_threads, argv, words):
    out = tmp_path / "models"
    status = main([*argv, "--out", str(out)])  # the console script's entry, in process (torch imported once)
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"mha-serving {argv[0]}: ")
    assert words in captured.err
    assert "Traceback" not in captured.out + captured.err
    assert not out.exists() or not any(out.iterdir())


def test_the_console_script_says_it_on_stderr_with_its_exit_status(tmp_path):
    argv, words = BAD_INPUTS[0]
    command = [str(MHA_SERVING), *argv, "--out", str(tmp_path / "models")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("mha-serving export: ") and words in done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "models").exists()


@pytest.mark.slow
def test_export_decoder_writes_an_untrained_decoder_folder(tmp_path):
    argv = ["export", "--decoder", "--heads", "2", "--kv-heads", "1", *SMALL, "--out", str(tmp_path)]
    done = subprocess.run([str(MHA_SERVING), *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "lm-h2-kv1-d16: passed the parity gate" in done.stdout
    names = {p.name for p in (tmp_path / "lm-h2-kv1-d16").iterdir()}
    assert {"model.onnx", "config.json", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= names


def test_a_config_file_sets_decoder_and_kv_heads_and_names_take_the_lm_prefix(tmp_path):
    from export import cli

    config = tmp_path / "export.yaml"
    config.write_text("decoder: true\nkv_heads: 2\nheads: [4, 8]\nd_model: 64\n")
    settings = cli.parse_settings(["--config", str(config)])
    assert (settings.decoder, settings.kv_heads, settings.heads, settings.prefix) == (True, 2, (4, 8), "lm")
    assert [job.config.name for job in cli._jobs(settings, takes_config=True)] == ["lm-h4-kv2-d64", "lm-h8-kv2-d64"]
    assert cli.parse_settings(["--heads", "4"]).prefix == "mha"
