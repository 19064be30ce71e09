"""Pipeline strings: ``profile,select{budget=0.5},rewrite``.

Items are separated by commas outside braces; an item is a pass name optionally followed by
``{key=value,...}``. A value may be a comma list (``{ops=relu,gelu,top=3}``: a comma starts a new
option only when ``key=`` follows it); quote it with single or double quotes to hold braces or
an ``=``.
"""

from __future__ import annotations

from dataclasses import dataclass


class PipelineSyntaxError(ValueError):
    """The pipeline string is malformed."""


@dataclass(frozen=True)
class PipelineItem:
    name: str
    options: dict[str, str]


def parse_pipeline(text: str) -> list[PipelineItem]:
    """Split a pipeline string into items with their raw option strings."""
    items: list[PipelineItem] = []
    position, length = 0, len(text)
    while position < length:
        start = position
        while position < length and text[position] not in ",{}":
            position += 1
        name = text[start:position].strip()
        if not name:
            raise PipelineSyntaxError(f"empty pass name at character {start + 1} of {text!r}")
        options: dict[str, str] = {}
        if position < length and text[position] == "{":
            position, options = _parse_options(text, position + 1, name)
        if position < length and text[position] == "}":
            raise PipelineSyntaxError(f"unexpected '}}' after pass '{name}' in {text!r}")
        items.append(PipelineItem(name, options))
        if position < length:
            if text[position] != ",":
                raise PipelineSyntaxError(f"expected ',' after pass '{name}' in {text!r}")
            position += 1
            if position == length:
                raise PipelineSyntaxError(f"the pipeline {text!r} ends with a comma")
    if not items:
        raise PipelineSyntaxError("the pipeline is empty")
    return items


def _parse_options(text: str, position: int, name: str) -> tuple[int, dict[str, str]]:
    options: dict[str, str] = {}
    length = len(text)
    while True:
        start = position
        while position < length and text[position] not in "=,}":
            position += 1
        key = text[start:position].strip()
        if position >= length:
            raise PipelineSyntaxError(f"unclosed '{{' in the options of pass '{name}'")
        if text[position] == "}" and not key and not options:
            return position + 1, options
        if text[position] != "=" or not key:
            raise PipelineSyntaxError(f"options of pass '{name}' must look like {{key=value,...}}")
        position += 1
        value, position = _parse_value(text, position, name)
        if key in options:
            raise PipelineSyntaxError(f"option '{key}' of pass '{name}' is given twice")
        options[key] = value
        if position >= length:
            raise PipelineSyntaxError(f"unclosed '{{' in the options of pass '{name}'")
        if text[position] == "}":
            return position + 1, options
        if text[position] != ",":
            raise PipelineSyntaxError(f"expected ',' or '}}' after option '{key}' of pass '{name}'")
        position += 1


def _parse_value(text: str, position: int, name: str) -> tuple[str, int]:
    length = len(text)
    while position < length and text[position].isspace():
        position += 1
    if position < length and text[position] in "'\"":
        quote = text[position]
        end = text.find(quote, position + 1)
        if end < 0:
            raise PipelineSyntaxError(f"unclosed quote in the options of pass '{name}'")
        after = end + 1
        while after < length and text[after].isspace():
            after += 1
        return text[position + 1:end], after
    # An unquoted value runs to the next '}' or to the next ',' that starts another key=value,
    # so a comma list like {ops=relu,gelu} needs no quotes.
    start = position
    while position < length and text[position] != "}":
        if text[position] == ",":
            following = text[position + 1:]
            next_item = following[:min((i for i in (following.find(","), following.find("}")) if i >= 0),
                                       default=len(following))]  # fmt: skip
            if "=" in next_item or not next_item.strip():
                break
        position += 1
    return text[start:position].strip(), position
