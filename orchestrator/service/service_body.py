"""A request body as YAML, with alias expansion capped: a small body cannot become a large config.

YAML aliases share one node among many places, so a few hundred bytes of `&a [*b, *b, ...]` can stand for
millions of values; they stay small in memory until something walks them (draccus, `json.dumps` into run.json)
and then swell. The body is composed into YAML nodes first, and the size of the config it would expand into
(nodes and scalar bytes, each alias counted as the whole of what it names) is measured on the shared node graph
before anything is constructed; over the caps, or recursive, is an error naming the cap.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_EXPANDED_NODES = 10_000
"""Most values (mappings, lists, scalars) a config may expand into; a run config has about a hundred."""


class BodyTooLargeWhenExpanded(ValueError):
    """The body's aliases expand beyond the caps, or refer to themselves."""


def load_body(text: str, max_bytes: int, max_nodes: int = MAX_EXPANDED_NODES) -> Any:
    """The YAML (or JSON) document in `text`, refused if its aliases expand beyond `max_nodes` values or
    `max_bytes` of scalar text (yaml.YAMLError for bad YAML, BodyTooLargeWhenExpanded for the caps)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, {}, set(), max_nodes, max_bytes)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _measure(node: yaml.Node, sizes: dict[int, tuple[int, int]], open_nodes: set[int], max_nodes: int,
             max_bytes: int) -> tuple[int, int]:
    """(values, scalar bytes) of `node` expanded; shared nodes are measured once (`sizes`), cycles refused."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise BodyTooLargeWhenExpanded("the config's YAML aliases refer to themselves (a recursive alias); "
                                       "write the values out")
    if isinstance(node, yaml.ScalarNode):
        size = (1, len(node.value))
    else:
        open_nodes.add(key)
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        size = (1, 0)
        for child in children:
            values, nbytes = _measure(child, sizes, open_nodes, max_nodes, max_bytes)
            size = (size[0] + values, size[1] + nbytes)
        open_nodes.discard(key)
    if size[0] > max_nodes or size[1] > max_bytes:
        raise BodyTooLargeWhenExpanded(
            f"the config expands (through YAML aliases) beyond {max_nodes:,} values or {max_bytes:,} bytes of text; "
            "a run config has about a hundred values: write it out without anchors and aliases (&name, *name)")
    sizes[key] = size
    return size
