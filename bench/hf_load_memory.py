"""Per-rank host memory while a ``model.hf`` directory is loaded, against one full copy.

    python bench/hf_load_memory.py                      # Llama, d=1024, 8 layers, vocab 32000
    python bench/hf_load_memory.py --dim 2048 --layers 4 --world 2 4
    python bench/hf_load_memory.py --render-docs        # only re-render docs/models.md

Writes a random-weight Llama directory once (under --cache), then on N gloo ranks runs
what ``fsdpkit train model.hf=DIR`` does before the first step: build on meta, shard,
read each rank's own slices (DCP's HuggingFaceStorageReader). It measures, per rank:

- tensor peak: the largest live CPU tensor bytes during build + shard + load, from c10's
  allocator with process-wide accounting ([Note: measuring CPU peaks]); this is the
  number the "below one full copy" claim is about;
- RSS high-water increase: the peak resident set during loading minus the RSS before
  it (the kernel's high-water mark is reset first), and its two parts sampled every
  2 ms: anonymous memory (the process's own: tensors, allocator caching, Python) and
  file pages (the safetensors files each rank maps: page cache, shared and reclaimable).

The control row is what a factory without meta does: the whole model built on the
CPU in every rank, its weights loaded, then sharded; measured the same way. Ratios
are against the full model's fp32 bytes. Every row goes to
``bench/results/hf_load_memory.json``; docs/models.md's table is rendered from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # tiny_hf

import results_io

from fsdpkit.testing import run_ranks


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Sampler:
    """Highest RssAnon / RssFile seen while running (sampled every 2 ms on a thread): the
    kernel keeps a high-water mark of their sum only."""

    def __init__(self) -> None:
        self.peaks = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            for field in self.peaks:
                self.peaks[field] = max(self.peaks[field], _status_bytes(field))

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _reset_rss_peak() -> int:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _load_fsdpkit(model_dir: str) -> None:
    from fsdpkit import build_mesh, shard
    from fsdpkit.config import ModelConfig, RunConfig
    from fsdpkit.models.factory import build_model

    built = build_model(ModelConfig(hf=model_dir), vocab_size=256, seq_len=128, seed=0)
    cfg = RunConfig(model=ModelConfig(hf=model_dir))  # blocks: the model's _no_split_modules
    shard(built.module, cfg, mesh=build_mesh(), init=built.init)
    _load_fsdpkit.model = built.module  # type: ignore[attr-defined]  # alive while measured


def _load_full_copy(model_dir: str) -> None:
    """A factory without meta: the whole model on the CPU in every rank, then sharded."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdpkit import build_mesh, shard
    from fsdpkit.config import RunConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        model.load_state_dict(load_file(str(file)), strict=False)
    shard(model, RunConfig(), mesh=build_mesh())
    _load_full_copy.model = model  # type: ignore[attr-defined]


def _measure(rank: int, world: int, model_dir: str, how: str) -> dict[str, Any]:
    from fsdpkit.cpumem import enable_process_wide_accounting, live_bytes, peak_bytes

    enable_process_wide_accounting()
    fn = {"model.hf": _load_fsdpkit, "full copy": _load_full_copy}[how]
    import transformers  # noqa: F401  # imports are not the model

    base_tensors, base_rss = live_bytes(), _reset_rss_peak()
    base_anon, base_file = _status_bytes("RssAnon"), _status_bytes("RssFile")
    start = time.perf_counter()
    with _Sampler() as sampled:
        peak = peak_bytes(lambda: fn(model_dir))
    return {
        "tensor_peak": peak - base_tensors,
        "held_after": live_bytes() - base_tensors,
        "rss": _status_bytes("VmHWM") - base_rss,
        "anon": sampled.peaks["RssAnon"] - base_anon,
        "file": sampled.peaks["RssFile"] - base_file,
        "seconds": time.perf_counter() - start,
    }


def _write(cache: Path, *, dim: int, layers: int, vocab: int) -> tuple[Path, int]:
    from tiny_hf import write_tiny_model

    out = cache / f"llama-d{dim}-l{layers}-v{vocab}"
    if not (out / "model.safetensors").is_file() and not any(out.glob("*.index.json")):
        write_tiny_model(
            out,
            arch="llama",
            tokenizer=False,
            vocab_size=vocab,
            dim=dim,
            layers=layers,
            heads=dim // 64,
            kv_heads=max(dim // 256, 1),
            ffn=int(dim * 2.75),
        )
    nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return out, nbytes


NAME = "hf_load_memory"
DOCS = results_io.ROOT / "docs" / "models.md"
MIB = 2**20


def render(results: dict[str, Any]) -> str:
    """docs/models.md's table (tests/unit/test_bench_docs.py checks it)."""
    full = results["full_copy_bytes"]
    lines = [
        results_io.provenance(results, NAME),
        "",
        f"Llama d={results['dim']}, {results['layers']} layers, vocabulary {results['vocab']}: "
        f"{full / MIB:.0f} MiB of fp32 weights (one full copy); per rank, at the peak of loading.",
        "",
        "| load | ranks | tensor peak | x full copy | held after | RSS increase | x full copy "
        "| anonymous | file pages | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        load = "`model.hf`" if r["load"] == "model.hf" else "full copy (control)"
        lines.append(
            f"| {load} | {r['ranks']} | {r['tensor_peak'] / MIB:.0f} MiB | "
            f"{r['tensor_peak'] / full:.2f} | {r['held_after'] / MIB:.0f} MiB | "
            f"{r['rss'] / MIB:.0f} MiB | {r['rss'] / full:.2f} | {r['anon'] / MIB:.0f} MiB | "
            f"{r['file'] / MIB:.0f} MiB | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def render_docs() -> None:
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--cache", default="/tmp/fsdpkit-bench-hf")
    p.add_argument("--render-docs", action="store_true", help="only re-render docs/models.md")
    args = p.parse_args()
    if args.render_docs:
        render_docs()
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    model_dir, full = _write(Path(args.cache), dim=args.dim, layers=args.layers, vocab=args.vocab)
    print(f"model: {model_dir} ({full / MIB:.0f} MiB of fp32 weights = one full copy)\n")
    rows = []
    for how, world in [("model.hf", w) for w in args.world] + [("full copy", args.world[0])]:
        res = run_ranks(_measure, world_size=world, args=(str(model_dir), how), timeout_s=900)
        worst = max(res, key=lambda r: r["tensor_peak"])
        row = {"load": how, "ranks": world, "tensor_peak": worst["tensor_peak"]}
        row["held_after"] = worst["held_after"]
        row |= {k: max(r[k] for r in res) for k in ("rss", "anon", "file", "seconds")}
        print(row, flush=True)
        rows.append(row)
    results_io.write(
        NAME, dim=args.dim, layers=args.layers, vocab=args.vocab, full_copy_bytes=full, rows=rows
    )
    render_docs()


if __name__ == "__main__":
    main()
