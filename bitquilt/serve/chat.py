"""A model's chat template (chat_template.jinja, or tokenizer_config.json's `chat_template`) turning messages into
the prompt text, rendered in Jinja's immutable sandbox: a template comes with the model's files and may not reach
Python objects, attributes or the file system."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bitquilt.errors import UserError
from bitquilt.serve.protocol import ApiError


def _template_text(directory: Path) -> str | None:
    """The template source of a model directory, or None when it has none."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """Render chat messages into a prompt with the template of a model directory."""

    def __init__(self, directory: str | Path, bos_token: str | None, eos_token: str | None):
        try:
            source = _template_text(Path(directory))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the chat template in {directory}: {e}") from None
        self.template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise  # what Hugging Face templates call to refuse a conversation
            try:
                self.template = env.from_string(source)
            except TemplateError as e:
                raise UserError(f"the chat template in {directory} does not parse: {e}") from None
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for `messages`, ending where the assistant's answer begins; ApiError where the model has no
        template or its template refuses the conversation."""
        if self.template is None:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:  # the template's raise_exception, or a sandbox violation
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from None
