"""Plot `tpu_vs_splash.py`'s JSON: ringeqx / best peer per shape and direction (bars).

```
python benchmarks/plot_tpu_vs_peers.py benchmarks/tpu_vs_splash_v5e_dense.json \
    benchmarks/tpu_vs_splash_v5e_d256.json --out docs/_static/tpu_vs_peers.png
```

Each shape is taken from the last file that has it; a bar is ringeqx's time over the faster of
splash (every tile 1024, fused backward) and tokamax (1024 tiles, K/V computed 512 at a time),
so below 1 is faster. A direction where no peer ran (out of HBM) is marked, not drawn.
"""

import argparse
import json

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


DIRECTIONS = ("forward", "forward+backward")


def _ratios(paths: list[str]) -> dict[str, dict[str, float | None]]:
    """`{shape: {direction: ringeqx / best peer, or None where no peer ran}}`."""
    shapes: dict[str, dict[str, float | None]] = {}
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        for name, shape in results["shapes"].items():
            shapes[name] = {
                d: shape[d]["candidates"]["ringeqx"].get("vs_best_peer")
                for d in DIRECTIONS
                if d in shape and "ringeqx" in shape[d]["candidates"]
            }
    return shapes


def plot(paths: list[str], out: str) -> None:
    shapes = _ratios(paths)
    names = sorted(shapes, key=lambda n: (n.split("-")[1], int(n.split("k")[0]), n))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.38
    for i, direction in enumerate(DIRECTIONS):
        xs = [n + (i - 0.5) * width for n in range(len(names))]
        ys = [shapes[name].get(direction) for name in names]
        ax.bar(
            [x for x, y in zip(xs, ys) if y is not None],
            [y for y in ys if y is not None],
            width,
            label=direction,
        )
        for x, y in zip(xs, ys):
            if y is None:
                ax.text(x, 0.3, "no peer: out of HBM", ha="center", fontsize=8, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("ringeqx / best peer (lower is faster)")
    ax.set_ylim(0, 1.4)
    ax.set_title("ring_attention on one v5e chip against splash attention and tokamax")
    ax.legend(loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="tpu_vs_splash.py --json files")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
