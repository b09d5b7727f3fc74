"""What the routes that translate another API into the chat request share (Ollama's, OpenAI's Responses API,
Anthropic's Messages API): a body validated with the first fault named, a field of an item read, text parts joined."""
from __future__ import annotations

from typing import Any, Collection, Dict, Mapping, Optional

from pydantic import ValidationError

from .protocol import APIError


def validated(model: type, raw: Any, names: Optional[Mapping[str, str]] = None) -> Any:
    """`raw` as `model`, or a 400 naming the first field at fault (`names`: the request's name of a field, by its
    first part)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        where = (names or {}).get(where.split(".")[0], where)
        raise APIError(400, f"{where or 'body'}: {first['msg']}", param=where or None) from None


def string_field(item: Dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def joined_text(content: Any, where: str, text_kinds: Collection[str], refused: Collection[str] = ()) -> str:
    """A content: a string, or a list of parts whose kinds are `text_kinds` (their `text` joined); a part of a kind
    in `refused` (images, files, audio) is a 400 saying the models here read text, any other a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in text_kinds and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in refused:
            raise APIError(400, f"{where}.{j}: {kind} is not supported: this server runs a text model",
                           param=f"{where}.{j}")
        else:
            first = sorted(text_kinds)[0]
            raise APIError(400, f"{where}.{j} must be a text part ({{'type': '{first}', 'text': ...}})",
                           param=f"{where}.{j}")
    return "".join(texts)
