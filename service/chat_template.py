"""A decoder's chat template: `chat_template` in its folder's tokenizer_config.json (Jinja, the Hugging Face convention
that vLLM and ONNX Runtime GenAI read), rendered in Jinja's sandbox with the conversation's messages. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from contract.decoder_metadata import TOKENIZER_CONFIG_FILE
from service.errors import BadRequestError


class ChatTemplates:
    """By model name, each read from `models_dir` again when its file changes. `bos_token` renders as "": the
    tokenizer puts BOS first itself."""

    def __init__(self, models_dir: str | Path) -> None:
        self._dir = Path(models_dir)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._read: dict[str, tuple[int | None, Template | None]] = {}  # name -> (the file's mtime, its template)

    def render(self, name: str, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages` (role, content) with the assistant's turn opened; BadRequestError (400) for a
        model without a template, or one that fails on these messages."""
        template = self._template(name)
        if template is None:
            raise BadRequestError(
                f"model {name!r} has no chat template (`chat_template` in its {TOKENIZER_CONFIG_FILE}): "
                "use /openai/v1/completions"
            )
        try:
            return template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except TemplateError as exc:
            raise BadRequestError(f"model {name!r}'s chat template fails on these messages: {exc}") from exc

    def _template(self, name: str) -> Template | None:
        path = self._dir / name / TOKENIZER_CONFIG_FILE
        try:
            stamp: int | None = path.stat().st_mtime_ns
        except OSError:
            stamp = None
        if (read := self._read.get(name)) is not None and read[0] == stamp:
            return read[1]
        source = _source(path) if stamp is not None else None
        try:
            template = None if source is None else self._env.from_string(source)
        except TemplateError as exc:
            raise BadRequestError(f"model {name!r}'s chat template does not compile: {exc}") from exc
        self._read[name] = (stamp, template)
        return template


def _source(path: Path) -> str | None:
    """The file's `chat_template`: a string, or (Hugging Face's other form) the one named "default" of a list."""
    try:
        found = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None
