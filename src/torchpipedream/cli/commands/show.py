"""`torchpipedream show`: a layer graph as a readable table, optionally as a bar chart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import CommandError
from ...model.graph import LayerGraph
from ...model.profiles import load_profile
from ...util.units import human_bytes
from ...util.output_files import check_output, writing

DEFAULT_LIMIT = 60


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "show",
        help="print a layer graph (JSON or PipeDream graph.txt) as a table; --plot draws it",
        description="Print every layer's forward and backward time, activation and parameter "
        "size, with totals. Long graphs print their first --limit rows.",
    )
    p.add_argument("graph", help="a layer graph: JSON from `profile`, a PipeDream graph.txt, or the name of a "
                   "bundled reference profile (alexnet, vgg16, resnet50, gnmt, ...)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                   help=f"rows to print (default {DEFAULT_LIMIT}; 0 prints all)")
    p.add_argument("--sort", choices=["order", "compute", "activation", "params"], default="order",
                   help="row order: graph order (default) or largest first")
    p.add_argument("--plot", default=None, help="also draw per-layer compute/activation/parameters to this image (png, svg, pdf)")
    p.set_defaults(handler=run)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(graph: LayerGraph, limit: int = DEFAULT_LIMIT, sort: str = "order") -> str:
    """The table ``show`` prints (header, rows, an elision line, totals)."""
    keys = {
        "compute": lambda l: -l.compute_ms,
        "activation": lambda l: -l.activation_bytes,
        "params": lambda l: -l.parameter_bytes,
    }
    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    layers = sorted(graph.layers, key=keys[sort]) if sort in keys else list(graph.layers)
    shown = layers if limit <= 0 else layers[:limit]
    rows = [
        (
            str(index[l.name]),
            _clip(l.name, 32),
            _clip(("[input] " if l.is_input else "") + l.kind, 52),
            f"{l.forward_ms:.3f}",
            f"{l.backward_ms:.3f}",
            human_bytes(l.activation_bytes),
            human_bytes(l.parameter_bytes),
        )
        for l in shown
    ]
    t = graph.totals()
    total = ("", "total", f"{len(graph)} layers, {len(graph.edges)} edges", f"{t['forward_ms']:.3f}",
             f"{t['backward_ms']:.3f}", human_bytes(t["activation_bytes"]), human_bytes(t["parameter_bytes"]))
    header = ("#", "layer", "kind", "fwd ms", "bwd ms", "activation", "params")
    widths = [max(len(r[i]) for r in [header, total, *rows]) for i in range(len(header))]
    right = {0, 3, 4, 5, 6}

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    if len(shown) < len(layers):
        out.append(f"... {len(layers) - len(shown)} more layers (--limit 0 prints all)")
    out.append("  ".join("-" * w for w in widths))
    out.append(line(total))
    out.append(f"compute (forward + backward, input layers excluded): {t['compute_ms']:.3f} ms per minibatch")
    return "\n".join(out)


def plot_graph(graph: LayerGraph, path: Path) -> None:
    """Three stacked bar charts over the layers: compute (fwd+bwd), activation MB, parameter MB."""
    # lazy: matplotlib only with --plot (the command line starts without it)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(graph)
    xs = list(range(n))
    fig = Figure(figsize=(max(8.0, min(24.0, 0.25 * n)), 8.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    fwd = [0.0 if l.is_input else l.forward_ms for l in graph.layers]
    bwd = [0.0 if l.is_input else l.backward_ms for l in graph.layers]
    axes[0].bar(xs, fwd, label="forward", color="tab:blue")
    axes[0].bar(xs, bwd, bottom=fwd, label="backward", color="tab:orange")
    axes[0].set_ylabel("compute (ms)")
    axes[0].legend(loc="upper right")
    axes[1].bar(xs, [l.activation_bytes / 1e6 for l in graph.layers], color="tab:green")
    axes[1].set_ylabel("activation (MB)")
    axes[2].bar(xs, [l.parameter_bytes / 1e6 for l in graph.layers], color="tab:red")
    axes[2].set_ylabel("parameters (MB)")
    if n <= 80:
        axes[2].set_xticks(xs)
        axes[2].set_xticklabels(graph.names, rotation=90, fontsize=7)
    else:
        axes[2].set_xlabel("layer index")
    model = graph.meta.get("model") or graph.meta.get("source") or ""
    fig.suptitle(f"{model} layer profile (batch {graph.batch_size})".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise CommandError(f"--plot {plot}: use a .png, .svg or .pdf file name")
        check_output(plot, "--plot")
    graph = load_profile(args.graph)
    meta = graph.meta
    facts = [f"{len(graph)} layers", f"{len(graph.edges)} edges"]
    facts += [f"batch {graph.batch_size}"] if graph.batch_size else []
    facts += [f"{k} {meta[k]}" for k in ("model", "split", "device") if meta.get(k)]
    print(f"{args.graph}: " + ", ".join(facts))
    print(format_table(graph, args.limit, args.sort))
    if plot is not None:
        with writing(plot, "--plot"):
            plot_graph(graph, plot)
        print(f"wrote {plot}")
    return 0
