"""``pyllamacpp graph``: what one forward pass of a model computes, node by node.

The map for graph taps (``ctx.capture`` / ``ctx.patch``): every node of one pass in graph order,
as llama.cpp's eval callback (``cb_eval``) sees it: its name (``<site>-<layer>``, as the graph
callback names it), op, ggml type, shape in numpy order at ``--n-tokens`` tokens, and the axis
that holds the ubatch's rows; then the input leaves (the KQ mask, positions, token ids, KV cache
tensors) that no callback visits and taps read through their readers' ``src[]``. Views
(RESHAPE, VIEW, PERMUTE, TRANSPOSE) compute nothing and are left out unless ``--views``.
Made by probe decodes in a throwaway context with the same flags (``ctx.graph_nodes()``).
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import Command, add_model_flags, context_kwargs, load_model

__all__ = ["add_parser", "run", "print_report", "main"]


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ctx=512)
    p.add_argument("--n-tokens", type=int, default=3, help="tokens of the pass whose shapes are shown")
    p.add_argument("--layers", default=None, help="only these layers, e.g. 0,5 (and the unlayered nodes)")
    p.add_argument("--views", action="store_true", help="also list the view nodes (no compute)")
    p.add_argument("--sites", action="store_true", help="print only the sites and inputs, one line each")


def run(args: argparse.Namespace) -> dict:
    """The listing of the model and context the flags ask for.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``model``, ``flash_attn``, ``n_tokens``, ``n_nodes``, ``sites``, ``nodes`` and ``inputs``
        (one dict per :class:`~pyllamacpp.taps.GraphNode`), ``layers``, ``views``.
    """
    import dataclasses

    with load_model(args) as model, model.context(**context_kwargs(args)) as ctx:
        g = ctx.graph_nodes(args.n_tokens)
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",") if x.strip()]
    return {
        "model": str(model.path),
        "flash_attn": g.flash_attn,
        "n_tokens": g.n_tokens,
        "n_nodes": len(g),
        "sites": g.sites(),
        "nodes": [dataclasses.asdict(n) for n in g.nodes],
        "inputs": [dataclasses.asdict(n) for n in g.inputs],
        "layers": layers,
        "views": bool(args.views),
        "sites_only": bool(getattr(args, "sites", False)),
    }


def print_report(data: dict) -> None:
    """Print the listing as a table (or the sites and inputs).

    Args:
        data: What :func:`run` returned.
    """
    from pathlib import Path

    print(
        f"model {Path(data['model']).name}: {data['n_nodes']} nodes per pass, flash attention "
        f"{'on' if data['flash_attn'] else 'off'}, shapes at {data['n_tokens']} tokens (numpy order)"
    )
    if data["sites_only"]:
        print("sites: " + ", ".join(data["sites"]))
        print("inputs: " + ", ".join(_input_names(data["inputs"])))
        return
    layers = data["layers"]
    rows: list[dict[str, Any]] = []
    for n in [*data["nodes"], *data["inputs"]]:
        if n["is_view"] and not data["views"]:
            continue
        if layers is not None and n["layer"] is not None and n["layer"] not in layers:
            continue
        rows.append(n)
    print(f"{'#':>5}  {'name':<34} {'op':<15} {'type':<5} {'shape':<22} {'rows axis':<9}")
    print(f"{'-' * 5}  {'-' * 34} {'-' * 15} {'-' * 5} {'-' * 22} {'-' * 9}")
    for n in rows:
        idx = "in" if n["kind"] == "input" else str(n["index"])
        axis = "-" if n["token_axis"] is None else str(n["token_axis"])
        line = f"{idx:>5}  {n['name']:<34} {n['op']:<15} {n['type']:<5} {str(tuple(n['shape'])):<22} {axis}"
        print(line.rstrip())


def _input_names(inputs: list[dict]) -> list[str]:
    """Input names, the KV cache tensors of every layer as one entry (``cache_k_l<0..29>``)."""
    layers: dict[str, list[int]] = {}
    for i in inputs:
        key = i["name"] if i["layer"] is None else f"{i['site']}_l"
        layers.setdefault(key, [])
        if i["layer"] is not None:
            layers[key].append(i["layer"])
    return [k if not ls else f"{k}<{min(ls)}..{max(ls)}>" for k, ls in layers.items()]


COMMAND = Command("graph", "the nodes one forward pass computes (the map for graph taps)", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
