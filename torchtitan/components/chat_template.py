"""Chat templates: the Jinja programs Hugging Face tokenizers ship to turn a conversation (a
list of ``{"role", "content"}`` messages) into the model's text, and which parts of that text
are the assistant's (what supervised fine-tuning trains on).

A template is read from ``--training.chat_template`` (a ``.jinja`` file, or a
``tokenizer_config.json`` holding one), else from the tokenizer's folder: ``chat_template.jinja``
first, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates of which ``default`` is used), as ``transformers`` looks for them. It renders as
``transformers``' ``apply_chat_template`` renders it (a sandboxed environment, ``trim_blocks``
and ``lstrip_blocks``, ``raise_exception`` and ``strftime_now``, ``tojson`` keeping non-ASCII).
No torch: the pre-flight reads and compiles templates before any rank starts.
"""

import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


class TemplateError(ValueError):
    """The template refused a conversation (its ``raise_exception``) or failed rendering it."""


def template_source(tokenizer_path: str | Path, override: str | None) -> tuple[str, str] | None:
    """The template text and where it came from: ``override`` (``--training.chat_template``),
    else the tokenizer's folder (for a tiktoken ``original/tokenizer.model``, the model folder
    above it too); ``None`` if there is none."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ConfigError(f"--training.chat_template {override}: no such file")
        if path.suffix == ".json":
            found = _from_config(path)
            if found is None:
                raise ConfigError(
                    f"--training.chat_template {override}: the file has no chat_template entry"
                )
            return found, str(path)
        return path.read_text(encoding="utf-8"), str(path)
    path = Path(tokenizer_path).expanduser()
    folder = path if path.is_dir() else path.parent
    folders = [folder, folder.parent] if folder.name == "original" else [folder]
    for place in folders:
        if (place / TEMPLATE_FILE).is_file():
            return (place / TEMPLATE_FILE).read_text(encoding="utf-8"), str(place / TEMPLATE_FILE)
        if (place / CONFIG_FILE).is_file():
            found = _from_config(place / CONFIG_FILE)
            if found is not None:
                return found, f"{place / CONFIG_FILE} (chat_template)"
    return None


def _from_config(path: Path) -> str | None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    entry = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(entry, list):  # named templates ("default", "tool_use", ...)
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) and entry.strip() else None


def missing_template_message(tokenizer_path: str) -> str:
    return (
        f"--training.data_format chat needs a chat template, and the tokenizer "
        f"{tokenizer_path} has none ({TEMPLATE_FILE} or the chat_template of {CONFIG_FILE} "
        "beside it); pass --training.chat_template FILE (a .jinja file)"
    )


class ChatTemplate:
    """A compiled chat template. ``special_tokens``: the names templates refer to
    (``bos_token``, ``eos_token``, ...), as the tokenizer spells them."""

    def __init__(self, source: str, *, where: str, special_tokens: dict[str, str] | None = None):
        from jinja2 import TemplateError as JinjaError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.where = where
        self.source = source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except JinjaError as e:
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ConfigError(f"chat template {where} is not valid Jinja{line}: {e}") from None
        self.special_tokens = dict(special_tokens or {})

    def __reduce__(self):
        # Dataloader workers started by spawn get a copy: compiled again there.
        return (_compiled, (self.source, self.where, self.special_tokens))

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError

        try:
            # (transformers passes tools and documents as None when a call has none.)
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except TemplateError:
            raise
        except (JinjaError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from None

    def assistant_spans(self, messages: Sequence[dict[str, Any]]) -> tuple[str, list, int]:
        """The conversation's text, the character spans ``[start, end)`` of each assistant
        turn in it, and how many assistant turns could not be located.

        A turn's span is what the template adds for that message (its content and end-of-turn
        marker) after the generation prompt that opens it: the text from rendering the
        conversation before it with the generation prompt to rendering it through the turn. A
        generation prompt the stored turn does not repeat (an opening ``<think>``) ends the
        span's start at what the two renderings share. A template that renders the
        conversation before a turn differently from inside the whole (some strip earlier
        turns' reasoning), or cannot render it alone (it reads ``messages[0]``), leaves the
        turn unlocated: no span."""
        text = self.render(messages, add_generation_prompt=False)
        spans, unlocated = [], 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            try:
                before = self.render(messages[:i], add_generation_prompt=False)
                opened = self.render(messages[:i], add_generation_prompt=True)
                closed = self.render(messages[: i + 1], add_generation_prompt=False)
            except TemplateError:
                unlocated += 1
                continue
            start = len(os.path.commonprefix([opened, closed]))
            if closed.startswith(before) and text.startswith(closed) and len(closed) > start:
                spans.append((start, len(closed)))
            else:
                unlocated += 1
        return text, spans, unlocated

    def prompt(self, tokenizer: Any, user_text: str) -> tuple[list[int], int | None]:
        """The token ids that ask the model for an answer to ``user_text`` (one user turn and
        the generation prompt), and the token that ends an assistant turn (the first of what
        the template writes after an answer; ``None`` if it writes nothing)."""
        asked = self.render([{"role": "user", "content": user_text}], add_generation_prompt=True)
        sentinel = "\x00answer\x00"
        turn = [{"role": "user", "content": "?"}, {"role": "assistant", "content": sentinel}]
        # (Some templates put a space before the end-of-turn token: not the end.)
        after = self.render(turn, add_generation_prompt=False).rpartition(sentinel)[2].lstrip()
        end = tokenizer.encode_template(after)[0] if after else []
        return tokenizer.encode_template(asked)[0], (end[0] if end else None)


def _compiled(source: str, where: str, special_tokens: dict[str, str]) -> ChatTemplate:
    return ChatTemplate(source, where=where, special_tokens=special_tokens)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' ``tojson``: non-ASCII text kept, json.dumps's options."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_tag():
    """``{% generation %}...{% endgeneration %}``, which ``transformers`` templates use to mark
    assistant text: rendered as its body (the spans come from prefix renderings)."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _raise(message: str) -> None:
    raise TemplateError(message)


def find_template(
    tokenizer_path: str, override: str | None, special_tokens: dict[str, str] | None = None
) -> ChatTemplate:
    """The chat template ``template_source`` finds, compiled; refused in one line when there is
    none. Also the pre-flight of ``--training.data_format chat``."""
    found = template_source(tokenizer_path, override)
    if found is None:
        raise ConfigError(missing_template_message(tokenizer_path))
    return ChatTemplate(found[0], where=found[1], special_tokens=special_tokens)
