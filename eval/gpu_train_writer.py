"""Train chunk-KV writers (W-full, :mod:`ragkv.adapter.writer`) on a lent GPU, in two calls of the device tool.

The default model's GGUF (94 MB) is more than one call carries (64 MiB with the working tree), so it
travels in two parts, with what else the run needs (the converted checkpoint's config and tokenizer,
the teacher file, an optional writer to continue from), as one gzipped tar split in two; the wheels
the GPU image lacks (gguf, zstandard) travel beside the first part:

    python -m eval.gpu_train_writer prepare --stage .gpu --teacher T [--init W]  # here: .gpu/a, .gpu/b
    # device call 1 (carry [".gpu/a"]):  python3 -m eval.gpu_train_writer stash .gpu/a --smoke-device cuda
    # device call 2 (carry [".gpu/b"]), at once, on the same warm machine:
    #   python3 -m eval.gpu_train_writer run .gpu/b --out $OUT --budget-s 240 2>&1 | tee $OUT/train.log

``run`` joins the parts, rebuilds the checkpoint folder (weights dequantized from the GGUF, checked
byte for byte against this machine's), loads the model in float32 on CUDA, and trains each
``variant:lr`` run in turn (``iso``: chunk KV after BOS, today's convention; ``fixed``: after check (c)'s
fixed context), each in an equal share of the budget: a 3-step probe times a step, then the epochs
that fit (at most ``--max-epochs``). Adapters and one JSON summary go to ``--out``; the run ends with
one JSON line. Check them here with ``python -m eval.bench_adapter --adapters NAME=PATH[@fixed]``.
Works on CPU too (``--device cpu``, a small ``--limit``): that is how it is tested.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

#: what the GPU image lacks for this run: gguf (reading the GGUF) and zstandard (ragkv's store, which the
#: blend imports); downloaded for the image's python3.12 / x86-64
WHEELS = ("gguf==0.19.0", "zstandard==0.25.0")
PLATFORM_ARGS = (
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    "--abi",
    "none",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
    "--platform",
    "any",
)
META_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "source.json",
)
STASH = Path("/tmp/ragkv_gpu_stash")


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def prepare(stage: Path, teacher: Path | None, init: Path | None = None) -> dict:
    """Pack the GGUF, the converted folder's small files, the teacher file and an ``init`` writer into
    one gzipped tar, split into ``stage/a/part0`` and ``stage/b/part1``; the wheels go beside part0
    (``stage/a/wheels``, installed by ``stash``), the split balancing the two calls (~48 MiB each)."""
    from ragkv.model import DEFAULT_MODEL, load_model
    from ragkv.model.gguf import find_gguf
    from ragkv.model.loader import resolve_model_dir
    from ragkv.model.registry import pull

    folder = resolve_model_dir(DEFAULT_MODEL)
    gguf_file = find_gguf(Path(json.loads((folder / "source.json").read_text())["gguf"]))
    if gguf_file is None or not gguf_file.is_file():
        pull(DEFAULT_MODEL)
        raise SystemExit("the default model's GGUF file is missing; pulled it again, rerun prepare")
    model = load_model(DEFAULT_MODEL, dtype="float32", load_tokenizer=True)
    expect = {
        "fingerprint": model.fingerprint,
        "weights_sha256": _sha(folder / "model.safetensors"),
        "gguf_sha256": _sha(gguf_file),
    }
    wheels = stage / "a" / "wheels"
    for spec in WHEELS:
        if not any(wheels.glob(spec.split("==")[0] + "-*.whl")):
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            subprocess.run([*cmd, *PLATFORM_ARGS, "-d", str(wheels), spec], check=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        tar.add(gguf_file, arcname="model.gguf")
        for name in META_FILES:
            if (folder / name).is_file():
                tar.add(folder / name, arcname=f"meta/{name}")
        if teacher is not None and Path(teacher).is_file():
            tar.add(teacher, arcname="teacher.pt")
        if init is not None:
            tar.add(init, arcname="init.safetensors")
        data = json.dumps(expect).encode()
        info = tarfile.TarInfo("expect.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    wheel_bytes = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    half = max(0, (len(blob) - wheel_bytes) // 2)
    for sub, part in (("a", blob[:half]), ("b", blob[half:])):
        (stage / sub).mkdir(parents=True, exist_ok=True)
        (stage / sub / f"part{'0' if sub == 'a' else '1'}").write_bytes(part)
    return {"bytes": len(blob), "parts": [half, len(blob) - half], "wheels": wheel_bytes, **expect}


def stash(part_dir: Path, keep: Path = STASH) -> dict:
    """Copy the first part out of the working tree and install the wheels beside it (device call 1),
    where call 2 finds them."""
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy2(part_dir / "part0", keep / "part0")
    import importlib.util

    # only what this interpreter lacks (the wheels are the GPU image's python3.12 builds)
    wheels = [
        w
        for w in sorted((part_dir / "wheels").glob("*.whl"))
        if importlib.util.find_spec(w.name.split("-")[0]) is None
    ]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target"]
        subprocess.run([*cmd, str(keep / "site"), *map(str, wheels)], check=True)
    use_site(keep)
    return {"stashed": str(keep / "part0"), "bytes": (keep / "part0").stat().st_size, "wheels": len(wheels)}


def use_site(keep: Path = STASH) -> None:
    """Put the stashed wheels' site folder on ``sys.path`` (where the image lacks them)."""
    if (keep / "site").is_dir() and str(keep / "site") not in sys.path:
        sys.path.insert(0, str(keep / "site"))


def unpack(part_dir: Path, keep: Path = STASH) -> tuple[Path, dict]:
    """Join the parts, unpack, install the gguf wheel on ``sys.path`` and rebuild the checkpoint folder;
    returns ``(folder, expect)``."""
    blob = (keep / "part0").read_bytes() + (part_dir / "part1").read_bytes()
    root = keep / "unpacked"
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        tar.extractall(root, filter="data")
    expect = json.loads((root / "expect.json").read_text())
    if _sha(root / "model.gguf") != expect["gguf_sha256"]:
        raise SystemExit("the GGUF parts do not join into the original file")
    use_site(keep)
    from safetensors.torch import save_file

    from ragkv.model.gguf import dequantized_weights

    folder = root / "ckpt"
    shutil.copytree(root / "meta", folder)
    weights = dequantized_weights(root / "model.gguf")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, expect


def load(folder: Path, expect: dict, device: str):
    """The model from the rebuilt folder; its weights must be this machine's byte for byte. A
    fingerprint that differs only through another transformers' parsing of the same config and
    tokenizer files is replaced by the expected one (recorded)."""
    from ragkv.model import load_model

    weights_ok = _sha(folder / "model.safetensors") == expect["weights_sha256"]
    if not weights_ok:
        raise SystemExit("rebuilt weights differ from the CPU machine's: not training on another model")
    model = load_model(folder, dtype="float32", device=device)
    note = {"fingerprint_loaded": model.fingerprint, "fingerprint_expected": expect["fingerprint"]}
    if model.fingerprint != expect["fingerprint"]:
        model.fingerprint = expect["fingerprint"]
        note["restamped"] = True
    return model, note


def run(
    model,
    out: Path,
    runs: list[tuple[str, float]],
    budget_s: float,
    teacher: Path,
    limit: int | None = None,
    max_epochs: int = 8,
    batch: int = 8,
    rank: int = 8,
    init: Path | None = None,
    summary: dict | None = None,
) -> dict:
    """Train each ``(variant, lr)`` writer in an equal share of ``budget_s`` (from ``init`` when given);
    ``summary`` (returned) is written to ``out/writer_summary.json`` after every run, so a call cut
    off by its time limit still brings back what finished."""
    from eval.bench_adapter import fixed_context_ids
    from ragkv.adapter.data import training_set
    from ragkv.adapter.train import TrainConfig, build_examples, train

    items = training_set(model, 200, 40, 30)[:limit]
    t0 = time.perf_counter()
    build_examples(model, items, teacher, progress=False)  # the carried teachers; any missing computed here
    summary = dict(summary or {})
    summary.update({"items": len(items), "teacher_s": round(time.perf_counter() - t0, 1), "runs": []})
    share = budget_s / max(1, len(runs))
    for variant, lr in runs:
        ctx = fixed_context_ids(model) if variant == "fixed" else None
        name = f"writer-{variant}-lr{lr:g}"
        probe_cfg = TrainConfig(
            kind="writer", rank=rank, lr=lr, batch=batch, epochs=1, steps_per_epoch=3, save_every=10**6
        )
        probe = train(model, out / f".probe-{name}.safetensors", probe_cfg, items, False, teacher, ctx, init)
        step_s = probe["train_s"] / 3
        per_epoch = math.ceil(len(items) / batch)
        epochs = max(1, min(max_epochs, int((share - probe["train_s"]) / (step_s * per_epoch))))
        cfg = TrainConfig(kind="writer", rank=rank, lr=lr, batch=batch, epochs=epochs, save_every=10**6)
        s = train(model, out / f"{name}.safetensors", cfg, items, False, teacher, ctx, init)
        for f in [*out.glob(".probe-*"), out / f"{name}.ckpt.pt"]:  # only the adapters come back
            f.unlink(missing_ok=True)
        s.update({"variant": variant, "lr": lr, "step_s": round(step_s, 4), "config": asdict(cfg)})
        s["curve"] = s["curve"][:: max(1, len(s["curve"]) // 50)]
        summary["runs"].append(s)
        (out / "writer_summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in s.items() if k != "curve"}), flush=True)
    return summary


def smoke(device: str, out: Path) -> dict:
    """The training path on ``device`` with the repository's tiny model (seconds): a writer trained for
    2 steps on 2 continuation prompts, then its KV reused by a blend. Device call 1 runs it first."""
    import torch

    from ragkv.adapter.data import Item
    from ragkv.adapter.train import TrainConfig, train
    from ragkv.adapter.writer import WriterLoRA
    from ragkv.blend import prefill
    from ragkv.model import load_model
    from ragkv.model.forward import compute_chunk_kv

    m = load_model(Path(__file__).resolve().parents[1] / "models" / "stories260k", device=device)
    text = ["Tom had a red ball. He liked to play with it.", "Lily saw a big dog. The dog ran to her."]
    items = [
        Item("continue", text, None, suffix_text="One day, Tom", id="s0"),
        Item("continue", text[::-1], None, suffix_text="Lily said", id="s1"),
    ]
    cfg = TrainConfig(kind="writer", rank=2, epochs=1, batch=2, lr=1e-2, save_every=1)
    s = train(m, out / "smoke.safetensors", cfg, items=items, progress=False)
    w = WriterLoRA.load(out / "smoke.safetensors", m).to(device)
    kvs = [compute_chunk_kv(w.model(m), m.encode(t), fingerprint=m.fingerprint) for t in text]
    res = prefill(m, [m.config.bos_token_id], kvs, m.encode(" One day"), "blend", ratio=0.3)
    for f in out.glob("smoke*"):
        f.unlink()
    return {
        "smoke_ok": bool(torch.isfinite(res.logits).all()),
        "smoke_loss": s["loss_last"],
        "device": device,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--stage", default=".gpu")
    p.add_argument("--teacher", default=None, help="a teacher file of the training set (else computed there)")
    p.add_argument(
        "--init", default=None, help="a writer file the runs continue from (else they start at zero)"
    )
    s = sub.add_parser("stash")
    s.add_argument("part_dir")
    s.add_argument("--smoke-device", default=None, help="first run the training path there (cuda)")
    r = sub.add_parser("run")
    r.add_argument("part_dir")
    r.add_argument("--out", required=True)
    r.add_argument("--budget-s", type=float, default=300.0)
    r.add_argument("--runs", default="iso:1e-3,fixed:1e-3", help="variant:lr,... (variant: iso or fixed)")
    r.add_argument("--device", default="cuda")
    r.add_argument("--limit", type=int, default=None, help="first N training items (a CPU test)")
    r.add_argument("--max-epochs", type=int, default=8)
    r.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.cmd == "prepare":
        result = prepare(
            Path(args.stage),
            Path(args.teacher) if args.teacher else None,
            Path(args.init) if args.init else None,
        )
    elif args.cmd == "stash":
        result = stash(Path(args.part_dir))
        if args.smoke_device:
            result.update(smoke(args.smoke_device, STASH))
    else:
        import torch

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        folder, expect = unpack(Path(args.part_dir))
        model, note = load(folder, expect, args.device)
        runs = [(v, float(lr)) for v, lr in (x.split(":") for x in args.runs.split(","))]
        teacher = STASH / "unpacked" / "teacher.pt"
        init = STASH / "unpacked" / "init.safetensors"
        result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", **note}
        result = run(
            model,
            out,
            runs,
            args.budget_s,
            teacher,
            args.limit,
            args.max_epochs,
            args.batch,
            init=init if init.is_file() else None,
            summary=result,
        )
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
    return result


if __name__ == "__main__":
    main()
