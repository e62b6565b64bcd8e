"""The data pipeline at scale: prepare throughput against the tokenizer's own batch
encode, and a 2-rank run's start-up time and memory against the corpus size.

    .venv/bin/python bench/data_scale.py                  # 10 MB, 100 MB, 1 GB
    .venv/bin/python bench/data_scale.py --sizes 10,100 --bpe-max-mb 10   # quicker

Corpora are generated locally under --dir (deleted afterwards unless --keep): a text
file of Zipf-distributed pseudo-words and an SFT .jsonl of prompt/completion rows made
of the same lines. Tokenizers: byte-level, and a byte-level BPE ``tokenizer.json``
(vocab 8192) trained on the first 5 MB of the text.

- prepare: ``fsdpkit.data.prepare`` (a worker per core) on the corpus, in MB/s of
  source and tokens/s; raw: the same tokenizer's batch encode (``encode_many``: the Rust
  batch API on every core for BPE, a numpy view of the bytes for byte-level) on the
  same texts held in memory, the JSON already parsed: no reading, parsing or writing.
  For corpora above --raw-sample-mb the raw rate is measured on their first
  --raw-sample-mb MB. ratio = prepare / raw. The byte-level "tokenizer" is a copy, so
  its raw rate is memory bandwidth and its ratio measures I/O, not tokenizing: the
  "I/O floor / prepare" column compares the prepare with reading the source and writing
  (fsync) as many bytes as the dataset holds (1.0: the prepare costs only its I/O).
  CPU ratio = the raw encode's CPU seconds per MB / the prepare's (its workers
  included): the same comparison in CPU time, which a loaded machine disturbs far less
  than wall time (1.0: the prepare adds no CPU work to the tokenizer's).
- train: 2 gloo ranks map the prepared dataset (byte-level) and run one step of a 2.9M
  parameter Llama; "first step" is the seconds from entering the rank function (process
  group up) to the end of that step; RSS is VmRSS at step 1 (RssAnon + RssFile, the
  file part being mapped shard pages).

BPE prepares above --bpe-max-mb are skipped (on a 2-core machine BPE runs at ~1-3 MB/s
of source; training rows use the byte-level datasets, whose size is the point).
Writes bench/results/data_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import results_io

from fsdpkit.config import DataConfig
from fsdpkit.data import build_tokenizer, prepare
from fsdpkit.testing import run_ranks

BASE_MB = 64
NAME = "data_scale"


def _lines(mb: int, seed: int) -> list[str]:
    """About ``mb`` MB of lines of Zipf-distributed pseudo-words."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "to", "ri", "ne", "su", "mo", "la", "pi", "do", "ve", "an", "er", "is"]
    vocab = np.array(
        sorted({"".join(rng.choice(syllables, size=rng.integers(1, 5))) for _ in range(30000)})
    )
    words = vocab[np.minimum(rng.zipf(1.15, size=mb * 170_000), len(vocab)) - 1]
    return [" ".join(words[i : i + 11]) for i in range(0, len(words), 11)]


def _chunks(base: list[str], mb: int, rng: np.random.Generator, lines: int) -> Any:
    """Groups of ``lines`` lines of ``base`` in fresh permutations, ~``mb`` MB in all."""
    written = 0
    while True:
        order = rng.permutation(len(base))
        for lo in range(0, len(order) - lines, lines):
            group = [base[i] for i in order[lo : lo + lines]]
            written += sum(len(x) + 1 for x in group)
            yield group
            if written >= mb * 1e6:
                return


def make_corpora(root: Path, sizes: list[int]) -> dict[tuple[str, int], Path]:
    base = _lines(BASE_MB, seed=0)
    rng = np.random.default_rng(1)
    out = {}
    for mb in sizes:
        out["text", mb], out["sft", mb] = root / f"text-{mb}mb.txt", root / f"sft-{mb}mb.jsonl"
        with out["text", mb].open("w") as f:
            for group in _chunks(base, mb, rng, 1000):
                f.write("\n".join(group) + "\n")
        with out["sft", mb].open("w") as f:
            for g in _chunks(base, mb, rng, 5):
                row = {"prompt": " ".join(g[:2]) + "\n", "completion": " ".join(g[2:])}
                f.write(json.dumps(row) + "\n")
    return out


def make_bpe(root: Path, text: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text.read_text()[:5_000_000]], trainer=trainer)
    (root / "bpe").mkdir(exist_ok=True)
    tok.save(str(root / "bpe" / "tokenizer.json"))
    (root / "bpe" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return root / "bpe"


def _texts(path: Path, kind: str, sample_mb: int) -> tuple[list[str], int]:
    raw = path.open("rb").read(int(sample_mb * 1e6))
    raw = raw[: raw.rfind(b"\n") + 1]
    if kind == "text":
        text = raw.decode()
        return [text[i : i + (1 << 20)] for i in range(0, len(text), 1 << 20)], len(raw)
    rows = [json.loads(line) for line in raw.splitlines()]
    return [x for r in rows for x in (r["prompt"], r["completion"])], len(raw)


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and its finished children (prepare
    workers): under a loaded machine wall time says little, CPU time per MB still
    compares two ways of doing the same work."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def raw_rate(
    path: Path, kind: str, tokenizer: Path | None, sample_mb: int
) -> tuple[float, float, float]:
    """(MB/s, tokens/s, CPU seconds per MB) of the tokenizer's batch encode."""
    tok = build_tokenizer(DataConfig(tokenizer=str(tokenizer) if tokenizer else None))
    texts, nbytes = _texts(path, kind, sample_mb)
    cpu = cpu_seconds()
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 1024):
        encoded = tok.encode_many(texts[i : i + 1024])  # type: ignore[attr-defined]
        tokens += sum(
            len(e.astype(np.uint16 if tok.vocab_size <= 65536 else np.uint32)) for e in encoded
        )
    took = time.perf_counter() - start
    return nbytes / 1e6 / took, tokens / took, (cpu_seconds() - cpu) / (nbytes / 1e6)


def prepare_rate(path: Path, out: Path, tokenizer: Path | None) -> dict[str, float]:
    cpu = cpu_seconds()
    start = time.perf_counter()
    done = prepare(
        DataConfig(tokenizer=str(tokenizer) if tokenizer else None),
        out,
        paths=[str(path)],
        progress=False,
    )
    took = time.perf_counter() - start
    c = done.manifest.counts
    return {
        "seconds": took,
        "mb_s": c["source_bytes"] / 1e6 / took,
        "tok_s": c["tokens"] / took,
        "tokens": c["tokens"],
        "cpu_s_per_mb": (cpu_seconds() - cpu) / (c["source_bytes"] / 1e6),
    }


def io_floor(source: Path, dataset: Path) -> float:
    """Seconds to read ``source`` and write (and fsync) as many bytes as the prepared
    ``dataset`` holds: what moving the bytes costs, the least a prepare can take."""
    size = sum(f.stat().st_size for f in dataset.rglob("*") if f.is_file())
    scratch = dataset.parent / "io-floor.bin"
    start = time.perf_counter()
    with source.open("rb") as f:
        while f.read(1 << 24):
            pass
    block = b"\0" * (1 << 24)
    with scratch.open("wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.write(block[: size % len(block)])
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    scratch.unlink()
    return took


def _rss() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _probe(rank: int, world: int, dataset: str, work: str, kind: str) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from fsdpkit import init_weights, shard
    from fsdpkit.config import RunConfig
    from fsdpkit.data import open_training_data
    from fsdpkit.loss.answers import sft_loss
    from fsdpkit.models.llama import Llama, LlamaConfig
    from fsdpkit.sharding.mesh import build_mesh

    start = time.perf_counter()
    seq = 512 if kind == "sft" else 256
    data = open_training_data(
        DataConfig(path=dataset, seq_len=seq),
        seed=0,
        micro_batch=4,
        grad_accum=1,
        dp_rank=rank,
        dp_world=world,
        eval_batches=2,
        work_dir=Path(work),
    )
    opened = time.perf_counter() - start
    cfg = LlamaConfig(
        vocab_size=data.tokenizer.vocab_size,
        dim=192,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=512,
        max_seq_len=seq,
    )
    model = Llama(cfg)
    init_weights(model, seed=0)
    shard(model, RunConfig(), mesh=build_mesh(device_type="cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = data.loader.next_batch()
    if kind == "sft":
        loss = sft_loss(model, batch)
    else:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters()) * world
    return {
        "first_step_s": time.perf_counter() - start,
        "open_s": opened,
        **_rss(),
        "params": params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="10,100,1000", help="corpus sizes in MB")
    parser.add_argument("--bpe-max-mb", type=int, default=100)
    parser.add_argument("--raw-sample-mb", type=int, default=100)
    parser.add_argument("--dir", default="/tmp/fsdpkit-data-bench")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--render-docs",
        action="store_true",
        help="only rewrite docs/data.md's table from bench/results/data_scale.json",
    )
    args = parser.parse_args()
    if args.render_docs:
        render_docs()
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    began = time.perf_counter()
    try:
        rows = _run(root, sizes, args)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _report(rows, args, time.perf_counter() - began)
    render_docs()


def _run(root: Path, sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    corpora = make_corpora(root, sizes)
    bpe = make_bpe(root, corpora["text", sizes[0]])
    rows = []
    for (kind, mb), path in corpora.items():
        for name, tok in (("byte", None), ("bpe", bpe)):
            if name == "bpe" and mb > args.bpe_max_mb:
                continue
            out = root / f"ds-{kind}-{mb}-{name}"
            row: dict[str, Any] = {"kind": kind, "mb": mb, "tokenizer": name}
            row["raw_mb_s"], row["raw_tok_s"], row["raw_cpu_s_per_mb"] = raw_rate(
                path, kind, tok, args.raw_sample_mb
            )
            row |= {f"prepare_{k}": v for k, v in prepare_rate(path, out, tok).items()}
            row["ratio"] = row["prepare_tok_s"] / row["raw_tok_s"]
            row["cpu_ratio"] = row["raw_cpu_s_per_mb"] / row["prepare_cpu_s_per_mb"]
            row["io_floor_s"] = io_floor(path, out)
            row["io_ratio"] = row["io_floor_s"] / row["prepare_seconds"]
            if name == "byte":
                row |= _train_rows(out, root / f"run-{kind}-{mb}", kind)
            print(_line(row), flush=True)
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
        path.unlink()
    return rows


def _train_rows(dataset: Path, work: Path, kind: str) -> dict[str, Any]:
    """Two 2-rank starts on the dataset: the first (cold: an SFT run lays out and saves
    its rows) and the second (warm: what every later start and resume sees)."""
    out: dict[str, Any] = {}
    for when in ("cold", "warm"):
        ranks = run_ranks(_probe, world_size=2, args=(str(dataset), str(work), kind), timeout_s=900)
        out[f"{when}_open_s"] = max(r["open_s"] for r in ranks)
        out[f"{when}_first_step_s"] = max(r["first_step_s"] for r in ranks)
        out[f"{when}_rss_mb"] = max(r["VmRSS"] for r in ranks)
        out[f"{when}_rss_anon_mb"] = max(r["RssAnon"] for r in ranks)
        out[f"{when}_rss_file_mb"] = max(r["RssFile"] for r in ranks)
        out["params"] = ranks[0]["params"]
    return out


def _line(r: dict[str, Any]) -> str:
    train = ""
    for when in ("cold", "warm"):
        if f"{when}_first_step_s" in r:
            train += (
                f" | {when}: open {r[f'{when}_open_s']:5.2f}s first step "
                f"{r[f'{when}_first_step_s']:4.1f}s RSS {r[f'{when}_rss_mb']:4.0f} MB "
                f"({r[f'{when}_rss_anon_mb']:.0f} anon)"
            )
    return (
        f"{r['kind']:<5} {r['mb']:>6} MB {r['tokenizer']:<5} prepare {r['prepare_mb_s']:7.1f} MB/s "
        f"{r['prepare_tok_s'] / 1e6:7.2f} Mtok/s | raw {r['raw_mb_s']:7.1f} MB/s "
        f"{r['raw_tok_s'] / 1e6:7.2f} Mtok/s | ratio {r['ratio']:4.2f} (CPU {r['cpu_ratio']:4.2f}) "
        "| I/O floor / prepare "
        f"{r['io_ratio']:4.2f}{train}"
    )


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> None:
    print("\nstart-up and memory, largest vs smallest corpus (byte-level, 2 ranks):")
    ratios = {}
    for kind in ("text", "sft"):
        trained = sorted(
            (r for r in rows if r["kind"] == kind and "warm_first_step_s" in r),
            key=lambda r: r["mb"],
        )
        if len(trained) >= 2:
            lo, hi = trained[0], trained[-1]
            ratios[kind] = {
                f"{w}_{m}": hi[f"{w}_{m}_{u}"] / lo[f"{w}_{m}_{u}"]
                for w in ("cold", "warm")
                for m, u in (("first_step", "s"), ("rss", "mb"))
            }
            print(
                f"  {kind}: {hi['mb']} MB vs {lo['mb']} MB: "
                + ", ".join(f"{k} x{v:.2f}" for k, v in ratios[kind].items())
            )
    results_io.write(
        NAME,
        command=(
            f"python bench/data_scale.py --sizes {args.sizes} --bpe-max-mb "
            f"{args.bpe_max_mb} --raw-sample-mb {args.raw_sample_mb}"
        ),
        seconds=round(seconds, 1),
        rows=rows,
        large_vs_small=ratios,
    )


DOCS = results_io.ROOT / "docs" / "data.md"


def _cell(row: dict[str, Any], when: str) -> str:
    if f"{when}_rss_mb" not in row:
        return " | | |"
    return (
        f" {row[f'{when}_open_s']:.2f} s | {row[f'{when}_first_step_s']:.1f} s | "
        f"{row[f'{when}_rss_mb']:,.0f} MB |"
    )


def render(results: dict[str, Any]) -> str:
    """The docs table of a results file (docs/data.md holds exactly this between the
    markers; tests/unit/test_bench_docs.py checks it)."""
    head = (
        results_io.provenance(results, NAME) + "\n\n"
        "| corpus | tokenizer | prepare MB/s | raw MB/s | ratio | CPU ratio | I/O floor / "
        "prepare | open, first step, RSS per rank: cold | | | warm | | |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |\n"
    )
    lines = []
    for r in sorted(results["rows"], key=lambda r: (r["kind"], r["tokenizer"], r["mb"])):
        size = f"{r['mb']} MB" if r["mb"] < 1000 else f"{r['mb'] / 1000:g} GB"
        kind = "SFT" if r["kind"] == "sft" else "text"
        lines.append(
            f"| {kind} {size} | {r['tokenizer']} | {r['prepare_mb_s']:,.1f} | "
            f"{r['raw_mb_s']:,.1f} | {r['ratio']:.2f} | {r['cpu_ratio']:.2f} | "
            f"{r['io_ratio']:.2f} |" + _cell(r, "cold") + _cell(r, "warm")
        )
    ratios = "; ".join(
        f"{kind}: " + ", ".join(f"{k.replace('_', ' ')} x{v:.2f}" for k, v in sorted(q.items()))
        for kind, q in results["large_vs_small"].items()
    )
    return head + "\n".join(lines) + f"\n\nLargest vs smallest corpus (byte-level): {ratios}.\n"


def render_docs() -> None:
    """Rewrite docs/data.md's benchmark table from the results file."""
    results_io.render_into(DOCS, NAME, render(results_io.read(NAME)))


if __name__ == "__main__":
    main()
