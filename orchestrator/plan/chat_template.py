"""Whether a chat template reads a message's content as a list of parts ("openai") or as one string ("string"),
decided from the template's Jinja syntax tree the way vLLM decides it (its renderer's content-format detection), so
a chat reaches the template in the form vLLM hands it over (chat.py):

- the names that hold the messages: `messages`, and every `{% set x = ... %}` whose value is one of them, through
  filters, tests and slices (`messages[1:]`, `messages | list`);
- the messages: the variables of the loops over those names (`{% for message in messages %}`);
- the template is "openai" when a loop iterates over a message's content (`message['content']`, `message.content`,
  through filters, tests and slices), over a macro's parameter that some call of the macro passes a message's content
  to, or over a variable named `content` outside every macro. Otherwise it is "string", as is a template the walk
  cannot follow (one that does not parse, a loop or `set` on the way whose target is not a plain name).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2.meta
import jinja2.nodes as nodes

ContentFormat = Literal["string", "openai"]


class _Unfollowable(Exception):
    """A loop or `set` on the walk's way whose target is not a plain name."""


NOT_KWARGS = ("chat_template", "tokenize")
"""`apply_chat_template` arguments that chat_template_kwargs may not set (the template is the tokenizer's; the
prompt is rendered as text, then tokenized)."""


def _parsed(template: str) -> nodes.Template:
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the environment it renders with

    return _compile_jinja_template(template).environment.parse(template)


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """"openai" when `template` loops over a message's content, else "string" (see the module)."""
    try:
        return "string" if next(_content_loops(_parsed(template)), None) is None else "openai"
    except Exception:  # noqa: BLE001 - a template that does not parse, or that the walk cannot follow
        return "string"


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables `template` reads from outside (`messages`, `bos_token`, `enable_thinking`, ...); none for a
    template that does not parse (rendering it raises its own error)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_parsed(template)))
    except Exception:  # noqa: BLE001
        return frozenset()


@lru_cache(maxsize=32)
def template_arguments(template: str) -> frozenset[str]:
    """The chat_template_kwargs keys that reach `template`, as vLLM passes them: its variables, and transformers' own
    `apply_chat_template` arguments (`tools`, `documents`, ...) but NOT_KWARGS; vLLM leaves any other key out."""
    from transformers import PreTrainedTokenizerBase

    own = {name for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}
    return frozenset((template_variables(template) | own) - set(NOT_KWARGS))


def _target(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise _Unfollowable
    return target.name


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (with `key`: `name[key]` or `name.key`), under filters, tests and slices."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        if node.node is None:  # a {% filter %} block's filter
            return False
        node = node.node
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _message_lists(tree: nodes.Template) -> set[str]:
    names, queue = {"messages"}, ["messages"]
    while queue:
        name = queue.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, name) and (target := _target(assign.target)) not in names:
                names.add(target)
                queue.append(target)
    return names


def _messages(tree: nodes.Template) -> list[str]:
    lists = _message_lists(tree)
    return [_target(loop.target) for loop in tree.find_all(nodes.For)
            if any(_reads(loop.iter, name) for name in lists)]


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    messages = _messages(tree)

    def holds_content(node: nodes.Node) -> bool:
        return any(_reads(node, message, "content") for message in messages)

    content_params: dict[int, set[str]] = {}  # loop in a macro -> the macro's parameters given a message's content
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        given: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given.update(params[i] for i, arg in enumerate(call.args[:len(params)]) if holds_content(arg))
                given.update(kw.key for kw in call.kwargs if kw.key in params and holds_content(kw.value))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                content_params[id(loop)] = given
    for loop in tree.find_all(nodes.For):
        over_name = isinstance(loop.iter, nodes.Name)
        if (holds_content(loop.iter)
                or (over_name and loop.iter.name in content_params.get(id(loop), ()))
                or (over_name and id(loop) not in in_macros and loop.iter.name == "content")):
            _target(loop.target)
            yield loop
